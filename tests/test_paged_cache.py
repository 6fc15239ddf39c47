"""Paged KV cache tensors: shapes, per-layer views, and memory-budget math."""

from __future__ import annotations

import pytest
import torch

from kvcache.paged_cache import PagedKVCache

DIMS = dict(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)


def make_cache(num_blocks: int = 5, dtype: torch.dtype = torch.float32) -> PagedKVCache:
    return PagedKVCache(num_blocks=num_blocks, dtype=dtype, device="cpu", **DIMS)


def test_shape_dtype_and_zero_init() -> None:
    cache = make_cache(dtype=torch.float16)
    assert cache.kv.shape == (3, 2, 5, 4, 2, 8)
    assert cache.kv.dtype == torch.float16 and cache.device.type == "cpu"
    assert torch.count_nonzero(cache.kv) == 0
    assert cache.nbytes == 3 * 2 * 5 * 4 * 2 * 8 * 2


def test_layer_views_are_contiguous_and_write_through() -> None:
    cache = make_cache()
    k, v = cache.layer(1)
    assert k.shape == v.shape == (5, 4, 2, 8)
    assert k.is_contiguous() and v.is_contiguous()
    # Write token slot 6 (block 1, offset 2) the way a kernel addresses it: flat slots.
    k.view(-1, 2, 8)[6] = 1.0
    v.view(-1, 2, 8)[6] = 2.0
    assert torch.all(cache.kv[1, 0, 1, 2] == 1.0) and torch.all(cache.kv[1, 1, 1, 2] == 2.0)
    # Nothing else changed: other layers, other slots.
    assert cache.kv.sum().item() == 3.0 * 2 * 8
    assert k.data_ptr() != cache.layer(0)[0].data_ptr()
    with pytest.raises(IndexError):
        cache.layer(3)


def test_bytes_per_block_and_budget() -> None:
    per_block = PagedKVCache.bytes_per_block(dtype=torch.bfloat16, **DIMS)
    assert per_block == 2 * 3 * 4 * 2 * 8 * 2  # K and V, layers, slots, heads, head_dim, 2 bytes
    assert PagedKVCache.bytes_per_block(dtype=torch.float32, **DIMS) == 2 * per_block
    assert PagedKVCache.num_blocks_for_budget(10 * per_block, dtype=torch.bfloat16, **DIMS) == 10
    assert PagedKVCache.num_blocks_for_budget(10 * per_block + per_block - 1, dtype=torch.bfloat16, **DIMS) == 10
    # The budget sizes a real cache exactly.
    cache = make_cache(num_blocks=7, dtype=torch.bfloat16)
    assert cache.nbytes == 7 * per_block


def test_budget_too_small_raises_clear_error() -> None:
    per_block = PagedKVCache.bytes_per_block(dtype=torch.float32, **DIMS)
    with pytest.raises(ValueError, match=rf"{2 * per_block - 1} bytes.*{per_block} bytes"):
        PagedKVCache.num_blocks_for_budget(2 * per_block - 1, dtype=torch.float32, **DIMS)
    assert PagedKVCache.num_blocks_for_budget(2 * per_block, dtype=torch.float32, **DIMS) == 2


def test_describe() -> None:
    cache = make_cache(num_blocks=6)
    gib = cache.nbytes / 1024**3
    assert cache.describe() == f"6 blocks x 4 tokens = 24 tokens, {gib:.2f} GiB"


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        make_cache(num_blocks=1)
    with pytest.raises(ValueError):
        PagedKVCache(num_layers=0, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32, device="cpu")


@pytest.mark.gpu  # deselected by default; run with `pytest -m gpu` on a GPU host
def test_cuda_allocation() -> None:
    cache = PagedKVCache(num_blocks=4, dtype=torch.bfloat16, device="cuda", **DIMS)
    k, _ = cache.layer(0)
    assert k.is_cuda and torch.count_nonzero(cache.kv).item() == 0
