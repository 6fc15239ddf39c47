"""The host tier as the KV cache manager drives it: what goes there and comes back, and the copies that do it.

``host_pool.py`` keeps the host blocks' book; this module keeps everything else about the tier: the copies planned
for the next step, the KV of requests preempted by swap, and the counters. The manager (``manager.py``) owns the
request tables and calls in here where a block leaves the device (eviction, swap) or comes back (a prefix hit, a
resume).

The copies a step makes, in the model runner's order (``take_transfers``): it reads the saves' device blocks before
it writes the loads' (a block evicted and reused in one step), and reads the loads' host blocks before it writes
the saves' (a host block loaded from and refilled in one step). So within one batch a load sees only what the host
tier held before it: a host block that a save of the batch still has to write is no hit (``saving``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.block_pool import BlockHash, BlockPool, KVCacheBlock
from kvcache.host_pool import HostBlockPool
from kvcache.metrics import HostTierStats


@dataclass
class PrefixHit:
    """What a request finds computed already: device blocks to share, then host blocks to copy back."""

    device_blocks: list[KVCacheBlock] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)  # copied into the request's first new blocks
    host_hashes: list[BlockHash | None] = field(default_factory=list)  # None: a swapped-out block of its own
    num_tokens: int = 0  # tokens the two cover
    num_device_tokens: int = 0  # of num_tokens, in device blocks
    swapped: bool = False  # the exact KV of a request preempted by swap


@dataclass
class SwappedKV:
    """A request preempted by swap: its KV, block by block, in the host tier, held there until it resumes."""

    num_tokens: int
    host_blocks: list[int]
    hashes: list[BlockHash | None]  # a cached block's hash (pinned), or None (a block owned by the request)


class HostTier:
    """``num_blocks`` host blocks under ``device_pool``, the copies planned between the two, swapped-out KV."""

    def __init__(self, num_blocks: int, device_pool: BlockPool, block_size: int) -> None:
        self.pool = HostBlockPool(num_blocks)
        self.device_pool = device_pool  # its evictions come here (the manager sets device_pool.on_evict)
        self.block_size = block_size
        self.swapped: dict[str, SwappedKV] = {}
        # Copies for the next step: (host block, device block, hash or None) loads, (device block, host block) saves.
        # A load's host block is held (pinned, or owned by the request that swapped it out) until they are taken.
        self.loads: list[tuple[int, int, BlockHash | None]] = []
        self.saves: list[tuple[int, int]] = []
        self.external_prefix_cache_queries = 0  # tokens looked up in the host tier
        self.external_prefix_cache_hits = 0  # tokens found there
        self.num_blocks_saved = 0  # copies to the host tier (evictions and swaps)
        self.num_blocks_loaded = 0  # copies back to the device (prefix hits and swaps)
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    # ------------------------------------------------------------------ leaving the device

    def save_evicted(self, block: KVCacheBlock) -> None:
        """The device pool is about to reuse a cached block: copy its KV here first (the copy is made before the
        step that reuses the block writes to it)."""
        host_block = self.pool.store(block.block_hash)
        if host_block is not None:
            self.saves.append((block.block_id, host_block))
            self.num_blocks_saved += 1

    def swap_out(self, request_id: str, block_ids: Sequence[int], hashes: Sequence[BlockHash], num_tokens: int) -> bool:
        """Keep the KV of a request's first ``num_tokens`` tokens, in its device blocks ``block_ids``: the blocks
        with ``hashes`` (its full ones) under them, pinned (a copy only where the tier lacks one), the rest in
        blocks of its own. False, with nothing changed, when the tier cannot hold them all."""
        pool = self.pool
        num_blocks, num_hashed = len(block_ids), len(hashes)
        present = [pool.lookup(h) is not None for h in hashes]
        num_evictable_pinned = sum(1 for h, here in zip(hashes, present) if here and pool.is_evictable(h))
        if num_blocks - sum(present) > pool.num_storable(num_evictable_pinned):
            return False
        for h, here in zip(hashes, present):  # pinned first, so that storing the others cannot evict them
            if here:
                pool.pin(h)
        host_blocks: list[int] = []
        for block_id, h, here in zip(block_ids, hashes, present):
            if here:
                host_blocks.append(pool.lookup(h))
                continue
            host_block = pool.store(h)
            pool.pin(h)
            self.saves.append((block_id, host_block))
            host_blocks.append(host_block)
        for block_id in block_ids[num_hashed:]:
            host_block = pool.take_owned()
            self.saves.append((block_id, host_block))
            host_blocks.append(host_block)
        self.num_blocks_saved += num_blocks - sum(present)
        self.num_swapped_out_blocks += num_blocks
        self.swapped[request_id] = SwappedKV(num_tokens, host_blocks, [*hashes, *[None] * (num_blocks - num_hashed)])
        return True

    # ------------------------------------------------------------------ coming back

    def saving(self) -> set[int]:
        """Host blocks a save not yet taken writes: no load of this batch may read them."""
        return {host_block for _, host_block in self.saves}

    def swapped_prefix(self, request_id: str, num_known_tokens: int, saving: set[int]) -> PrefixHit | None:
        """A swapped-out request's own KV: its leading full blocks still cached on the device are shared, the rest
        copied back. None where it cannot come back so: its KV would load a block ``saving`` writes (it resumes
        before its swap's copies are made), or it leaves none of the ``num_known_tokens`` to compute (a beam
        swapped out while it waited for its next token)."""
        swapped = self.swapped.get(request_id)
        if swapped is None or swapped.num_tokens >= num_known_tokens:
            return None
        hit = PrefixHit(num_tokens=swapped.num_tokens, swapped=True)
        for block_hash in swapped.hashes:
            block = self.device_pool.get_cached_block(block_hash) if block_hash is not None else None
            if block is None:
                break
            hit.device_blocks.append(block)
        n = len(hit.device_blocks)
        hit.num_device_tokens = min(n * self.block_size, swapped.num_tokens)
        hit.host_blocks, hit.host_hashes = swapped.host_blocks[n:], swapped.hashes[n:]
        return hit if saving.isdisjoint(hit.host_blocks) else None

    def extend_prefix(self, hit: PrefixHit, hashes: Sequence[BlockHash], saving: set[int]) -> None:
        """Go on with a device lookup that stopped: the blocks of ``hashes`` (those after its device blocks) that
        the tier holds, in order, up to the first it lacks."""
        for block_hash in hashes:
            host_block = self.pool.lookup(block_hash)
            if host_block is None or host_block in saving:
                break
            hit.host_blocks.append(host_block)
            hit.host_hashes.append(block_hash)
        hit.num_tokens += len(hit.host_blocks) * self.block_size

    def record_hit(self, num_queried_tokens: int, hit: PrefixHit) -> None:
        self.external_prefix_cache_queries += num_queried_tokens - hit.num_device_tokens
        self.external_prefix_cache_hits += hit.num_tokens - hit.num_device_tokens

    def pin_hits(self, hit: PrefixHit) -> None:
        """Hold a lookup's host blocks before the allocation that takes it: the device blocks it evicts are stored
        here, and could evict these."""
        if not hit.swapped:
            for block_hash in hit.host_hashes:
                self.pool.pin(block_hash)

    def plan_loads(self, request_id: str, hit: PrefixHit, new_blocks: list[KVCacheBlock]) -> None:
        """Copies of ``hit``'s host blocks into the first of ``new_blocks`` (the blocks stay held until the copies
        are taken). A swapped-out request's KV is back: what it held and does not load is released; one that came
        back by an ordinary lookup instead lets its swapped KV go."""
        assert len(new_blocks) >= len(hit.host_blocks), "fewer new blocks than host blocks to load"
        for host_block, block_hash, block in zip(hit.host_blocks, hit.host_hashes, new_blocks):
            self.loads.append((host_block, block.block_id, block_hash))
        self.num_blocks_loaded += len(hit.host_blocks)
        swapped = self.swapped.pop(request_id, None)
        if swapped is None:
            return
        if hit.swapped:
            n = len(hit.device_blocks)
            self.release(swapped.host_blocks[:n], swapped.hashes[:n])
            self.num_swapped_in_blocks += len(swapped.host_blocks)
        else:
            self.release(swapped.host_blocks, swapped.hashes)

    def drop(self, request_id: str) -> None:
        """A swapped-out request is gone: its host blocks are released."""
        swapped = self.swapped.pop(request_id, None)
        if swapped is not None:
            self.release(swapped.host_blocks, swapped.hashes)

    def release(self, host_blocks: Sequence[int], hashes: Sequence[BlockHash | None]) -> None:
        for host_block, block_hash in zip(host_blocks, hashes):
            if block_hash is None:
                self.pool.free_owned(host_block)
            else:
                self.pool.unpin(block_hash)

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the next step makes before its forward pass: ``loads`` (host block, device block) and
        ``saves`` (device block, host block), in the order the module docstring gives. The loads' host blocks are
        released here: later copies into them are made after these."""
        loads, self.loads = self.loads, []
        saves, self.saves = self.saves, []
        # A host block stored into twice in one batch (its first hash evicted again for a later block): only the
        # last save counts.
        last = {host_block: i for i, (_, host_block) in enumerate(saves)}
        if len(last) < len(saves):
            self.num_blocks_saved -= len(saves) - len(last)
            saves = [pair for i, pair in enumerate(saves) if last[pair[1]] == i]
        self.release([h for h, _, _ in loads], [x for _, _, x in loads])
        return [(h, d) for h, d, _ in loads], saves

    # ------------------------------------------------------------------ observing

    def stats(self) -> HostTierStats:
        return HostTierStats(
            num_total_blocks=self.pool.num_blocks,
            num_used_blocks=self.pool.num_used_blocks,
            external_prefix_cache_queries=self.external_prefix_cache_queries,
            external_prefix_cache_hits=self.external_prefix_cache_hits,
            num_blocks_saved=self.num_blocks_saved,
            num_blocks_loaded=self.num_blocks_loaded,
            num_swapped_out_blocks=self.num_swapped_out_blocks,
            num_swapped_in_blocks=self.num_swapped_in_blocks,
            num_swapped_requests=len(self.swapped),
        )

    def check_invariants(self, requests_with_tables) -> None:
        """Raise AssertionError if the holds on host blocks (pins, owned blocks) disagree with their holders: the
        swapped-out requests (none of which holds device blocks) and the planned loads."""
        pool = self.pool
        pool.check_invariants()
        owned: list[int] = []
        pins: Counter[BlockHash] = Counter()
        for rid, swapped in self.swapped.items():
            assert rid not in requests_with_tables, f"request {rid}: swapped out but holds device blocks"
            assert len(swapped.host_blocks) == -(-swapped.num_tokens // self.block_size), f"request {rid}: blocks"
            for host_block, block_hash in zip(swapped.host_blocks, swapped.hashes):
                if block_hash is None:
                    owned.append(host_block)
                else:
                    assert pool.lookup(block_hash) == host_block, f"request {rid}: host block {host_block} lost"
                    pins[block_hash] += 1
        for host_block, _, block_hash in self.loads:
            if block_hash is None:
                owned.append(host_block)
            else:
                pins[block_hash] += 1
        assert sorted(owned) == sorted(pool.owned_blocks()), "owned host blocks out of sync with their holders"
        assert pins == pool.pin_counts(), "host pins out of sync with their holders"
