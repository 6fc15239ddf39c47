"""The KV cache manager: each request's block table, prefix-cache lookups and slot allocation.

The scheduler speaks in token counts; the manager turns them into blocks. A request
that holds ``num_tokens`` tokens has exactly ``ceil(num_tokens / block_size)`` blocks,
and token ``i`` lives in slot ``block_ids[i // block_size] * block_size + i % block_size``::

    block_size = 4, 10 tokens, prefix hit on the first block:

    tokens       t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  .
    block table  [   17     ,     5       ,    9      ]
                  shared,      full,         last block, partly filled
                  hash h0      hash h1       (no hash until it is full)

    h0 = hash(None, t0..t3), h1 = hash(h0, t4..t7): a block's hash covers its whole prefix.

Only full blocks are cached, so only full blocks are ever shared between requests.
Token ids of a request only grow (prompt, then generated tokens), so the chained
hashes of its full blocks never change once computed and are kept per request.

With a host tier (``num_host_blocks``, ``kvcache/host_pool.py``) an evicted cached block is copied to host
memory under its hash first, and a prefix lookup that runs out of device blocks goes on in the host tier: those
blocks come back by a copy into fresh device blocks before the step that reads them. A request preempted by swap
(``swap_out``) leaves its KV in the host tier, held there, and gets exactly that back when it resumes. The copies
are planned here and handed out with each step (``take_transfers``); the model runner makes them in order.

A prompt with images passes ``mm_spans``, (offset, length, key) per image: a block
holding any of an image's placeholder tokens hashes the image's key too, so the same
placeholders with another image are another prefix. A request under a LoRA adapter passes a span of its first
token keyed by the adapter (``ADAPTER_KEY_PREFIX``), so that its blocks, chained from that one, are its adapter's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from kvcache.host_tier import HostTier, PrefixHit
from kvcache.metrics import KVCacheStats

# (offset, length, key) of each image in a request's tokens, by offset: see the module docstring.
MMSpans = Sequence[tuple[int, int, bytes]]
# A span whose key starts so is no image but the LoRA adapter a request runs under: a key of its first block.
ADAPTER_KEY_PREFIX = b"lora-adapter:"


# Slots may be allocated for one token not known yet: the token a step in flight is sampling,
# when the engine plans the next step before that token arrives.
MAX_UNKNOWN_TOKENS = 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _BlockTable:
    """One request's blocks. Invariant: ``len(blocks) == ceil(num_tokens / block_size)``."""

    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # mirrors blocks, kept for cheap reads
    num_tokens: int = 0  # tokens whose KV the table holds or is about to hold
    num_cached_blocks: int = 0  # blocks[:num_cached_blocks] have been offered to the prefix cache


class KVCacheManager:
    """Per-request block tables on top of a BlockPool, with prefix caching.

    Typical use by the scheduler::

        blocks, num_cached = mgr.get_computed_blocks(rid, token_ids)     # new request only
        new_ids = mgr.allocate_slots(rid, token_ids, num_cached, n, blocks)
        ...                                                              # every later step
        new_ids = mgr.allocate_slots(rid, token_ids, num_computed, n)
        mgr.free(rid)                                                    # finished or preempted
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks and not enable_prefix_caching:
            raise ValueError("a host tier finds blocks by their prefix hashes: it needs prefix caching")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # The host tier (kvcache/host_tier.py), if any; ``host`` is its book of blocks.
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.tier = HostTier(num_host_blocks, self.pool, block_size) if num_host_blocks else None
        self.host = self.tier.pool if self.tier is not None else None
        if self.tier is not None:
            self.pool.on_evict = self.tier.save_evicted
        self._tables: dict[str, _BlockTable] = {}
        # Chained hashes of each request's full blocks, computed once; may exist before its table.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ------------------------------------------------------------------ public API

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free ones, including evictable cached ones)."""
        return self.pool.num_free_blocks

    @property
    def num_requests(self) -> int:
        """Requests that hold a block table (allocated at least once and not freed)."""
        return len(self._tables)

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], record: bool = True, mm_spans: MMSpans | None = None
    ) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``token_ids``, in full blocks, and its length in tokens.

        Never covers the whole prompt: at most ``(len(token_ids) - 1) // block_size``
        blocks, so at least the last token is computed and yields logits. Takes no
        references; pass the blocks to ``allocate_slots`` to keep them. ``record=False``
        leaves the hit counters alone: a caller that may retry the lookup calls
        ``record_prefix_lookup`` once the lookup is used. ``mm_spans``: the request's images.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        hashes = self._hashes_upto(request_id, token_ids, max_blocks, mm_spans)
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_cached_tokens = len(blocks) * self.block_size
        if record:
            self.record_prefix_lookup(len(token_ids), num_cached_tokens)
        return blocks, num_cached_tokens

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup in the hit-rate counters."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def find_prefix(self, request_id: str, token_ids: Sequence[int], mm_spans: MMSpans | None = None) -> PrefixHit:
        """What ``request_id`` has computed already: a swapped-out request's own KV, or else the longest cached
        prefix, in device blocks and then in host blocks (``get_computed_blocks``' rule: never the last token).
        Takes nothing; ``allocate_slots(prefix=...)`` takes it, and ``record_prefix_hit`` counts it.

        A load reads its host block before the same batch's saves write theirs (``take_transfers``), so a host
        block a save not yet taken writes is no hit. A swapped-out request gets the ordinary lookup instead of its
        own KV when that KV would load such a block (it resumes before its swap's copies are made), or when it
        leaves no token to compute (a beam swapped out while it waited for its next token); ``allocate_slots``
        then lets its swapped KV go.
        """
        tier = self.tier
        saving = tier.saving() if tier is not None else set()
        if tier is not None and (hit := tier.swapped_prefix(request_id, len(token_ids), saving)) is not None:
            return hit
        blocks, num_device = self.get_computed_blocks(request_id, token_ids, record=False, mm_spans=mm_spans)
        hit = PrefixHit(device_blocks=blocks, num_tokens=num_device, num_device_tokens=num_device)
        if tier is not None:
            max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
            hashes = self._hashes_upto(request_id, token_ids, max_blocks, mm_spans)
            tier.extend_prefix(hit, hashes[len(blocks):max_blocks], saving)
        return hit

    def record_prefix_hit(self, num_queried_tokens: int, hit: PrefixHit) -> None:
        """Count a lookup whose ``hit`` a request was admitted with: device hits in the prefix-cache counters,
        host hits in the external ones (tokens the device pool did not have, and those found in the host tier)."""
        if hit.swapped:
            return  # its own KV coming back, not a lookup
        self.record_prefix_lookup(num_queried_tokens, hit.num_device_tokens)
        if self.tier is not None:
            self.tier.record_hit(num_queried_tokens, hit)

    def swap_out(self, request_id: str, token_ids: Sequence[int], num_tokens: int,
                 mm_spans: MMSpans | None = None) -> bool:
        """Preemption by swap: keep the KV of the request's first ``num_tokens`` tokens in the host tier, held
        there until it resumes (``find_prefix`` then gives exactly it), and release its device blocks.

        Full blocks go in under their hashes (a copy only where the host tier lacks them); the rest, whose hash
        is not known yet, into blocks of the request's own. False, with nothing changed, when the host tier
        cannot hold it all or there is nothing to keep: the caller recomputes instead.
        """
        table = self._tables.get(request_id)
        num_blocks = _cdiv(num_tokens, self.block_size)
        if self.tier is None or table is None or num_blocks == 0 or num_tokens > table.num_tokens:
            return False
        num_hashed = min(num_tokens, len(token_ids)) // self.block_size
        hashes = self._hashes_upto(request_id, token_ids, num_hashed, mm_spans)[:num_hashed]
        if not self.tier.swap_out(request_id, table.block_ids[:num_blocks], hashes, num_tokens):
            return False
        self._release_device_blocks(request_id)
        return True

    def is_swapped(self, request_id: str) -> bool:
        return self.tier is not None and request_id in self.tier.swapped

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the next step makes before its forward pass: ``loads`` (host block, device block) and
        ``saves`` (device block, host block). A device block may be saved and then loaded into (it was evicted
        and reused), and a host block loaded from and then saved into, so the runner reads the saves' device
        blocks before it writes the loads', and reads the loads' host blocks before it writes the saves'. The
        loads' host blocks are released here: later copies into them are made after these."""
        return self.tier.take_transfers() if self.tier is not None else ([], [])

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        mm_spans: MMSpans | None = None,
        prefix: PrefixHit | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Grow the request's table to hold ``num_computed_tokens + num_new_tokens`` tokens.

        ``new_computed_blocks`` is a prefix hit from ``get_computed_blocks``, allowed only
        on the first allocation; ``num_computed_tokens`` already counts its tokens.
        ``token_ids`` are all known tokens of the request. Blocks that become full are
        cached under their chained hash (their KV is written this step, before any read);
        ``mm_spans`` are the request's images, as for ``get_computed_blocks``. ``prefix``, from ``find_prefix``
        (instead of ``new_computed_blocks``): its device blocks are shared and its host blocks copied into the
        first new blocks before the step. ``num_lookahead_tokens``: of the new tokens, how many lie past the known
        ones (speculative proposals; their slots are written, never hashed until the tokens are known).

        Returns the ids of the newly allocated blocks, in table order, or None, with
        nothing changed, if there are not enough free blocks.
        """
        if prefix is not None:
            new_computed_blocks = prefix.device_blocks
        hit_blocks = new_computed_blocks or []
        num_tokens = num_computed_tokens + num_new_tokens
        table = self._tables.get(request_id)
        if (table is not None and not hit_blocks and prefix is None
                and num_tokens <= len(table.blocks) * self.block_size
                and (not self.enable_prefix_caching or num_tokens // self.block_size <= table.num_cached_blocks)):
            # The common decode step: the tokens fit in the last block and fill no block. Nothing to do.
            table.num_tokens = max(table.num_tokens, num_tokens)
            return []
        self._check_allocate_args(request_id, table, token_ids, num_computed_tokens,
                                  num_new_tokens - num_lookahead_tokens, hit_blocks)

        num_held = len(table.blocks) if table is not None else 0
        num_new_blocks = max(0, _cdiv(num_tokens, self.block_size) - num_held - len(hit_blocks))
        # Hit blocks with ref 0 sit in the free queue and are counted as free, but
        # touching them takes them out, so they cannot also serve as new blocks.
        num_free_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None

        if table is None:
            table = self._tables[request_id] = _BlockTable()
        if hit_blocks:
            # Touch before allocating, or get_new_blocks could evict a free hit block.
            self.pool.touch(hit_blocks)
            self._append_blocks(table, hit_blocks)
            table.num_cached_blocks = len(hit_blocks)
        if prefix is not None and self.tier is not None:
            self.tier.pin_hits(prefix)  # before allocating, as the device hits are touched
        new_blocks = self.pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        if prefix is not None and self.tier is not None:
            self.tier.plan_loads(request_id, prefix, new_blocks)
        self._append_blocks(table, new_blocks)
        table.num_tokens = max(table.num_tokens, num_tokens)
        if mm_spans:
            bs = self.block_size
            self.pool.mark_visual(table.block_ids[i] for offset, n, key in mm_spans
                                  if not key.startswith(ADAPTER_KEY_PREFIX)
                                  for i in range(offset // bs, min(-(-(offset + n) // bs), len(table.block_ids))))
        if self.enable_prefix_caching:
            self._cache_full_blocks(request_id, table, token_ids, mm_spans)
        return [block.block_id for block in new_blocks]

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Shrink the request's table to its first ``num_tokens`` tokens: the blocks past them go back to the pool.

        For the slots of speculative proposals a step rejected: their KV is never read, and the slots of the tokens
        that come instead are allocated again when those are scheduled. Only blocks not yet offered to the prefix
        cache may go (a rejected proposal is never hashed). Returns how many blocks were released.
        """
        table = self._tables.get(request_id)
        if table is None or num_tokens >= table.num_tokens:
            return 0
        if num_tokens < table.num_cached_blocks * self.block_size:
            raise ValueError(f"request {request_id}: trimming to {num_tokens} tokens would drop a cached block")
        num_kept = _cdiv(num_tokens, self.block_size)
        dropped = table.blocks[num_kept:]
        del table.blocks[num_kept:], table.block_ids[num_kept:]
        table.num_tokens = num_tokens
        self.pool.free_blocks(dropped, first_out=True)  # uncached: nothing in them is worth keeping
        return len(dropped)

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give ``child_id`` the parent's KV of its first ``num_tokens`` tokens (a beam that branches).

        The full blocks are shared (one more reference each; tokens only append, so they are never
        written again). The partly filled last block would be written by both, so the child gets a
        block of its own and the caller copies the parent's into it before the next write
        (copy-on-write): returns the (source, destination) block copies to make (none or that one), or
        None, with nothing changed, when no block is free for the copy.
        """
        parent = self._tables[parent_id]
        if child_id in self._tables:
            raise ValueError(f"request {child_id!r} already has a block table")
        if num_tokens > parent.num_tokens:
            raise ValueError(f"request {parent_id}: {parent.num_tokens} tokens in its table, not {num_tokens}")
        num_full, partial = divmod(num_tokens, self.block_size)
        if partial and self.pool.num_free_blocks < 1:
            return None
        table = self._tables[child_id] = _BlockTable()
        shared = parent.blocks[:num_full]
        self.pool.touch(shared)
        self._append_blocks(table, shared)
        copies = []
        if partial:
            block = self.pool.get_new_blocks(1)
            self._append_blocks(table, block)
            copies.append((parent.block_ids[num_full], block[0].block_id))
        table.num_tokens = num_tokens
        table.num_cached_blocks = min(parent.num_cached_blocks, num_full)
        if parent_id in self._block_hashes:
            self._block_hashes[child_id] = self._block_hashes[parent_id][:num_full]
        return copies

    def free(self, request_id: str) -> None:
        """Release the request's blocks and forget it. Unknown ids are ignored.

        Blocks are freed tail first: the tail is the least likely to be shared, so it
        reaches the LRU head sooner and is evicted before the common prefix.
        """
        if self.tier is not None:
            self.tier.drop(request_id)
        self._release_device_blocks(request_id)

    def _release_device_blocks(self, request_id: str) -> None:
        self._block_hashes.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if table is not None:
            self.pool.free_blocks(reversed(table.blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids (a copy); [] for an unknown request."""
        table = self._tables.get(request_id)
        return list(table.block_ids) if table is not None else []

    def get_stats(self) -> KVCacheStats:
        """A snapshot of occupancy, fragmentation and prefix-cache counters."""
        pool = self.pool
        return KVCacheStats(
            block_size=self.block_size,
            num_total_blocks=pool.num_total_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            usage=pool.usage,
            fragmentation=self._fragmentation(),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            host=self.tier.stats() if self.tier is not None else None,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the tables and the pool disagree."""
        self.pool.check_invariants()
        bs = self.block_size
        refs: Counter[int] = Counter()
        for rid, table in self._tables.items():
            assert len(table.blocks) == _cdiv(table.num_tokens, bs), (
                f"request {rid}: {len(table.blocks)} blocks for {table.num_tokens} tokens"
            )
            assert table.block_ids == [b.block_id for b in table.blocks], f"request {rid}: block_ids out of sync"
            assert len(set(table.block_ids)) == len(table.block_ids), f"request {rid}: a block appears twice"
            assert table.num_cached_blocks <= table.num_tokens // bs, f"request {rid}: cached a block not yet full"
            hashes = self._block_hashes.get(rid, [])
            for i, block in enumerate(table.blocks):
                assert block is not self.pool.null_block, f"request {rid}: null block in its table"
                refs[block.block_id] += 1
                if block.ref_cnt > 1:  # only full blocks are shared (fragmentation relies on it)
                    assert (i + 1) * bs <= table.num_tokens, f"request {rid}: shared block {block.block_id} not full"
                if i < len(hashes) and block.block_hash is not None:
                    assert block.block_hash == hashes[i], f"request {rid}: block {block.block_id} has a wrong hash"
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {refs[block.block_id]} tables hold it"
            )
        assert sum(refs.values()) == sum(b.ref_cnt for b in self.pool.blocks), "table references != ref counts"
        if self.tier is not None:
            self.tier.check_invariants(self._tables)

    # ------------------------------------------------------------------ internals

    def _check_allocate_args(
        self,
        request_id: str,
        table: _BlockTable | None,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        hit_blocks: list[KVCacheBlock],
    ) -> None:
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"request {request_id}: negative token counts ({num_computed_tokens}, {num_new_tokens})")
        if len(token_ids) + MAX_UNKNOWN_TOKENS < num_computed_tokens + num_new_tokens:
            raise ValueError(
                f"request {request_id}: {len(token_ids)} token ids known but "
                f"{num_computed_tokens} + {num_new_tokens} tokens to allocate"
            )
        if hit_blocks and table is not None and table.blocks:
            raise ValueError(f"request {request_id}: prefix-hit blocks are only allowed on the first allocation")
        if len(hit_blocks) * self.block_size > num_computed_tokens:
            raise ValueError(
                f"request {request_id}: {len(hit_blocks)} prefix-hit blocks exceed "
                f"num_computed_tokens={num_computed_tokens}"
            )

    @staticmethod
    def _append_blocks(table: _BlockTable, blocks: list[KVCacheBlock]) -> None:
        table.blocks.extend(blocks)
        table.block_ids.extend(block.block_id for block in blocks)

    def _hashes_upto(self, request_id: str, token_ids: Sequence[int], num_blocks: int,
                     mm_spans: MMSpans | None = None) -> list[BlockHash]:
        """The request's chained block hashes, extended to at least ``num_blocks`` entries."""
        hashes = self._block_hashes.setdefault(request_id, [])
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            start, end = i * bs, (i + 1) * bs
            keys = [key for offset, n, key in mm_spans if offset < end and offset + n > start] if mm_spans else ()
            parent = hash_block_tokens(parent, token_ids[start:end], keys)
            hashes.append(parent)
        return hashes

    def _cache_full_blocks(self, request_id: str, table: _BlockTable, token_ids: Sequence[int],
                           mm_spans: MMSpans | None = None) -> None:
        # A block whose last token is still being sampled is cached by a later call, once it is known.
        num_full_blocks = min(table.num_tokens, len(token_ids)) // self.block_size
        if num_full_blocks <= table.num_cached_blocks:
            return
        hashes = self._hashes_upto(request_id, token_ids, num_full_blocks, mm_spans)
        for i in range(table.num_cached_blocks, num_full_blocks):
            self.pool.cache_full_block(table.blocks[i], hashes[i])
        table.num_cached_blocks = num_full_blocks

    def _fragmentation(self) -> float:
        """(allocated slots - used token slots) / allocated slots, each in-use block counted once."""
        num_used_blocks = self.pool.num_used_blocks
        if num_used_blocks == 0:
            return 0.0
        num_allocated_slots = num_used_blocks * self.block_size
        # Only full blocks are shared, so each reference beyond a block's first is one
        # full block counted twice in the sum of table token counts.
        num_refs = sum(len(t.blocks) for t in self._tables.values())
        num_token_slots = sum(t.num_tokens for t in self._tables.values())
        num_used_slots = num_token_slots - (num_refs - num_used_blocks) * self.block_size
        return (num_allocated_slots - num_used_slots) / num_allocated_slots
