"""Per-row sampling parameters of one step as device tensors, built from the runner's rows (``InputBatch``).

Each optional piece (top-k, top-p, min-p, penalties, biases, bans, allowed tokens) is built only when some row of
the step uses it, so that a step of plain requests uploads three small arrays and the sampler skips the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.worker.input_batch import InputBatch
from engine.worker.step_buffers import upload


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one step, already on the device."""

    temperature: torch.Tensor  # [N] float32; 0 means greedy
    top_k: torch.Tensor | None  # [N] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [N] float32; None if no row uses it
    min_p: torch.Tensor | None  # [N] float32; None if no row uses it
    # Seeded rows: row -> (a generator, the request's seed, the position of the token it samples); see seeded_noise.
    generators: dict[int, tuple[torch.Generator, int, int]] = field(default_factory=dict)
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


def build_sampling_tensors(batch: InputBatch, rows: np.ndarray, device: torch.device,
                           ahead: np.ndarray | None = None, positions: np.ndarray | None = None) -> SamplingTensors:
    """The sampling parameters of the step's sampled ``rows`` (InputBatch rows, in sampling order). ``ahead``: per
    entry of ``rows``, how many of its proposals come before it (a verification step's positions, one entry each:
    the proposals before a position are taken as accepted there, so min_tokens and the penalties count them).
    ``positions``: where each row's (first) sampled token goes in its request, for the seeded rows' noise (without
    them, no row's noise is seeded: tensors that only change logits)."""
    b = batch
    temperature = b.temperature[rows]
    top_k, top_p, min_p = b.top_k[rows], b.top_p[rows], b.min_p[rows]
    st = SamplingTensors(
        temperature=upload(temperature, device),
        top_k=upload(np.where(top_k > 0, top_k, b.vocab_size), device) if (top_k > 0).any() else None,
        top_p=upload(top_p, device) if (top_p < 1.0).any() else None,
        min_p=upload(min_p, device) if (min_p > 0.0).any() else None,
        generators={i: (*b.generators[r], int(positions[i])) for i, r in enumerate(rows.tolist())
                    if r in b.generators} if positions is not None else {},
        all_greedy=bool((temperature == 0).all()),
        max_num_logprobs=int(b.num_logprobs[rows].max()),
    )
    num_tokens = b.num_tokens[rows] if ahead is None else b.num_tokens[rows] + ahead
    if b.banned_until_min:
        st.banned = _banned_tokens(b, rows, num_tokens, device)
    if b.logit_bias:
        st.logit_bias = _logit_bias(b, rows, device)
    if b.allowed:
        st.allowed = _allowed_tokens(b, rows, device)
    pres, freq, rep = b.presence_penalty[rows], b.frequency_penalty[rows], b.repetition_penalty[rows]
    if (pres != 0).any() or (freq != 0).any() or (rep != 1).any():
        st.presence_penalty, st.frequency_penalty, st.repetition_penalty = (upload(pres, device),
                                                                            upload(freq, device), upload(rep, device))
        st.output_token_counts, st.prompt_token_mask = _token_counts(b, rows, num_tokens, device)
    return st


def _logit_bias(b: InputBatch, rows: np.ndarray, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(batch rows, token ids, biases) of the rows that carry a logit_bias, flattened."""
    parts = [(i, *b.logit_bias[r]) for i, r in enumerate(rows.tolist()) if r in b.logit_bias]
    if not parts:
        return None
    row_idx = np.concatenate([np.full(len(ids), i, dtype=np.int64) for i, ids, _ in parts])
    ids = np.concatenate([ids for _, ids, _ in parts])
    values = np.concatenate([values for _, _, values in parts])
    return upload(row_idx, device), upload(ids, device), upload(values, device)


def _allowed_tokens(b: InputBatch, rows: np.ndarray, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(batch rows that carry allowed_token_ids, and their (row, token) pairs, flattened)."""
    parts = [(i, b.allowed[r]) for i, r in enumerate(rows.tolist()) if r in b.allowed]
    if not parts:
        return None
    limited = np.array([i for i, _ in parts], dtype=np.int64)
    pair_rows = np.concatenate([np.full(len(ids), i, dtype=np.int64) for i, ids in parts])
    return (upload(limited, device), upload(pair_rows, device),
            upload(np.concatenate([ids for _, ids in parts]), device))


def _banned_tokens(b: InputBatch, rows: np.ndarray, num_tokens: np.ndarray,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, token) pairs to mask: EOS and stop tokens of rows that have not reached min_tokens (``num_tokens``: each
    row's tokens before the one it samples)."""
    pairs = [(i, t) for i, (r, n) in enumerate(zip(rows.tolist(), num_tokens.tolist())) if r in b.banned_until_min
             and n - b.num_prompt_tokens[r] < b.min_tokens[r] for t in b.banned_until_min[r]]
    if not pairs:
        return None
    idx = upload(torch.tensor(pairs, dtype=torch.long).T.contiguous(), device)
    return idx[0], idx[1]


def _token_counts(b: InputBatch, rows: np.ndarray, num_tokens: np.ndarray,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: how often each vocab token was generated among its first ``num_tokens`` [N, V], and which are in
    the prompt [N, V]."""
    vocab = b.vocab_size
    width = int(num_tokens.max())
    ids = b.token_ids[rows, :width].copy()  # [N, width]
    cols = np.arange(width)[None, :]
    in_prompt = cols < b.num_prompt_tokens[rows][:, None]
    valid = cols < num_tokens[:, None]
    out_ids = upload(np.where(valid & ~in_prompt, ids, vocab), device)
    prompt_ids = upload(np.where(in_prompt, ids, vocab), device)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.int32))
    prompt_mask = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
    prompt_mask.scatter_(1, prompt_ids, True)
    return counts[:, :vocab], prompt_mask[:, :vocab]
