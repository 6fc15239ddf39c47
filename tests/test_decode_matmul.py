"""The split-K product of decode-sized batches (``engine.models.decode_matmul``): its kernel runs here in Triton's
interpreter on CPU tensors (float32), against ``x @ w.T``; ``tests/test_gpu.py`` runs the engine with it on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import decode_matmul
from engine.models.decode_matmul import BLOCK_K, MAX_ROWS, Tiles, choose_tiles, splitk_matmul

NEEDS_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on CPU tensors needs TRITON_INTERPRET=1 "
    "(conftest sets it without CUDA); on a GPU, tests/test_gpu.py covers it")


@NEEDS_INTERPRETER
@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 200), k_blocks=st.sampled_from([1, 2, 4, 6, 8]),
       split=st.sampled_from([1, 2, 4]), block_n=st.sampled_from([32, 64]), seed=st.integers(0, 2**16))
def test_split_k_products_equal_the_plain_product(m, n, k_blocks, split, block_n, seed):
    """Any token count, weight rows that do not fill the last tile, and K cut into 1, 2 or 4 slices: the tile's
    last program adds the others' partial sums, and the output is the product's. Twice on the same workspace: the
    counters are back at zero after each launch."""
    k = BLOCK_K * k_blocks * split
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    tiles = Tiles(block_n, max(16, 1 << (m - 1).bit_length()), split, num_warps=4, num_stages=2)
    want = (x.double() @ w.double().T).float()
    for _ in range(2):
        got = splitk_matmul(x, w, tiles)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if split > 1:
        assert not decode_matmul._workspaces[x.device].count.any()


@NEEDS_INTERPRETER
def test_rows_of_a_wider_tensor_and_several_token_tiles():
    """The input may be a column slice of a wider tensor (its rows' stride is not K), and more tokens than one
    token tile: every tile of tokens and weight rows is written once."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(70, 3 * 128, generator=gen)
    x = wide[:, 128:256]
    w = torch.randn(100, 128, generator=gen)
    got = splitk_matmul(x, w, Tiles(block_n=32, block_m=32, split=2, num_warps=4, num_stages=2))
    torch.testing.assert_close(got, x @ w.T, rtol=1e-4, atol=1e-4)


def test_tiles_cover_the_batch_and_split_k_until_every_sm_has_a_program():
    h200_sms = 132
    # Llama-3.1-8B's o_proj at 151 tokens: 256-token tiles of 64 weight rows make 64 tiles; K in two slices would
    # leave SMs idle (128 programs), in four it gives 256.
    tiles = choose_tiles(151, 4096, 4096, h200_sms)
    assert (tiles.block_m, tiles.block_n, tiles.split) == (256, 64, 4)
    # gate|up has 448 tiles of 64 rows already: one slice.
    assert choose_tiles(151, 28672, 4096, h200_sms).split == 1
    # One token: the narrowest tile; slices stay 512 columns or more.
    one = choose_tiles(1, 1024, 1024, h200_sms)
    assert (one.block_m, one.block_n, one.split) == (16, 128, 2)
    for m in (1, 7, 16, 17, 100, 151, 255, MAX_ROWS):
        t = choose_tiles(m, 6144, 4096, h200_sms)
        assert t.block_m >= m and t.block_m & (t.block_m - 1) == 0 and 4096 % (BLOCK_K * t.split) == 0
    assert choose_tiles(MAX_ROWS + 1, 4096, 4096, h200_sms) is None  # prefill-sized: cuBLAS
    assert choose_tiles(8, 4096, 4096 + 32, h200_sms) is None  # K not a multiple of BLOCK_K


def test_cpu_tensors_and_biases_go_to_f_linear(monkeypatch):
    monkeypatch.setenv("MINIVLLM_DECODE_MATMUL", "triton")
    decode_matmul.reread_env()
    launched = []
    monkeypatch.setattr(decode_matmul, "splitk_matmul", lambda *a, **k: launched.append(a))
    x, w, b = torch.randn(3, 64), torch.randn(5, 64), torch.randn(5)
    torch.testing.assert_close(decode_matmul.linear(x, w), x @ w.T)
    torch.testing.assert_close(decode_matmul.linear(x, w, b), x @ w.T + b)
    assert not launched
    decode_matmul.reread_env()


def test_unknown_choice_is_an_error_naming_the_choices(monkeypatch):
    monkeypatch.setenv("MINIVLLM_DECODE_MATMUL", "auto")
    with pytest.raises(ValueError, match=r"MINIVLLM_DECODE_MATMUL must be one of \['triton', 'cublas'\], got 'auto'"):
        decode_matmul.choice_from_env()
    monkeypatch.delenv("MINIVLLM_DECODE_MATMUL")
    assert decode_matmul.choice_from_env() == decode_matmul.DEFAULT
