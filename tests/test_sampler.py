"""The batched sampler on its own: filters, penalties, seeds, and the sampled distribution."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.worker.sampler import Sampler, SamplingTensors, apply_penalties, apply_top_k_top_p


def tensors(n: int, temperature=1.0, top_k=None, top_p=None, min_p=None, **kw) -> SamplingTensors:
    full = lambda v, dtype=torch.float32: None if v is None else torch.full((n,), v, dtype=dtype)  # noqa: E731
    return SamplingTensors(temperature=torch.full((n,), float(temperature)), top_k=full(top_k, torch.long),
                           top_p=full(top_p), min_p=full(min_p), **kw)


def test_greedy_rows_take_the_argmax_and_random_rows_sample():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    st = tensors(4)
    st.temperature[:2] = 0.0
    sampled, _ = Sampler()(logits, st)
    assert sampled[:2].tolist() == logits[:2].argmax(-1).tolist()


def test_greedy_tokens_taken_by_a_cuda_graph_are_used_only_where_nothing_changes_the_logits():
    """A decode graph hands the sampler each row's argmax of its logits. Greedy rows take it when no ban, bias,
    penalty or grammar changes the logits first (a marker value shows which tokens came from it); otherwise the
    sampler takes the argmax of the changed logits."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    taken = torch.full((4,), 49)  # not the argmax of any row: it shows where the graph's tokens were used
    sampler = Sampler()
    st = tensors(4, temperature=0.0, all_greedy=True)
    assert sampler(logits, st, taken)[0].tolist() == [49] * 4
    st = tensors(4, temperature=0.0, all_greedy=True, max_num_logprobs=2)  # logprobs: the general path
    sampled, logprobs = sampler(logits, st, taken)
    assert sampled.tolist() == [49] * 4 and logprobs is not None
    st = tensors(4)
    st.temperature[:2] = 0.0
    assert sampler(logits, st, taken)[0][:2].tolist() == [49, 49]
    argmax = logits.argmax(-1)
    changed = [
        dict(banned=(torch.tensor([0]), torch.tensor([3]))),
        dict(logit_bias=(torch.tensor([1]), torch.tensor([5]), torch.tensor([0.5]))),
        dict(presence_penalty=torch.zeros(4), frequency_penalty=torch.zeros(4), repetition_penalty=torch.ones(4),
             output_token_counts=torch.zeros(4, 50, dtype=torch.long)),
        dict(bitmask=torch.full((4, 2), -1, dtype=torch.int32), bitmask_rows=[0, 1, 2, 3]),
    ]
    for fields in changed:  # none of them moves the argmax here: the tokens must be the logits' own
        st = tensors(4, temperature=0.0, all_greedy=True, **fields)
        assert sampler(logits.clone(), st, taken)[0].tolist() == argmax.tolist(), fields


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=0.999)])
def test_filters_that_keep_one_token_reduce_to_greedy(filters):
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    sampled, _ = Sampler()(logits, tensors(8, **filters))
    assert sampled.tolist() == logits.argmax(-1).tolist()


def test_top_k_and_top_p_mask_exactly_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    masked = apply_top_k_top_p(logits, torch.tensor([3]), None)
    assert torch.isinf(masked[0, 3:]).all() and torch.isfinite(masked[0, :3]).all()
    # top_p 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token (mass before it 0.7) stays, the fourth goes.
    masked = apply_top_k_top_p(logits, None, torch.tensor([0.8]))
    assert torch.isfinite(masked[0, :3]).all() and torch.isinf(masked[0, 3:]).all()


def test_samples_follow_the_softmax_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 20000
    logits = probs.log().repeat(n, 1)
    sampled, _ = Sampler()(logits, tensors(n))
    freq = torch.bincount(sampled, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.02), freq


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([1.0, 0.0]).repeat(20000, 1)
    cold, _ = Sampler()(logits, tensors(20000, temperature=0.25))
    # softmax([4, 0])[0] ~ 0.982
    assert abs((cold == 0).float().mean().item() - 0.982) < 0.01


def test_seeded_rows_do_not_depend_on_their_batch_mates():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))

    def run(rows):
        gens = {i: (torch.Generator(), 7, 30) for i in range(len(rows)) if rows[i] == 0}
        st = tensors(len(rows), generators=gens)
        return Sampler()(logits[rows], st)[0].tolist()

    alone = run([0])[0]
    assert run([1, 0, 2])[1] == alone and run([2, 1, 0])[2] == alone


def test_a_seeded_rows_noise_depends_on_its_seed_and_position_alone():
    """The same (seed, position) draws the same noise from any generator, after any earlier draws; another position
    or seed draws other noise, so a seeded row samples its stream position by position."""
    from engine.worker.sampler import seeded_noise

    used = torch.Generator()
    torch.rand(100, generator=used)
    def noise(generator, seed, position, count=1):
        return seeded_noise(generator, seed, position, torch.empty(count, 64))

    assert torch.equal(noise(torch.Generator(), 5, 12), noise(used, 5, 12))
    three = noise(torch.Generator(), 5, 12, count=3)
    assert torch.equal(three[1], noise(used, 5, 13)[0])
    assert not torch.equal(three[0], three[1]) and not torch.equal(three[0], noise(used, 6, 12)[0])
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    tokens = {Sampler()(logits, tensors(1, generators={0: (torch.Generator(), 5, position)}))[0].item()
              for position in range(40)}
    assert len(tokens) > 5  # positions draw apart


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    counts = torch.tensor([[2, 1, 0, 0]])
    prompt = torch.tensor([[False, False, False, True]])
    st = SamplingTensors(temperature=torch.ones(1), top_k=None, top_p=None, min_p=None,
                         presence_penalty=torch.tensor([0.5]), frequency_penalty=torch.tensor([0.25]),
                         repetition_penalty=torch.tensor([2.0]), output_token_counts=counts, prompt_token_mask=prompt)
    out = apply_penalties(logits, st)
    # Token 0: 2/2 - 0.25*2 - 0.5; token 1: -1*2 - 0.25 - 0.5; token 2 untouched; token 3 (prompt only): 1/2.
    assert torch.allclose(out, torch.tensor([[0.0, -2.75, 0.5, 0.5]]))


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(top_k=2**40), "top_k"), (dict(seed=2**64), "seed"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=-2), "logprobs"), (dict(prompt_logprobs=-2), "prompt_logprobs"), (dict(min_p=1.5), "min_p"), (dict(stop=[""]), "stop"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(repetition_penalty=0), "repetition_penalty"),
])
def test_invalid_params_name_the_field(kwargs, param):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param


def test_allowed_tokens_confine_their_rows_only():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    # Row 0 may only take 7 or 11, row 2 only 3; row 1 is free. Greedy and random alike.
    allowed = (torch.tensor([0, 2]), torch.tensor([0, 0, 2]), torch.tensor([7, 11, 3]))
    for temperature in (0.0, 1.0):
        for _ in range(20):
            sampled, _ = Sampler()(logits.clone(), tensors(3, temperature=temperature, allowed=allowed))
            assert sampled[0].item() in (7, 11) and sampled[2].item() == 3
    greedy, _ = Sampler()(logits.clone(), tensors(3, temperature=0.0, allowed=allowed))
    assert greedy[1].item() == logits[1].argmax().item()
    assert greedy[0].item() == (7 if logits[0, 7] > logits[0, 11] else 11)
