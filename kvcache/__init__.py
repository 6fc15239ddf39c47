"""Paged KV cache: the block pool, per-request block tables, and the KV tensors.

    block_pool.py   KV blocks, their chained prefix hashes, the LRU free queue
    host_pool.py    the host tier's blocks: cached by hash (LRU), pinned, owned by swapped-out requests
    host_tier.py    the host tier as the manager drives it: copies planned per step, swapped-out KV, counters
    manager.py      per-request block tables on top of the pool (KVCacheManager), prefix lookups in both tiers
    paged_cache.py  the KV tensors of every layer (PagedKVCache), FP8 rounding
    metrics.py      KVCacheStats, plain numbers for /metrics

Import from the modules. This package imports nothing itself: ``kvcache.metrics`` travels to the API
server, which should not import torch for it.
"""
