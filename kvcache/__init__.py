"""Paged KV cache: the block pool, per-request block tables, and the KV tensors.

The names below are imported on first use: ``kvcache.metrics`` (plain dataclasses) travels to the API server,
which should not import torch for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "BlockPool": "kvcache.block_pool",
    "KVCacheBlock": "kvcache.block_pool",
    "hash_block_tokens": "kvcache.block_pool",
    "KVCacheManager": "kvcache.manager",
    "KVCacheStats": "kvcache.metrics",
    "PagedKVCache": "kvcache.paged_cache",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from kvcache.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
    from kvcache.manager import KVCacheManager
    from kvcache.metrics import KVCacheStats
    from kvcache.paged_cache import PagedKVCache


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
