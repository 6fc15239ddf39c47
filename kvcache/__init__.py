"""Paged KV cache: the block pool, per-request block tables, and the KV tensors."""

from kvcache.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from kvcache.manager import KVCacheManager
from kvcache.metrics import KVCacheStats
from kvcache.paged_cache import PagedKVCache

__all__ = [
    "BlockPool",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheStats",
    "PagedKVCache",
    "hash_block_tokens",
]
