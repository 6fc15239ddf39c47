"""The runner's side of speculative decoding: a step's verification of its proposals.

The step's logits are each sampled row's 1 + k last tokens' (``StepInputs.spec_counts``), row after row; the target's
distributions there (temperature, top-k, top-p and min-p applied as the sampler applies them) and its argmax verify
the proposals (``engine.speculative.rejection``). Every row of such a step samples from the model's distribution
alone, or a grammar's part of it (``engine.speculative.proposer.speculates``; the scheduler plans no proposals beside
a row that would not): a constrained row's logits at each verified position are masked by its grammar's state there
(its earlier proposals taken). A row without proposals is verified with k = 0, which is plain sampling from its
distribution.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.speculative.rejection import rejection_sample
from engine.worker.input_batch import InputBatch
from engine.worker.sampler import sampling_probs
from engine.worker.sampling_tensors import SamplingTensors


def verify_proposals(logits: torch.Tensor, st: SamplingTensors, spec_counts: np.ndarray, rows: np.ndarray,
                     batch: InputBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``logits`` [sum(1 + k), vocab] of the sampled ``rows`` (InputBatch rows) with ``spec_counts`` proposals each.
    Returns each row's last token [rows] and (its output tokens [rows, kmax + 1], its accepted count [rows])."""
    device = logits.device
    if st.bitmask is not None:  # constrained rows: each position's logits masked by the grammar's state there
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, st.bitmask, vocab_size=logits.shape[-1], indices=st.bitmask_rows)
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
    out, accepted = rejection_sample(torch.from_numpy(drafts[:, :kmax]).to(device), counts, probs, argmax, greedy,
                                     None, st.generators)
    return out.gather(1, accepted[:, None])[:, 0], (out, accepted)


def verify_step(handle, logits: torch.Tensor, st: SamplingTensors, batch: InputBatch) -> tuple[torch.Tensor, None]:
    """A speculative step's sampling (``ModelRunner.launch_sampling``): its proposals verified, the accepted ones
    left on the handle (``verified``). No logprobs: rows that ask for them do not speculate."""
    sampled, handle.verified = verify_proposals(logits, st, handle.inputs.spec_counts, handle.inputs.sampled_rows,
                                                batch)
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
