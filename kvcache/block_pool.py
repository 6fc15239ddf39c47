"""The block pool: every KV block, its reference count, the free queue and the prefix-cache map.

A block is ``block_size`` token slots, the same slot range in every layer. The pool
creates all blocks once and never destroys them; a block moves between three states::

    free (ref 0, no hash) --get_new_blocks--> in use (ref >= 1) --free_blocks--> free or cached-free
    cached-free (ref 0, hash)  --touch (prefix hit)--> in use
    cached-free                --get_new_blocks (eviction: hash dropped)--> in use

Free blocks, cached or not, wait in one LRU queue. Freed blocks go to the tail and
allocation pops from the head, so the block freed longest ago is evicted first and
a recently freed block stays findable by its hash for as long as possible.

Block 0 is the null block: it is never handed out and never freed. The model runner
points the slots of padding tokens at it, so writes to it are garbage by design.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

BlockHash = bytes

NULL_BLOCK_ID = 0

# Values of BlockPool.block_states(), one int8 per block.
STATE_FREE = 0  # ref 0, no hash: plain free block
STATE_IN_USE = 1  # ref 1
STATE_CACHED_FREE = 2  # ref 0 with a hash: free, evictable, still a prefix-cache hit
STATE_SHARED = 3  # ref > 1
STATE_NULL = 4  # the reserved null block


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: Sequence[bytes] = ()) -> BlockHash:
    """Chained hash of one block: its parent block's hash, its own token ids and its extra keys.

    Two blocks have equal hashes only if their whole prefixes are equal, so a hash
    lookup finds a block whose KV is valid for this position. ``extra_keys`` are what
    else the block's KV depends on: the content hash of every image whose placeholder
    tokens it holds (the tokens are the same for any image). The encoding is
    unambiguous (a tag byte, the fixed-width parent digest, little-endian int64 token
    ids, then each extra key with its length) and hashlib is deterministic across
    processes, unlike ``hash()``.
    """
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01")
        h.update(parent_hash)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    for key in extra_keys:
        h.update(b"\x02")
        h.update(len(key).to_bytes(4, "little"))
        h.update(key)
    return h.digest()


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    """One KV block. Identity matters (eq=False): two blocks are never interchangeable."""

    block_id: int
    ref_cnt: int = 0
    # Set only while the block is the pool's map entry for this hash.
    block_hash: BlockHash | None = None
    # Free-queue links; both None while the block is not in the queue.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """An O(1) doubly linked list of free blocks, in LRU order (head = evicted first).

    Two sentinel blocks (id -1) bound the list so that no operation special-cases the ends.
    A block is in the queue exactly when its ``prev_free`` is not None.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (least recently freed) block."""
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the tail (evicted last)."""
        self._insert(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the head (taken first)."""
        self._insert(block, self._head, self._head.next_free)

    def _insert(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        prev.next_free = block
        block.prev_free, block.next_free = prev, nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def check_links(self) -> list[KVCacheBlock]:
        """Walk the list both ways, assert the links agree, and return the blocks head to tail."""
        forward = self._walk(self._head, self._tail, "next_free")
        backward = self._walk(self._tail, self._head, "prev_free")
        assert len(forward) == self.num_free_blocks, (
            f"free queue holds {len(forward)} blocks but counts {self.num_free_blocks}"
        )
        assert backward[::-1] == forward, "free queue: forward and backward walks differ"
        return forward

    def _walk(self, start: KVCacheBlock, end: KVCacheBlock, link: str) -> list[KVCacheBlock]:
        # Bounded so that a cycle fails an assertion instead of hanging.
        blocks: list[KVCacheBlock] = []
        block = getattr(start, link)
        while block is not end:
            assert block is not None, f"free queue: broken {link} link"
            assert len(blocks) <= self.num_free_blocks, f"free queue: {link} walk is longer than the count"
            blocks.append(block)
            block = getattr(block, link)
        return blocks


class BlockPool:
    """All KV blocks of one cache: allocation, reference counts and the prefix-cache map.

    Invariants (``check_invariants``): every block but the null block is either in use
    (ref >= 1) or in the free queue (ref 0), never both; ``block.block_hash`` is set
    exactly when ``self._cached[block.block_hash] is block``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_evict: Callable[[KVCacheBlock], None] | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Called with each cached block about to lose its hash to reuse, while its KV is still there: the host
        # tier copies it (kvcache/manager.py).
        self.on_evict = on_evict
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        # Kept up to date on every change so a dashboard can read it without a Python loop.
        self._states = np.zeros(num_blocks, dtype=np.int8)
        self._states[NULL_BLOCK_ID] = STATE_NULL
        # 1 where a block holds an image's tokens (its KV came from a vision encoder), until it is reused.
        self._visual = np.zeros(num_blocks, dtype=np.int8)

    # ------------------------------------------------------------------ public API

    @property
    def num_total_blocks(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref 0, including cached ones (they are evictable)."""
        return self.free_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref >= 1."""
        return self.num_total_blocks - self.free_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, in use or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, 0.0 to 1.0."""
        return self.num_used_blocks / self.num_total_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the LRU head, evicting cached ones, each with ref 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            self._states[block.block_id] = STATE_IN_USE
            self._visual[block.block_id] = 0
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding KV for ``block_hash``, in use or free, or None."""
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block; a free (cached) block leaves the free queue."""
        for block in blocks:
            if block is self.null_block:
                raise ValueError("the null block cannot be referenced")
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            self._states[block.block_id] = self._state_of(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock], first_out: bool = False) -> None:
        """Drop one reference to each block; those reaching 0 join the queue tail in this order (with
        ``first_out``, the head, so that they are taken before any block the prefix cache still holds).

        A freed block keeps its hash, so it stays a prefix-cache hit until it is evicted.
        """
        for block in ordered_blocks:
            if block is self.null_block:
                continue  # never freed: it was never taken
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.appendleft(block) if first_out else self.free_queue.append(block)
            self._states[block.block_id] = self._state_of(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Make a full block findable by ``block_hash``.

        If another block already holds this hash, that entry wins and ``block`` stays
        uncached (no hash), so that evicting it later cannot drop the other's entry.
        """
        if not self.enable_caching:
            return
        if block is self.null_block:
            raise ValueError("the null block cannot be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block.block_id} is already cached under another hash")
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._states[block.block_id] = self._state_of(block)

    def mark_visual(self, block_ids: Iterable[int]) -> None:
        """These blocks hold image tokens (for the dashboard), until they are handed out again."""
        self._visual[list(block_ids)] = 1

    def visual_blocks(self) -> np.ndarray:
        """int8 [num_blocks]: 1 for the blocks that hold image tokens, in use or cached."""
        return self._visual.copy()

    def block_states(self) -> np.ndarray:
        """int8 [num_blocks]: 0 free, 1 in use, 2 cached and free, 3 shared, 4 the null block."""
        return self._states.copy()

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent."""
        queued = self.free_queue.check_links()
        queued_ids = [b.block_id for b in queued]
        assert len(set(queued_ids)) == len(queued_ids), "a block is in the free queue twice"
        assert NULL_BLOCK_ID not in queued_ids, "the null block is in the free queue"
        null = self.null_block
        assert null.ref_cnt == 0 and null.block_hash is None, "the null block was referenced or cached"
        queued_set = set(queued_ids)
        num_used = 0
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_queue = block.block_id in queued_set
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id} ref_cnt {block.ref_cnt} but in free queue: {in_queue}"
            )
            num_used += block.ref_cnt > 0
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash that does not map to it"
                )
            assert self._states[block.block_id] == self._state_of(block), (
                f"block {block.block_id} state {self._states[block.block_id]} != {self._state_of(block)}"
            )
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"hash map entry points at block {block.block_id} with another hash"
        assert num_used == self.num_used_blocks, f"{num_used} blocks in use but counted {self.num_used_blocks}"
        assert self.num_free_blocks + self.num_used_blocks == self.num_total_blocks, "free + used != total"

    # ------------------------------------------------------------------ internals

    def _evict(self, block: KVCacheBlock) -> None:
        if self.on_evict is not None:
            self.on_evict(block)
        assert self._cached.get(block.block_hash) is block, f"block {block.block_id} hash not mapped to it"
        del self._cached[block.block_hash]
        block.block_hash = None

    @staticmethod
    def _state_of(block: KVCacheBlock) -> int:
        if block.ref_cnt == 0:
            return STATE_FREE if block.block_hash is None else STATE_CACHED_FREE
        return STATE_IN_USE if block.ref_cnt == 1 else STATE_SHARED
