"""Speculative decoding's parts: n-gram proposals (``engine.speculative.ngram``), the verification's rejection
sampling (``engine.speculative.rejection``), which must leave the target's distribution unchanged, and the pause of
a request's proposals while few are accepted (``engine.speculative.proposer.Acceptance``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.speculative.ngram import NgramProposer
from engine.speculative.proposer import MIN_ACCEPTANCE, PAUSE_STEPS, PROBATION, Acceptance
from engine.speculative.rejection import PLACEHOLDER, rejection_sample


def test_ngram_proposes_what_followed_the_longest_tail_seen_before():
    propose = NgramProposer(k=3, min_n=1, max_n=3).propose
    tokens = np.array([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    # The tail (6, 7) occurs at 1 and 6: the latest, 6, was followed by 2, 3, 6.
    assert propose(tokens).tolist() == [2, 3, 6]
    # A 3-token tail (1, 6, 7) beats any shorter one: it occurred once, followed by 2 3 6.
    assert propose(np.array([1, 6, 7, 4, 6, 7, 9, 1, 6, 7])).tolist() == [4, 6, 7]
    assert propose(tokens, limit=2).tolist() == [2, 3]  # the room left caps the proposals
    assert propose(np.array([4, 4, 9, 1, 2])).tolist() == []  # the tail 2 never came before
    assert propose(np.array([3, 1, 2, 3])).tolist() == [1, 2, 3]  # up to the end of the sequence
    assert NgramProposer(k=3, min_n=2, max_n=3).propose(np.array([4, 2, 8, 3, 2])).tolist() == []  # n >= 2 only
    assert propose(np.array([7, 7, 7])).tolist() == [7]  # overlapping occurrences count
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(k=2, min_n=3, max_n=2)


def _chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of ``counts`` against ``probs`` (Wilson-Hilferty's normal approximation of the chi-square
    tail, good to a few percent for these degrees of freedom)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(probs) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("proposer", ["draft-model", "point-mass"])
def test_rejection_sampling_leaves_the_target_distribution_unchanged(proposer):
    """Drafts drawn from q (a draft model's distribution, or always the same token as n-gram proposals are), verified
    against p: the first output token is distributed as p_0, and the second, where the first draft was accepted, as
    p_1. A proposer that always proposes the target's likeliest token is accepted at p's rate."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, rows = 6, 2, 200_000
    p = torch.tensor([[0.05, 0.4, 0.1, 0.25, 0.15, 0.05], [0.3, 0.1, 0.2, 0.1, 0.05, 0.25], [1 / 6] * 6])
    q = torch.tensor([[0.3, 0.1, 0.3, 0.1, 0.1, 0.1], [0.1, 0.5, 0.1, 0.1, 0.1, 0.1]])
    if proposer == "draft-model":
        drafts = torch.stack([torch.multinomial(q[i], rows, replacement=True, generator=gen) for i in range(k)], 1)
        draft_probs = q.expand(rows, k, vocab)
    else:
        drafts = torch.tensor([[1, 0]]).expand(rows, k)  # n-gram: the same proposal every time
        draft_probs = None
    torch.manual_seed(1)
    out, accepted = rejection_sample(drafts, torch.full((rows,), k), p.expand(rows, k + 1, vocab),
                                     p.argmax(-1).expand(rows, k + 1), torch.zeros(rows, dtype=torch.bool),
                                     draft_probs)
    first = np.bincount(out[:, 0].numpy(), minlength=vocab)
    assert _chi_square_p_value(first, p[0].numpy()) > 1e-3, first
    second = out[accepted >= 1, 1]
    assert _chi_square_p_value(np.bincount(second.numpy(), minlength=vocab), p[1].numpy()) > 1e-3
    if proposer == "point-mass":  # draft 1 is accepted with probability p_0(1) = 0.4
        assert abs((accepted >= 1).float().mean().item() - 0.4) < 0.01
    # Every row holds its accepted drafts, then one more token, then placeholders.
    assert torch.equal((out != PLACEHOLDER).sum(1), accepted + 1)
    assert ((out[:, :1] >= 0) & (out[:, :1] < vocab)).all()


def test_greedy_rows_accept_exactly_the_targets_argmax_tokens():
    """A greedy row keeps its drafts while each is the target's argmax and then takes the argmax: the tokens the
    target alone would have produced. Rows with fewer drafts stop at their own count, with a bonus token."""
    vocab = 8
    argmax = torch.tensor([[3, 5, 1, 7], [3, 5, 1, 7], [2, 2, 2, 2], [4, 0, 0, 0]])
    drafts = torch.tensor([[3, 5, 1], [3, 4, 1], [2, 2, 9 % vocab], [6, 6, 6]])
    num_drafts = torch.tensor([3, 3, 2, 0])
    probs = torch.full((4, 4, vocab), 1 / vocab)
    out, accepted = rejection_sample(drafts, num_drafts, probs, argmax, torch.ones(4, dtype=torch.bool))
    assert accepted.tolist() == [3, 1, 2, 0]
    assert out.tolist() == [[3, 5, 1, 7], [3, 5, -1, -1], [2, 2, 2, -1], [4, -1, -1, -1]]


def test_seeded_rows_take_the_targets_own_samples_whatever_the_batch():
    """A seeded row, given its positions' noise, keeps its drafts while they are the target's samples there
    (argmax p / noise, what the sampler draws without speculation) and ends with the first sample they miss, or the
    bonus one: the same beside any other rows."""
    vocab, k = 5, 3
    p = torch.softmax(torch.randn(2, k + 1, vocab, generator=torch.Generator().manual_seed(2)), -1)
    noise = torch.empty(k + 1, vocab).exponential_(generator=torch.Generator().manual_seed(7))
    samples = (p[0] / noise).argmax(-1).tolist()

    def run(row_of_interest: int, batch: int, drafts_of_interest: list[int]):
        probs = p[1:2].expand(batch, k + 1, vocab).clone()
        probs[row_of_interest] = p[0]
        draft = torch.zeros(batch, k, dtype=torch.long)
        draft[row_of_interest] = torch.tensor(drafts_of_interest)
        out, n = rejection_sample(draft, torch.full((batch,), k), probs, probs.argmax(-1),
                                  torch.zeros(batch, dtype=torch.bool), None, {row_of_interest: noise})
        return out[row_of_interest, : int(n[row_of_interest]) + 1].tolist()

    for drafts in (samples[:3], [*samples[:1], (samples[1] + 1) % vocab, samples[2]], [(samples[0] + 1) % vocab] * 3):
        expected = []
        for i, token in enumerate(drafts):
            if token != samples[i]:
                break
            expected.append(token)
        expected.append(samples[len(expected)])
        assert run(0, 1, drafts) == run(2, 5, drafts) == run(4, 9, drafts) == expected


def test_proposals_pause_while_few_are_accepted_and_come_back():
    rejected = Acceptance()
    for _ in range(PROBATION - 1):
        rejected.record(proposed=4, accepted=0)
        assert rejected.proposes()  # on probation: not judged yet
    rejected.record(proposed=4, accepted=0)
    assert [rejected.proposes() for _ in range(PAUSE_STEPS)] == [False] * PAUSE_STEPS
    assert rejected.proposes()  # the pause is over: proposals again, judged afresh
    rejected.record(proposed=4, accepted=4)
    assert rejected.proposes()
    good = Acceptance()
    for i in range(50):  # one proposal in two accepted, always above the bar
        good.record(proposed=4, accepted=2 * (i % 2) + 1)
        assert good.proposes()
    assert MIN_ACCEPTANCE < 0.25


def test_each_verified_position_counts_the_proposals_before_it():
    """The verification changes a position's logits as the sampler would once the proposals before it are accepted:
    a frequency penalty counts them (a proposal repeated is penalised at its second position), and so does
    min_tokens (EOS, banned while fewer outputs came before, is allowed from the position where enough did)."""
    from engine.outputs import NewRequestData
    from engine.sampling_params import SamplingParams
    from engine.worker.input_batch import InputBatch
    from engine.worker.sampling_tensors import build_sampling_tensors
    from engine.worker.speculation import verify_proposals

    vocab, eos = 16, 0
    batch = InputBatch(max_num_reqs=2, max_model_len=32, max_blocks_per_req=4, vocab_size=vocab, device="cpu")
    requests = {  # (tokens: a 3-token prompt, then outputs; params; proposals)
        "penalised": ([1, 2, 3, 4], SamplingParams(temperature=0.0, frequency_penalty=2.0), [6, 6, 6]),
        "min_tokens": ([1, 2, 3, 4, 5, 7], SamplingParams(temperature=0.0, min_tokens=5), [8, 9, eos]),
    }
    for rid, (tokens, params, _) in requests.items():
        batch.add(NewRequestData(rid, tokens, 3, params, [0], len(tokens)), [eos])
    batch.set_proposals({rid: spec for rid, (_, _, spec) in requests.items()})
    logits = torch.zeros(8, vocab)
    logits[0, 6], logits[1, 6], logits[1, 7] = 10.0, 5.0, 4.0  # 6 leads at position 1 by less than its penalty
    logits[1:4, 6] = 5.0
    logits[4, 8], logits[5, 9], logits[6, eos], logits[6, 10], logits[7, 11] = 9.0, 9.0, 9.0, 8.0, 9.0
    rows = np.asarray([batch.row_of[rid] for rid in requests])
    st = build_sampling_tensors(batch, rows, torch.device("cpu"))
    last, (out, accepted), _ = verify_proposals(logits, st, np.asarray([3, 3]), rows, batch)
    assert accepted.tolist() == [1, 3]
    assert out[0, :2].tolist() == [6, 7]  # the second 6 pays for the first: 5 - 2 < 4
    assert out[1].tolist() == [8, 9, eos, 11]  # 3, 4 and then 5 outputs before the EOS: allowed there
    assert last.tolist() == [7, 11]
