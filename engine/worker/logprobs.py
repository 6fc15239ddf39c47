"""The logprobs of a step's sampled tokens, for the rows that asked for them.

They are gathered on the device from the sampler's raw log-softmax (the model's own distribution), copied to
host memory behind the step, and assembled into ``Logprobs`` after the step's one sync::

    launch:  raw [N, vocab] --gather--> chosen, ranks, top-N (+ named tokens) --copy--> pinned host  (LogprobsCopy)
    finish:  LogprobsCopy.entries(token ids, request ids) --> {request id: Logprobs}
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
    # Rows that named their tokens (logprob_token_ids): (their ids padded to [K, longest], counts [K]).
    named: tuple[np.ndarray, np.ndarray] | None
    chosen: torch.Tensor  # [K] the sampled token's logprob (host)
    ranks: torch.Tensor  # [K]
    top_ids: torch.Tensor  # [K, max top-N]
    top_values: torch.Tensor  # [K, max top-N]
    named_values: torch.Tensor | None  # [K, longest] the named tokens' logprobs

    def entries(self, token_ids: list[int], request_ids: list[str]) -> dict[str, Logprobs]:
        """Per request that asked, its sampled token's ``Logprobs``: ``token_ids`` and ``request_ids`` are the
        step's sampled tokens and requests, in row order."""
        named = None if self.named is None else (*self.named, self.named_values.tolist())
        entries = build_logprobs([token_ids[i] for i in self.rows], self.chosen.tolist(), self.ranks.tolist(),
                                 self.top_ids.tolist(), self.top_values.tolist(), self.num_top.tolist(), named)
        return {request_ids[i]: e for i, e in zip(self.rows.tolist(), entries)}


def copy_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, rows: np.ndarray, batch: InputBatch,
                  device: torch.device) -> LogprobsCopy:
    """Gather the logprob pieces of the sampled ``rows`` (InputBatch rows) that asked for them on the device
    and queue their copy to host memory behind the step, so that ``finish`` reads them after the step's one
    sync, without waiting for a step planned after it."""
    num_top = batch.num_logprobs[rows]
    wanted = np.nonzero(num_top >= 0)[0]
    idx = upload(wanted, device)
    wanted_logprobs = raw_logprobs[idx]
    pieces = gather_logprobs(wanted_logprobs, sampled[idx], int(num_top.max()))
    named, named_values = None, None
    if batch.logprob_token_ids:
        rows_named = [batch.logprob_token_ids.get(r) for r in rows[wanted].tolist()]
        if any(ids is not None for ids in rows_named):
            named = pad_token_ids(rows_named)
            named_values = copy_to_host(wanted_logprobs.gather(-1, upload(named[0], device)))
    return LogprobsCopy(wanted, num_top[wanted], named, *(copy_to_host(t) for t in pieces), named_values)


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
