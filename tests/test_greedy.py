"""The two-pass greedy argmax (``engine.greedy``) gives torch.argmax's tokens (Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.greedy import greedy_tokens, runs_here


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
    assert runs_here(logits)
    assert torch.equal(greedy_tokens(logits, block=block), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_infinities_and_nan(dtype):
    logits = torch.randn(4, 300).to(dtype)
    logits[0] = float("-inf")  # every value -inf: column 0, as torch
    logits[1, 250] = float("inf")
    logits[1, 260] = float("inf")  # two +inf: the first
    logits[2, 77] = float("nan")  # NaN wins over every number, as in torch
    logits[3, 10:] = float("-inf")
    got = greedy_tokens(logits, block=128)
    assert got.tolist() == logits.argmax(dim=-1).tolist() == [0, 250, 77, int(logits[3, :10].float().argmax())]
    assert got.dtype == torch.int64


def test_what_the_kernels_do_not_take_goes_to_torch():
    column_major = torch.randn(300, 3).t()  # rows not contiguous
    assert not runs_here(column_major)
    assert torch.equal(greedy_tokens(column_major), column_major.argmax(dim=-1))
    assert greedy_tokens(torch.empty(0, 10)).shape == (0,)
