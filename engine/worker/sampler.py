"""Batched sampling on the device: penalties, temperature, top-k, top-p, min-p, seeds.

Everything is a tensor operation over the whole batch; the only Python loop is over
the requests that carry their own seed (one noise draw each, no host sync). Sampling
uses the exponential-race form of the Gumbel trick: ``argmax(p / q)`` with
``q ~ Exp(1)`` draws from ``p``. A seeded request's noise for the token at position t
of its sequence is drawn from (its seed, t) alone (``seeded_noise``), so its tokens
depend neither on what else is in the batch nor on how its steps fell: a preempted
request that computes its tokens again, or one whose proposals a speculative step
verifies (``engine.speculative.rejection``), draws the same noise at each position.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

from engine.ops.greedy import argmax_rows
from engine.worker.sampling_tensors import SamplingTensors


def changes_logits(st: SamplingTensors) -> bool:
    """Whether a ban, penalty, bias or allowed-token list changes some row's logits before sampling (a grammar's
    bitmask, set later, too)."""
    return (st.banned is not None or st.repetition_penalty is not None or st.logit_bias is not None
            or st.allowed is not None)


def takes_greedy_tokens(st: SamplingTensors) -> bool:
    """Whether ``Sampler`` returns the ``greedy`` tokens it is given and reads nothing of the logits: every row
    greedy, no logprobs, nothing changing the logits (a grammar's bitmask included)."""
    return st.all_greedy and st.max_num_logprobs < 0 and not changes_logits(st) and st.bitmask is None


def logits_or_greedy_tokens(model, rows: torch.Tensor,
                            greedy_only: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sampled rows' (logits, None); or, where the sampler will take only greedy tokens (``greedy_only``:
    ``takes_greedy_tokens``) and the model finds them without the logits (a quantized LM head's copy:
    ``greedy_tokens``), (None, those tokens)."""
    if greedy_only and hasattr(model, "greedy_tokens"):
        tokens = model.greedy_tokens(rows)
        if tokens is not None:
            return None, tokens
    return model.compute_logits(rows), None


class Sampler:
    def __call__(self, logits: torch.Tensor, st: SamplingTensors,
                 greedy: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sample one token per row of ``logits`` [N, vocab] (any float dtype; computed in float32).

        ``greedy``: each row's argmax of these very logits [N], where it was taken already (inside a decode CUDA
        graph); used as the greedy tokens when no grammar, bias, ban or penalty changes the logits first.
        Returns the sampled ids [N] and, when any row asked for logprobs, the raw
        log-softmax [N, vocab] of the model's distribution (before penalties and filters).
        """
        changed = changes_logits(st)
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
        logits = adjust_logits(logits, st)
        if greedy is None:
            greedy = argmax_rows(logits)
        if st.all_greedy:
            return greedy, raw_logprobs
        probs = sampling_probs(logits, st)
        noise = torch.empty_like(probs).exponential_()
        for row, (generator, seed, position) in st.generators.items():
            seeded_noise(generator, seed, position, noise[row : row + 1])
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(st.temperature > 0, sampled, greedy), raw_logprobs


def seeded_noise(generator: torch.Generator, seed: int, position: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` [count, vocab] (on the generator's device) filled with Exp(1) noise for the tokens at positions
    ``position`` .. ``position + count - 1`` of a request seeded with ``seed``: each row drawn from the generator
    seeded by the pair alone. Returns ``out``."""
    for i in range(len(out)):
        generator.manual_seed((seed * 1_000_003 + position + i) % 2**63)  # distinct pairs for positions < 1,000,003
        out[i].exponential_(generator=generator)
    return out


def adjust_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The float32 ``logits`` [N, vocab] as the rows' requests change them before sampling: allowed_token_ids,
    logit_bias, the tokens banned before min_tokens, then the penalties (a new tensor where any applies)."""
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
    return logits


def sampling_probs(logits: torch.Tensor, st: SamplingTensors, repeat: int = 1) -> torch.Tensor:
    """The distributions the rows sample from [N * repeat, vocab] float32: temperature (1 for greedy rows), top-k,
    top-p, then min-p, renormalised. ``repeat``: each of st's rows stands for that many consecutive logits rows
    (a speculative step's positions)."""
    def per_row(values: torch.Tensor | None) -> torch.Tensor | None:
        return values.repeat_interleave(repeat) if values is not None and repeat > 1 else values

    temperature = per_row(torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature)))
    logits = logits.float() / temperature[:, None]
    if st.top_k is not None or st.top_p is not None:
        logits = apply_top_k_top_p(logits, per_row(st.top_k), per_row(st.top_p))
    probs = torch.softmax(logits, dim=-1)
    if st.min_p is not None:
        max_prob = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < per_row(st.min_p)[:, None] * max_prob, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


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
