"""Prompt logprobs: each computed prompt token's logits score the prompt token after it.

A step plans which of its tokens score a prompt token for a request that asked (``plan_prompt_logprobs``),
computes their logits a chunk at a time after the forward pass (the logits of a whole prompt would be
[tokens, vocab]) and copies the scores to host memory behind the step; after the step's sync each request gets
its ``PromptLogprobsChunk``::

    plan:    step tokens ──(asked, not the prompt's last)──> token indices, their targets, per-request spans
    launch:  hidden[indices] ──LM head, chunks of 1,024──> chosen, ranks, top-N ──copy──> pinned host
    collect: host pieces ──spans──> {request id: PromptLogprobsChunk(first position, entries)}

Steps with prompt logprobs run eagerly: no captured graph keeps the hidden states of every token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engine.outputs import Logprobs, PromptLogprobsChunk
from engine.worker.input_batch import InputBatch
from engine.worker.step_buffers import copy_to_host, upload

# Prompt logprobs are computed this many tokens at a time: [rows, vocab] float32 logits each.
_CHUNK = 1024


class PromptSpan(NamedTuple):
    """One request's share of a step's prompt logprobs, in the step's token order."""

    request_id: str
    first_position: int  # the prompt position of its first target
    count: int
    num_top: int  # the top-N it asked for


@dataclass(slots=True)
class PromptLogprobsPlan:
    """The tokens of a step that score a prompt token, for the requests that asked for prompt logprobs."""

    token_indices: torch.Tensor  # [K] positions in the step's flat tokens, on the device
    token_indices_host: np.ndarray  # the same, in host memory (for the other tensor-parallel ranks)
    targets: torch.Tensor  # [K] the prompt token each of them predicts, on the device
    target_ids: np.ndarray  # the same, in host memory
    num_top: int  # top-N computed for all K (the largest any of the requests asked for)
    spans: list[PromptSpan]


@dataclass(slots=True)
class PromptLogprobsCopy:
    """A step's prompt logprobs on their way to host memory."""

    plan: PromptLogprobsPlan
    chosen: torch.Tensor  # [K] host
    ranks: torch.Tensor  # [K]
    top_ids: torch.Tensor  # [K, num_top]
    top_values: torch.Tensor  # [K, num_top]
    ready: torch.cuda.Event | None  # recorded after the copies (None on the CPU)

    def collect(self) -> dict[str, PromptLogprobsChunk]:
        """Each request's entries, once the copies have landed."""
        if self.ready is not None:
            self.ready.synchronize()
        chosen, ranks, top_ids, top_vals = (t.tolist() for t in (self.chosen, self.ranks, self.top_ids,
                                                                  self.top_values))
        target_ids = self.plan.target_ids
        out, at = {}, 0
        for rid, first, count, num_top in self.plan.spans:
            end = at + count
            out[rid] = PromptLogprobsChunk(first, [
                Logprobs(t, c, r, ids[:num_top], vals[:num_top]) for t, c, r, ids, vals in zip(
                    target_ids[at:end].tolist(), chosen[at:end], ranks[at:end], top_ids[at:end], top_vals[at:end])])
            at = end
        return out


def plan_prompt_logprobs(batch: InputBatch, rows: np.ndarray, token_req: np.ndarray, token_rows: np.ndarray,
                         positions: np.ndarray, req_ids: list[str], order: np.ndarray,
                         device: torch.device) -> PromptLogprobsPlan | None:
    """Which of the step's tokens score a prompt token for a request that asked for prompt logprobs.

    ``rows``: the step's InputBatch rows in batch order; ``token_req``, ``token_rows``, ``positions``: each
    token's batch index, row and position; ``req_ids[order[i]]``: the request of batch index i."""
    b = batch
    wanted = (b.num_prompt_logprobs[token_rows] >= 0) & (positions + 1 < b.num_prompt_tokens[token_rows])
    idx = np.nonzero(wanted)[0]
    if not len(idx):
        return None
    targets = b.token_ids[token_rows[idx], positions[idx] + 1]
    batch_index, first, counts = np.unique(token_req[idx], return_index=True, return_counts=True)
    spans = [PromptSpan(req_ids[order[i]], int(positions[idx[f]]) + 1, int(c), int(b.num_prompt_logprobs[rows[i]]))
             for i, f, c in zip(batch_index.tolist(), first.tolist(), counts.tolist())]
    return PromptLogprobsPlan(token_indices=upload(idx, device), token_indices_host=idx,
                              targets=upload(targets, device), target_ids=targets,
                              num_top=max(s.num_top for s in spans), spans=spans)


def launch_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, plan: PromptLogprobsPlan
                           ) -> PromptLogprobsCopy:
    """Score each planned prompt token from the hidden state before it, a chunk at a time; the pieces are
    copied to host memory behind the step."""
    pieces = []
    for start in range(0, len(plan.targets), _CHUNK):
        end = start + _CHUNK
        logits = model.compute_logits(hidden[plan.token_indices[start:end]]).float()
        pieces.append(score_tokens(logits, plan.targets[start:end], plan.num_top))
        del logits
    chosen, ranks, top_ids, top_values = (copy_to_host(torch.cat(parts)) for parts in zip(*pieces))
    ready = None
    if hidden.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()
    return PromptLogprobsCopy(plan, chosen, ranks, top_ids, top_values, ready)


def follow_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, token_indices: torch.Tensor) -> None:
    """A follower rank's part in rank 0's prompt logprobs: the same chunks of logits (gathered)."""
    for start in range(0, len(token_indices), _CHUNK):
        model.compute_logits(hidden[token_indices[start:start + _CHUNK]])


def score_tokens(
    logits: torch.Tensor,  # [N, vocab] float32
    targets: torch.Tensor,  # [N]
    num_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logprobs of ``targets`` from raw logits, without the [N, vocab] log-softmax: a logprob is the logit
    less the row's log-sum-exp, and ranks and the top-N are the same on logits. Returns (chosen, ranks, top ids,
    top values), as ``engine.worker.logprobs.gather_logprobs``."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
    chosen = logits.gather(-1, targets[:, None])  # [N, 1]
    ranks = (logits > chosen).sum(dim=-1) + 1
    top_vals, top_ids = logits.topk(max(num_top, 1), dim=-1)
    return (chosen - lse)[:, 0], ranks, top_ids, top_vals - lse
