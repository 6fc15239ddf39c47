"""The logprobs of a step's sampled tokens, for the rows that asked for them.

They are gathered on the device from the sampler's raw log-softmax (the model's own distribution), copied to
host memory behind the step, and assembled into ``Logprobs`` after the step's one sync::

    launch:  raw [N, vocab] --gather--> chosen, ranks, top-N (+ named tokens) --copy--> pinned host  (LogprobsCopy)
    finish:  LogprobsCopy.entries(token ids, request ids) --> {request id: [Logprobs]}

A verification step (speculative decoding) has 1 + k positions per row: the pieces are gathered for every position
of the rows that ask, and ``entries`` keeps one per token each row keeps (its accepted proposals, then its sampled
token), which is known only after the step's sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.outputs import Logprobs
from engine.worker.input_batch import InputBatch
from engine.worker.step_buffers import copy_to_host, upload


@dataclass(slots=True)
class LogprobsCopy:
    """A step's sampled-token logprobs on their way to host memory (valid once the step's ready event passed)."""

    rows: np.ndarray  # [K] the indices, among the step's sampled rows, of those that asked for logprobs
    num_top: np.ndarray  # [K] the top-N each of them asked for
    starts: np.ndarray  # [K] where each one's positions start in the pieces below (P of them in all)
    # Rows that named their tokens (logprob_token_ids): (their ids padded to [P, longest], counts [P]).
    named: tuple[np.ndarray, np.ndarray] | None
    chosen: torch.Tensor  # [P] the logprob of the token at each position (host)
    ranks: torch.Tensor  # [P]
    top_ids: torch.Tensor  # [P, max top-N]
    top_values: torch.Tensor  # [P, max top-N]
    named_values: torch.Tensor | None  # [P, longest] the named tokens' logprobs

    def entries(self, token_ids: list[int], request_ids: list[str], accepted=()) -> dict[str, list[Logprobs]]:
        """Per request that asked, a ``Logprobs`` per token it keeps: ``token_ids`` and ``request_ids`` are the
        step's sampled tokens and requests, in row order; ``accepted``: each row's accepted proposals, which come
        before its sampled token (a verification step's)."""
        picked, kept = [], []  # positions, and the tokens there
        for k, i in enumerate(self.rows.tolist()):
            tokens = [*accepted[i], token_ids[i]] if accepted else [token_ids[i]]
            picked += range(self.starts[k], self.starts[k] + len(tokens))
            kept.append(tokens)
        at = np.asarray(picked, dtype=np.int64)
        named = None if self.named is None else (self.named[0][at], self.named[1][at], self.named_values[at].tolist())
        num_top = np.repeat(self.num_top, [len(tokens) for tokens in kept])
        entries = build_logprobs([t for tokens in kept for t in tokens], self.chosen[at].tolist(),
                                 self.ranks[at].tolist(), self.top_ids[at].tolist(), self.top_values[at].tolist(),
                                 num_top.tolist(), named)
        out, start = {}, 0
        for i, tokens in zip(self.rows.tolist(), kept):
            out[request_ids[i]], start = entries[start : start + len(tokens)], start + len(tokens)
        return out


def copy_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, rows: np.ndarray, batch: InputBatch,
                  device: torch.device, positions: np.ndarray | None = None) -> LogprobsCopy:
    """Gather the logprob pieces of the sampled ``rows`` (InputBatch rows) that asked for them on the device
    and queue their copy to host memory behind the step, so that ``finish`` reads them after the step's one
    sync, without waiting for a step planned after it. ``raw_logprobs`` and ``tokens`` have a position per row, or
    ``positions`` [rows] of them each, row after row (a verification step's 1 + k)."""
    num_top = batch.num_logprobs[rows]
    wanted = np.nonzero(num_top >= 0)[0]
    per_row = np.ones(len(rows), dtype=np.int64) if positions is None else positions.astype(np.int64)
    first = np.cumsum(per_row) - per_row
    at = np.repeat(first[wanted], per_row[wanted]) + offsets_within(per_row[wanted] - 1)
    idx = upload(at, device)
    wanted_logprobs = raw_logprobs[idx]
    pieces = gather_logprobs(wanted_logprobs, tokens[idx], int(num_top.max()))
    named, named_values = None, None
    if batch.logprob_token_ids:
        rows_named = [batch.logprob_token_ids.get(r) for r in np.repeat(rows[wanted], per_row[wanted]).tolist()]
        if any(ids is not None for ids in rows_named):
            named = pad_token_ids(rows_named)
            named_values = copy_to_host(wanted_logprobs.gather(-1, upload(named[0], device)))
    starts = np.cumsum(per_row[wanted]) - per_row[wanted]
    return LogprobsCopy(wanted, num_top[wanted], starts, named, *(copy_to_host(t) for t in pieces), named_values)


def offsets_within(counts: np.ndarray) -> np.ndarray:
    """0 .. k for each row's k in ``counts``, concatenated: a verification step's positions of a row (its k
    proposals and the token after them), each numbered within its row."""
    sizes = counts + 1
    return np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)


def gather_logprobs(
    raw_logprobs: torch.Tensor,  # [N, vocab]
    sampled: torch.Tensor,  # [N]
    num_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-side pieces of the logprobs: the sampled tokens' logprob and rank, and the top-N."""
    chosen = raw_logprobs.gather(-1, sampled[:, None])  # [N, 1]
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
    top_vals, top_ids = raw_logprobs.topk(max(num_top, 1), dim=-1)
    return chosen[:, 0], ranks, top_ids, top_vals


def pad_token_ids(rows: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
    """Per row, its token ids (None: none), as one [rows, longest] int64 array padded with token 0, and each row's
    count: the index of one gather over the rows' logprobs."""
    counts = np.asarray([0 if ids is None else len(ids) for ids in rows], dtype=np.int64)
    padded = np.zeros((len(rows), max(int(counts.max(initial=0)), 1)), dtype=np.int64)
    for i, ids in enumerate(rows):
        if ids is not None:
            padded[i, : len(ids)] = ids
    return padded, counts


def build_logprobs(
    token_ids: list[int], chosen: list[float], ranks: list[int], top_ids: list[list[int]], top_vals: list[list[float]],
    num_top: list[int], explicit: tuple[np.ndarray, np.ndarray, list[list[float]]] | None = None,
) -> list[Logprobs]:
    """Host-side assembly, one entry per row, each with that row's own top-N; ``explicit``: (padded token ids,
    counts, their logprobs) of the rows that named their tokens (logprob_token_ids), which take the top-N's place."""
    entries = [
        Logprobs(token_ids[i], chosen[i], ranks[i], top_ids[i][: num_top[i]], top_vals[i][: num_top[i]])
        for i in range(len(token_ids))
    ]
    if explicit is not None:
        ids, counts, values = explicit
        for i in np.nonzero(counts)[0].tolist():
            n = int(counts[i])
            entries[i].top_token_ids, entries[i].top_logprobs = ids[i, :n].tolist(), values[i][:n]
    return entries
