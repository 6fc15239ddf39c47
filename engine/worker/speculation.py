"""The runner's side of speculative decoding: a step's verification of its proposals.

The step's logits are each sampled row's 1 + k last tokens' (``StepInputs.spec_counts``), row after row; the target's
distributions there and its argmax verify the proposals (``engine.speculative.rejection``). Each position's logits
are changed as the sampler changes a row's, with the proposals before it taken as accepted: a grammar's mask at its
state there, allowed_token_ids, logit_bias, EOS banned until min_tokens (the proposals before count as output) and
the penalties (counting them too); then temperature, top-k, top-p and min-p. A row without proposals is verified
with k = 0, which is plain sampling from its distribution. Logprobs are the model's own distribution at each
position, as the sampler's: each row that asks gets an entry per token it keeps (its accepted proposals, then the
token the step samples), gathered for all its positions and cut to those once the step's accepted counts are read.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.speculative.rejection import rejection_sample
from engine.worker.input_batch import InputBatch
from engine.worker.logprobs import copy_logprobs, offsets_within
from engine.worker.sampler import adjust_logits, changes_logits, sampling_probs, seeded_noise
from engine.worker.sampling_tensors import SamplingTensors, build_sampling_tensors


def verify_proposals(logits: torch.Tensor, st: SamplingTensors, spec_counts: np.ndarray, rows: np.ndarray,
                     batch: InputBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """``logits`` [sum(1 + k), vocab] of the sampled ``rows`` (InputBatch rows) with ``spec_counts`` proposals each.
    Returns each row's last token [rows], (its output tokens [rows, kmax + 1], its accepted count [rows]) and, where
    a row asks for logprobs, the raw log-softmax of every position [sum(1 + k), vocab] (else None)."""
    device = logits.device
    raw_logprobs = None
    if changes_logits(st) or st.max_num_logprobs >= 0:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if st.max_num_logprobs >= 0 else None
    if st.bitmask is not None:  # constrained rows: each position's logits masked by the grammar's state there
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, st.bitmask, vocab_size=logits.shape[-1], indices=st.bitmask_rows)
    if changes_logits(st):  # per position, the proposals before it counted as output
        ahead = offsets_within(spec_counts)
        logits = adjust_logits(logits, build_sampling_tensors(batch, np.repeat(rows, spec_counts + 1), device, ahead))
    num_rows, kmax = len(rows), int(spec_counts.max())
    counts = torch.from_numpy(spec_counts).to(device)
    starts = torch.cumsum(counts + 1, 0) - counts - 1  # each row's first logits row
    at = starts[:, None] + torch.minimum(torch.arange(kmax + 1, device=device)[None, :], counts[:, None])
    per_row = logits[at]  # [rows, kmax + 1, vocab]; past a row's k: its last position again (never read)
    argmax = per_row.argmax(dim=-1)
    greedy = st.temperature <= 0
    if st.all_greedy:
        probs = per_row.new_zeros(()).expand(per_row.shape)  # not read: every row is greedy
    else:
        flat = per_row.reshape(num_rows * (kmax + 1), -1)
        probs = sampling_probs(flat, st, repeat=kmax + 1).view(per_row.shape)
    drafts = np.zeros((num_rows, max(kmax, 1)), dtype=np.int64)
    for i, (row, k) in enumerate(zip(rows.tolist(), spec_counts.tolist())):
        start = batch.num_tokens[row]
        drafts[i, :k] = batch.token_ids[row, start : start + k]
    noise = {}  # each seeded row's noise at its positions, from its seed
    for row, (generator, seed, position) in st.generators.items():
        noise[row] = seeded_noise(generator, seed, position, torch.empty(kmax + 1, per_row.shape[-1], device=device))
    out, accepted = rejection_sample(torch.from_numpy(drafts[:, :kmax]).to(device), counts, probs, argmax, greedy,
                                     None, noise)
    return out.gather(1, accepted[:, None])[:, 0], (out, accepted), raw_logprobs


def verify_step(handle, logits: torch.Tensor, st: SamplingTensors, batch: InputBatch) -> tuple[torch.Tensor, None]:
    """A speculative step's sampling (``ModelRunner.launch_sampling``): its proposals verified, the accepted ones
    left on the handle (``verified``), and the logprobs of every position of the rows that ask for them
    (``handle.logprobs``, cut to the tokens kept by ``LogprobsCopy.entries``)."""
    counts, rows = handle.inputs.spec_counts, handle.inputs.sampled_rows
    sampled, handle.verified, raw_logprobs = verify_proposals(logits, st, counts, rows, batch)
    if raw_logprobs is not None:  # each position's token: a proposal, or the token sampled where they stop
        out, kmax = handle.verified[0], int(counts.max())
        row_of = torch.from_numpy(np.repeat(np.arange(len(rows)), counts + 1)).to(logits.device)
        ahead = torch.from_numpy(offsets_within(counts)).to(logits.device)
        tokens = out[row_of, ahead.clamp(max=kmax)].clamp(min=0)  # (past its token: a placeholder, never read)
        handle.logprobs = copy_logprobs(raw_logprobs, tokens, rows, batch, logits.device, counts + 1)
    return sampled, None


def record_accepted(batch: InputBatch, verified: tuple[torch.Tensor, torch.Tensor], rows: list[int],
                    live: list[int]) -> list[list[int]]:
    """After the step's sync: each sampled row's accepted proposals, appended to the ``live`` rows' tokens (the
    sampled token comes after them)."""
    out, accepted = (t.cpu() for t in verified)
    tokens = [row[:n] for row, n in zip(out.tolist(), accepted.tolist())]
    for i in live:
        row, n = rows[i], len(tokens[i])
        batch.token_ids[row, batch.num_tokens[row] : batch.num_tokens[row] + n] = tokens[i]
        batch.num_tokens[row] += n
    return tokens
