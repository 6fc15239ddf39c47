"""The two-pass greedy argmax (``engine.ops.greedy``) gives torch.argmax's tokens (Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.ops.greedy import _launch_greedy, argmax_rows, greedy_tokens


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 700), block=st.sampled_from([64, 128, 256]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), levels=st.integers(1, 8),
       seed=st.integers(0, 2**16), padded=st.booleans())
def test_the_tokens_are_torch_argmaxs_ties_included(rows, vocab, block, dtype, levels, seed, padded):
    """Few distinct values make ties common, across chunks and inside one; rows may be views of wider rows (the
    logits of a padded vocabulary)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randint(0, levels, (rows, vocab + (5 if padded else 0)), generator=gen).to(dtype)
    logits = wide[:, :vocab]
    assert torch.equal(_launch_greedy(logits, block=block), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_infinities_and_nan(dtype):
    logits = torch.randn(4, 300).to(dtype)
    logits[0] = float("-inf")  # every value -inf: column 0, as torch
    logits[1, 250] = float("inf")
    logits[1, 260] = float("inf")  # two +inf: the first
    logits[2, 77] = float("nan")  # NaN wins over every number, as in torch
    logits[3, 10:] = float("-inf")
    got = _launch_greedy(logits, block=128)
    assert got.tolist() == logits.argmax(dim=-1).tolist() == [0, 250, 77, int(logits[3, :10].float().argmax())]
    assert got.dtype == torch.int64


def test_the_sampler_takes_torchs_argmax_where_the_kernels_do_not_run(monkeypatch):
    """Even with ``MINIVLLM_GREEDY_ARGMAX=kernel``, CPU logits (the interpreter is for tests, not for serving) and
    column-major ones go to torch.argmax, never to the kernels; the kernels refuse what they cannot read; a misspelt
    setting is an error naming it."""
    from engine.ops import greedy

    def no_kernels(logits, *args, **kwargs):
        raise AssertionError("the kernels ran on CPU logits")

    monkeypatch.setenv("MINIVLLM_GREEDY_ARGMAX", "kernel")
    monkeypatch.setattr(greedy, "_launch_greedy", no_kernels)
    logits = torch.randn(3, 300)
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    column_major = torch.randn(300, 3).t()
    assert torch.equal(argmax_rows(column_major), column_major.argmax(dim=-1))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="contiguous rows"):
        greedy_tokens(column_major)
    monkeypatch.setenv("MINIVLLM_GREEDY_ARGMAX", "triton")
    with pytest.raises(ValueError, match="MINIVLLM_GREEDY_ARGMAX"):
        argmax_rows(logits)
