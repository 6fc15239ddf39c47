"""The host tier's book: blocks in host memory below the device pool, found by the prefix cache's hashes.

The device pool (``block_pool.py``) drops a cached block's hash when it evicts the block; with a host tier the
block's KV is copied to a host block first, under the same chained hash, so a later request with that prefix
gets it back by a copy instead of a prefill. A host block is in one of three states::

    free --store(hash)--> cached (evictable, LRU) --pin--> pinned (not evictable) --unpin--> cached
    free --take_owned--> owned (a swapped-out request's block without a hash) --free_owned--> free
    cached --store of another hash, when no block is free (the least recently used goes)--> cached

Pins are counted: a block stays pinned while a swapped-out request holds it or a copy back to the device is
planned from it. This module only keeps the book; the copies themselves are the model runner's
(``engine/worker/kv_offload.py``), which runs them in the order the book planned them.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvcache.block_pool import BlockHash

# Values of HostBlockPool.block_states(), one int8 per host block.
HOST_FREE = 0
HOST_CACHED = 1  # findable by hash, evictable
HOST_HELD = 2  # pinned (a swapped-out request or a planned copy holds it) or owned by a swapped-out request


class HostBlockPool:
    """``num_blocks`` host blocks: a hash map of cached ones in LRU order, pins, and blocks owned by requests."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is taken first
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # cached, unpinned: least recently used first
        self._pinned: dict[BlockHash, int] = {}  # cached and pinned
        self._pins: dict[int, int] = {}  # host block -> pin count, for the pinned ones
        self._owned: set[int] = set()
        self._states = np.zeros(num_blocks, dtype=np.int8)

    # ------------------------------------------------------------------ counts

    @property
    def num_used_blocks(self) -> int:
        """Blocks holding KV: cached, pinned or owned."""
        return self.num_blocks - len(self._free)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no one pins: ``store`` may reuse them."""
        return len(self._lru)

    # ------------------------------------------------------------------ lookups

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The host block holding ``block_hash``'s KV, or None. Leaves the LRU order alone."""
        block = self._lru.get(block_hash)
        return block if block is not None else self._pinned.get(block_hash)

    def is_evictable(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def owned_blocks(self) -> list[int]:
        return sorted(self._owned)

    def pin_counts(self) -> dict[BlockHash, int]:
        return {h: self._pins[block] for h, block in self._pinned.items()}

    def touch(self, block_hash: BlockHash) -> None:
        """Mark a cached block used now (it is evicted last)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)

    # ------------------------------------------------------------------ changes

    def store(self, block_hash: BlockHash) -> int | None:
        """A host block to copy ``block_hash``'s KV into, cached under it; None when the hash is here already (it
        becomes the most recently used) or every block is held. Evicts the least recently used cached block when
        none is free."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return None
        if block_hash in self._pinned:
            return None
        block = self._take_block()
        if block is None:
            return None
        self._lru[block_hash] = block
        self._states[block] = HOST_CACHED
        return block

    def pin(self, block_hash: BlockHash) -> int:
        """Hold the cached block of ``block_hash`` (it must be here) so that no ``store`` evicts it."""
        block = self._lru.pop(block_hash, None)
        if block is not None:
            self._pinned[block_hash] = block
            self._pins[block] = 1
            self._states[block] = HOST_HELD
            return block
        block = self._pinned[block_hash]  # KeyError: not in the tier
        self._pins[block] += 1
        return block

    def unpin(self, block_hash: BlockHash) -> None:
        """Drop one pin; the last makes the block evictable again, as the most recently used."""
        block = self._pinned[block_hash]
        self._pins[block] -= 1
        if self._pins[block] == 0:
            del self._pins[block], self._pinned[block_hash]
            self._lru[block_hash] = block
            self._states[block] = HOST_CACHED

    def take_owned(self) -> int | None:
        """A block outside the hash map, for a swapped-out request's block that has no hash (its last, partly
        filled one); None when every block is held."""
        block = self._take_block()
        if block is not None:
            self._owned.add(block)
            self._states[block] = HOST_HELD
        return block

    def free_owned(self, block: int) -> None:
        self._owned.remove(block)
        self._free.append(block)
        self._states[block] = HOST_FREE

    def num_storable(self, hashes_to_pin: int = 0) -> int:
        """Blocks ``store`` and ``take_owned`` could hand out now, after ``hashes_to_pin`` evictable blocks are
        pinned."""
        return len(self._free) + len(self._lru) - hashes_to_pin

    def block_states(self) -> np.ndarray:
        """int8 [num_blocks]: 0 free, 1 cached, 2 held (pinned or owned)."""
        return self._states.copy()

    def check_invariants(self) -> None:
        """Raise AssertionError if the book is inconsistent."""
        free = set(self._free)
        cached = set(self._lru.values())
        pinned = set(self._pinned.values())
        assert len(free) == len(self._free), "a host block is free twice"
        assert len(cached) == len(self._lru) and len(pinned) == len(self._pinned), "a host block holds two hashes"
        groups = [free, cached, pinned, self._owned]
        assert sum(len(g) for g in groups) == self.num_blocks, "host blocks lost or counted twice"
        assert set().union(*groups) == set(range(self.num_blocks)), "host block ids out of range"
        assert not (set(self._lru) & set(self._pinned)), "a hash both pinned and evictable"
        assert set(self._pins) == pinned and all(n > 0 for n in self._pins.values()), "pin counts out of sync"
        for block in range(self.num_blocks):
            expected = HOST_FREE if block in free else HOST_CACHED if block in cached else HOST_HELD
            assert self._states[block] == expected, f"host block {block}: state {self._states[block]} != {expected}"

    # ------------------------------------------------------------------ internals

    def _take_block(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._lru:
            _, block = self._lru.popitem(last=False)  # the least recently used
            return block
        return None
