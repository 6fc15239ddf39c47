"""A snapshot of KV cache occupancy and prefix-cache effectiveness, for logs and /metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVTransferStats:
    """Copies between the device pool and the host tier since start, by direction (rank 0's share under tensor
    parallelism): blocks, bytes and seconds (device time of the copies on CUDA, counted once they finished)."""

    blocks_to_host: int = 0
    blocks_to_device: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    seconds_to_host: float = 0.0
    seconds_to_device: float = 0.0


@dataclass(frozen=True)
class HostTierStats:
    """The host tier below the block pool (``kvcache/host_pool.py``): occupancy now, counters since start."""

    num_total_blocks: int
    num_used_blocks: int  # cached, pinned or owned by swapped-out requests
    external_prefix_cache_queries: int  # tokens looked up in the host tier (the device pool did not have them)
    external_prefix_cache_hits: int  # tokens found there
    num_blocks_saved: int  # copies to the host tier: evicted cached blocks, swapped-out requests' blocks
    num_blocks_loaded: int  # copies back to the device: host prefix hits, swapped-in requests' blocks
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_swapped_requests: int  # preempted by swap and not resumed yet


@dataclass(frozen=True)
class KVCacheStats:
    """Occupancy of the block pool at one moment, and prefix-cache counters since start.

    Block counts exclude the reserved null block. Prefix-cache counters are in tokens:
    ``prefix_cache_queries`` counts the prompt tokens looked up, ``prefix_cache_hits``
    the tokens found cached.
    """

    block_size: int  # tokens per block
    num_total_blocks: int
    num_free_blocks: int  # ref 0, cached or not (cached ones are evictable)
    num_used_blocks: int  # ref >= 1
    num_cached_blocks: int  # findable by hash, in use or free
    usage: float  # num_used_blocks / num_total_blocks
    fragmentation: float  # (allocated slots - used token slots) / allocated slots
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    host: HostTierStats | None = None  # with a host tier (--kv-offloading-size)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of looked-up tokens found in the prefix cache; 0.0 before any lookup."""
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
