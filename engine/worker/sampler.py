"""Batched sampling on the device: penalties, temperature, top-k, top-p, min-p, seeds.

Everything is a tensor operation over the whole batch; the only Python loop is over
the requests that carry their own seed (one noise draw each, no host sync). Sampling
uses the exponential-race form of the Gumbel trick: ``argmax(p / q)`` with
``q ~ Exp(1)`` draws from ``p``, and a request's noise comes from its own generator,
so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import xgrammar as xgr

from engine.ops.greedy import argmax_rows
from engine.outputs import Logprobs


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, already on the device."""

    temperature: torch.Tensor  # [N] float32; 0 means greedy
    top_k: torch.Tensor | None  # [N] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [N] float32; None if no row uses it
    min_p: torch.Tensor | None  # [N] float32; None if no row uses it
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> its seeded generator
    all_greedy: bool = False
    # Penalties (None if no row uses them).
    presence_penalty: torch.Tensor | None = None  # [N]
    frequency_penalty: torch.Tensor | None = None  # [N]
    repetition_penalty: torch.Tensor | None = None  # [N]
    output_token_counts: torch.Tensor | None = None  # [N, vocab] int: how often each token was generated
    prompt_token_mask: torch.Tensor | None = None  # [N, vocab] bool: tokens present in the prompt
    max_num_logprobs: int = -1  # -1: no row wants logprobs
    # (rows, token ids) that must not be sampled yet: EOS and stop tokens before min_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # (rows, token ids, biases) added to the logits (OpenAI's logit_bias).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (rows limited to some tokens, and the (row, token id) pairs they may sample): vLLM's allowed_token_ids.
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # [N, ceil(vocab / 32)] int32: the tokens each row's grammar allows (bit set = allowed), meant for the
    # rows in bitmask_rows only; None: no grammar.
    bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] | None = None


class Sampler:
    def __call__(self, logits: torch.Tensor, st: SamplingTensors,
                 greedy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sample one token per row of ``logits`` [N, vocab] (any float dtype; computed in float32).

        ``greedy``: each row's argmax of these very logits [N], where it was taken already (inside a decode CUDA
        graph); used as the greedy tokens when no grammar, bias, ban or penalty changes the logits first.
        Returns the sampled ids [N] and, when any row asked for logprobs, the raw
        log-softmax [N, vocab] of the model's distribution (before penalties and filters).
        """
        changed = (st.banned is not None or st.repetition_penalty is not None or st.logit_bias is not None
                   or st.allowed is not None)
        if changed or st.bitmask is not None:
            greedy = None  # the argmax of the logits before these changes
        if st.all_greedy and st.max_num_logprobs < 0 and not changed:
            if greedy is not None:
                return greedy, None
            if st.bitmask is not None:  # in place, in the logits' own dtype: no float32 copy of the batch
                xgr.apply_token_bitmask_inplace(logits, st.bitmask, vocab_size=logits.shape[-1],
                                                indices=st.bitmask_rows)
            return argmax_rows(logits), None  # exact in any dtype: upcasting preserves the order
        logits = logits.float()
        # Logprobs are the model's own distribution: before grammars, biases, penalties and filters.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if st.max_num_logprobs >= 0 else None
        if st.bitmask is not None:
            xgr.apply_token_bitmask_inplace(logits, st.bitmask, vocab_size=logits.shape[-1], indices=st.bitmask_rows)
        if st.allowed is not None:  # every other token of those rows to -inf, as vector ops
            limited, pair_rows, pair_ids = st.allowed
            kept = logits[pair_rows, pair_ids]
            logits = logits.index_fill(0, limited, float("-inf")).index_put((pair_rows, pair_ids), kept)
        if st.logit_bias is not None:
            rows, ids, biases = st.logit_bias
            logits = logits.index_put((rows, ids), biases, accumulate=True)
        if st.banned is not None:
            logits = logits.index_put(st.banned, logits.new_full((), float("-inf")))  # no host-to-device copy
        if st.repetition_penalty is not None:
            logits = apply_penalties(logits, st)
        if greedy is None:
            greedy = argmax_rows(logits)
        if st.all_greedy:
            return greedy, raw_logprobs
        temperature = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
        logits = logits / temperature[:, None]
        if st.top_k is not None or st.top_p is not None:
            logits = apply_top_k_top_p(logits, st.top_k, st.top_p)
        probs = torch.softmax(logits, dim=-1)
        if st.min_p is not None:
            max_prob = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < st.min_p[:, None] * max_prob, 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in st.generators.items():
            noise[row].exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(st.temperature > 0, sampled, greedy), raw_logprobs


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """OpenAI's presence/frequency penalties on generated tokens; the repetition penalty
    (as in transformers and vLLM) on tokens seen in the prompt or the output."""
    counts = st.output_token_counts
    seen = counts > 0
    if st.prompt_token_mask is not None:
        seen = seen | st.prompt_token_mask
    rep = st.repetition_penalty[:, None]
    logits = torch.where(seen & (logits > 0), logits / rep, torch.where(seen, logits * rep, logits))
    logits = logits - st.frequency_penalty[:, None] * counts.to(logits.dtype)
    return logits - st.presence_penalty[:, None] * (counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and nucleus (top-p), with one sort."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    if top_k is not None:
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token if the mass before it is below top_p (so the top token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


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


def score_tokens(
    logits: torch.Tensor,  # [N, vocab] float32
    targets: torch.Tensor,  # [N]
    num_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gather_logprobs`` of ``targets`` from raw logits, without the [N, vocab] log-softmax: a logprob is
    the logit less the row's log-sum-exp, and ranks and the top-N are the same on logits."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
    chosen = logits.gather(-1, targets[:, None])  # [N, 1]
    ranks = (logits > chosen).sum(dim=-1) + 1
    top_vals, top_ids = logits.topk(max(num_top, 1), dim=-1)
    return (chosen - lse)[:, 0], ranks, top_ids, top_vals - lse


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
