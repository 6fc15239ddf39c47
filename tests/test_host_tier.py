"""The KV host tier: HostBlockPool's book (LRU, pins, owned blocks), the manager's two tiers (evicted blocks saved
and loaded back, swap out and resume, counters), and a randomized state machine that runs scheduler-like steps
against the manager and checks the KV *contents* the planned copies produce, token by token."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.block_pool import hash_block_tokens
from kvcache.host_pool import HOST_CACHED, HOST_FREE, HOST_HELD, HostBlockPool
from kvcache.manager import KVCacheManager


def h(*tokens: int) -> bytes:
    """A block hash for the host pool's own tests (any distinct bytes would do)."""
    return hash_block_tokens(None, tokens)


# ---------------------------------------------------------------------------- HostBlockPool


def test_host_pool_needs_a_block() -> None:
    with pytest.raises(ValueError):
        HostBlockPool(0)


def test_store_and_lookup() -> None:
    pool = HostBlockPool(3)
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_evictable_blocks) == (3, 0, 0)
    assert pool.lookup(h(1)) is None
    assert pool.store(h(1)) == 0 and pool.store(h(2)) == 1  # block 0 is taken first
    assert pool.lookup(h(1)) == 0 and pool.lookup(h(2)) == 1 and pool.lookup(h(3)) is None
    assert pool.store(h(1)) is None  # here already: nothing to copy
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_evictable_blocks) == (1, 2, 2)
    assert pool.is_evictable(h(1)) and not pool.is_evictable(h(3))
    assert pool.block_states().tolist() == [HOST_CACHED, HOST_CACHED, HOST_FREE]
    pool.check_invariants()


def test_lru_evicts_the_least_recently_used() -> None:
    pool = HostBlockPool(3)
    a, b, c = pool.store(h(1)), pool.store(h(2)), pool.store(h(3))
    assert pool.store(h(4)) == a  # full: the oldest goes
    assert pool.lookup(h(1)) is None and pool.lookup(h(4)) == a
    # LRU now: 2, 3, 4. A lookup leaves the order alone; touch and a repeated store refresh.
    assert pool.lookup(h(2)) == b
    pool.touch(h(2))  # LRU: 3, 4, 2
    assert pool.store(h(3)) is None  # LRU: 4, 2, 3
    pool.touch(h(99))  # not here: nothing happens
    assert pool.store(h(5)) == a  # 4 went
    assert pool.lookup(h(4)) is None
    assert pool.store(h(6)) == b  # then 2
    assert pool.store(h(7)) == c  # then 3
    assert pool.lookup(h(5)) == a and pool.lookup(h(6)) == b and pool.lookup(h(7)) == c
    pool.check_invariants()


def test_pins_are_counted_and_pinned_blocks_are_never_evicted() -> None:
    pool = HostBlockPool(2)
    a, b = pool.store(h(1)), pool.store(h(2))
    assert pool.pin(h(1)) == a and pool.pin(h(1)) == a  # two holders
    assert pool.pin_counts() == {h(1): 2}
    assert not pool.is_evictable(h(1)) and pool.num_evictable_blocks == 1
    assert pool.block_states().tolist() == [HOST_HELD, HOST_CACHED]
    assert pool.lookup(h(1)) == a  # pinned blocks are still found
    assert pool.store(h(1)) is None  # and not stored twice
    assert pool.store(h(3)) == b  # the only evictable block goes, never the pinned one
    assert pool.store(h(4)) == b  # 3 goes again
    pool.unpin(h(1))
    assert pool.pin_counts() == {h(1): 1} and not pool.is_evictable(h(1))
    pool.check_invariants()
    pool.unpin(h(1))  # the last pin: evictable again, as the most recently used
    assert pool.pin_counts() == {} and pool.is_evictable(h(1))
    assert pool.block_states().tolist() == [HOST_CACHED, HOST_CACHED]
    assert pool.store(h(5)) == b  # 4 was used before 1 was unpinned
    assert pool.store(h(6)) == a
    with pytest.raises(KeyError):
        pool.pin(h(404))
    pool.check_invariants()


def test_store_returns_none_when_every_block_is_held() -> None:
    pool = HostBlockPool(3)
    pool.store(h(1))
    pool.pin(h(1))
    owned = [pool.take_owned(), pool.take_owned()]
    assert sorted(owned) == [1, 2] and pool.owned_blocks() == [1, 2]
    assert pool.store(h(2)) is None and pool.take_owned() is None
    assert pool.num_storable() == 0 and pool.num_used_blocks == 3
    assert pool.block_states().tolist() == [HOST_HELD] * 3
    pool.free_owned(owned[0])
    assert pool.owned_blocks() == [owned[1]] and pool.num_free_blocks == 1
    assert pool.block_states()[owned[0]] == HOST_FREE
    assert pool.store(h(2)) == owned[0]
    with pytest.raises(KeyError):
        pool.free_owned(owned[0])  # not owned any more
    pool.check_invariants()


def test_num_storable_counts_free_and_evictable_blocks() -> None:
    pool = HostBlockPool(5)
    assert pool.num_storable() == 5
    pool.store(h(1))
    pool.store(h(2))
    pool.store(h(3))
    pool.pin(h(3))
    pool.take_owned()
    # 1 free, 2 evictable (1 and 2), 1 pinned, 1 owned.
    assert pool.num_storable() == 3
    assert pool.num_storable(hashes_to_pin=2) == 1  # pinning 1 and 2 leaves only the free block
    pool.check_invariants()


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: p._free.append(p._free[0]), "free twice"),
    (lambda p: p._states.__setitem__(0, HOST_FREE), "state"),
    (lambda p: p._pins.__setitem__(p._pinned[h(2)], 0), "pin counts"),
    (lambda p: p._owned.add(0), "lost or counted twice"),
    (lambda p: p._free.pop(), "lost"),
    (lambda p: p._lru.__setitem__(h(3), 0), "two hashes"),
])
def test_host_pool_check_invariants_detects_corruption(corrupt, message) -> None:
    pool = HostBlockPool(4)
    pool.store(h(1))
    pool.store(h(2))
    pool.pin(h(2))
    pool.take_owned()
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_invariants()


# ---------------------------------------------------------------------------- the manager's two tiers

BS = 4


def full_hashes(tokens: list[int], num_blocks: int) -> list[bytes]:
    hashes, parent = [], None
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS])
        hashes.append(parent)
    return hashes


def state_of(mgr: KVCacheManager, request_ids: list[str]) -> tuple:
    """Everything a refused call must leave alone."""
    return (
        mgr.get_stats(),
        mgr.pool.block_states().tobytes(),
        {rid: (mgr.get_block_ids(rid), mgr.is_swapped(rid)) for rid in request_ids},
        mgr.host.block_states().tobytes(),
        mgr.host.pin_counts(),
        mgr.host.owned_blocks(),
    )


def test_host_tier_needs_prefix_caching() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False, num_host_blocks=4)
    assert KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False).host is None
    assert KVCacheManager(num_blocks=8, block_size=BS).get_stats().host is None


def test_evicted_block_is_saved_and_a_later_lookup_loads_it_back() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4)  # 3 device blocks
    a = [1] * 8 + [2]  # two full blocks and one token
    assert mgr.allocate_slots("a", a, 0, 9) == [1, 2, 3]
    assert mgr.take_transfers() == ([], [])
    mgr.free("a")  # free queue: 3 (no hash), 2, 1
    b = [7] * 12
    assert mgr.allocate_slots("b", b, 0, 12) == [3, 2, 1]  # evicts a's cached blocks: saved first
    loads, saves = mgr.take_transfers()
    assert loads == [] and saves == [(2, 0), (1, 1)]
    hashes = full_hashes(a, 2)
    assert [mgr.host.lookup(x) for x in hashes] == [1, 0]
    host = mgr.get_stats().host
    assert (host.num_blocks_saved, host.num_blocks_loaded, host.num_used_blocks) == (2, 0, 2)
    mgr.check_invariants()

    mgr.free("b")
    c = a[:8] + [5]
    hit = mgr.find_prefix("c", c)
    assert hit.device_blocks == [] and hit.host_blocks == [1, 0] and hit.host_hashes == hashes
    assert (hit.num_tokens, hit.num_device_tokens, hit.swapped) == (8, 0, False)
    new_ids = mgr.allocate_slots("c", c, 8, 1, prefix=hit)
    mgr.record_prefix_hit(len(c), hit)
    assert new_ids == [1, 2, 3]  # b's cached blocks are evicted (and saved) to make room
    loads, saves = mgr.take_transfers()
    assert loads == [(1, 1), (0, 2)]  # the host blocks into the first new blocks, in order
    # b's first block went to the host's last free block, then lost it again to b's third (the least recently
    # used one then): one copy into it is made, the last.
    assert [d for d, _ in saves] == [2, 3] and len({h for _, h in saves}) == 2
    assert {x: mgr.host.pin_counts().get(x, 0) for x in hashes} == {x: 0 for x in hashes}  # released when taken
    stats = mgr.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9, 0)
    assert (stats.host.external_prefix_cache_queries, stats.host.external_prefix_cache_hits) == (9, 8)
    assert (stats.host.num_blocks_saved, stats.host.num_blocks_loaded) == (4, 2)
    # c's loaded blocks are cached on the device again under a's hashes.
    assert [mgr.pool.blocks[i].block_hash for i in mgr.get_block_ids("c")[:2]] == hashes
    mgr.check_invariants()


def test_lookup_goes_on_in_the_host_tier_after_device_hits() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=BS, num_host_blocks=4)  # 4 device blocks
    a = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    mgr.allocate_slots("a", a, 0, len(a))  # blocks 1..4
    mgr.free("a")  # queue: 4, 3, 2, 1: a's head block stays longest
    mgr.allocate_slots("x", [9, 9], 0, 2)  # takes block 4 (no hash)
    mgr.allocate_slots("y", [8, 8], 0, 2)  # evicts block 3 (a's third block)
    mgr.allocate_slots("z", [7, 7], 0, 2)  # evicts block 2 (a's second block)
    assert [d for d, _ in mgr.take_transfers()[1]] == [3, 2]
    hit = mgr.find_prefix("b", a)
    assert [blk.block_id for blk in hit.device_blocks] == [1]
    assert hit.host_hashes == full_hashes(a, 3)[1:] and len(hit.host_blocks) == 2
    assert (hit.num_tokens, hit.num_device_tokens) == (12, 4)
    assert mgr.allocate_slots("b", a, 12, 1, prefix=hit) is None  # needs 3 new blocks, 0 free
    assert mgr.host.pin_counts() == {}  # a refused allocation holds nothing
    mgr.free("x")
    mgr.free("y")
    mgr.free("z")
    assert len(mgr.allocate_slots("b", a, 12, 1, prefix=hit)) == 3
    mgr.record_prefix_hit(len(a), hit)
    loads, _ = mgr.take_transfers()
    assert [hb for hb, _ in loads] == hit.host_blocks
    assert [d for _, d in loads] == mgr.get_block_ids("b")[1:3]
    stats = mgr.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13, 4)
    assert (stats.host.external_prefix_cache_queries, stats.host.external_prefix_cache_hits) == (9, 8)
    mgr.check_invariants()


def test_host_lookup_never_covers_the_last_token() -> None:
    mgr = KVCacheManager(num_blocks=3, block_size=BS, num_host_blocks=4)  # 2 device blocks
    a = [1] * 8
    mgr.allocate_slots("a", a, 0, 8)
    mgr.free("a")
    mgr.allocate_slots("x", [9] * 8, 0, 8)  # evicts both of a's blocks into the host tier
    mgr.take_transfers()
    mgr.free("x")
    hit = mgr.find_prefix("b", a)  # all 8 tokens are in the host tier, but the last must be computed
    assert (hit.num_tokens, len(hit.host_blocks)) == (4, 1)


@pytest.mark.parametrize("evict_device_copies", [False, True])
def test_swap_out_and_resume_gives_exactly_the_swapped_tokens(evict_device_copies: bool) -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=BS, num_host_blocks=4)  # 4 device blocks
    tokens = list(range(10))  # two full blocks and a third holding 2 tokens
    assert mgr.allocate_slots("a", tokens, 0, 10) == [1, 2, 3]
    mgr.take_transfers()
    assert mgr.swap_out("a", tokens, 10)
    assert mgr.is_swapped("a") and mgr.get_block_ids("a") == [] and mgr.num_requests == 0
    loads, saves = mgr.take_transfers()
    assert loads == [] and [d for d, _ in saves] == [1, 2, 3]
    hashes = full_hashes(tokens, 2)
    assert mgr.host.pin_counts() == {hashes[0]: 1, hashes[1]: 1}  # full blocks: pinned, by hash
    assert mgr.host.owned_blocks() == [saves[2][1]]  # the partly filled block: owned
    host = mgr.get_stats().host
    assert (host.num_swapped_requests, host.num_swapped_out_blocks, host.num_blocks_saved) == (1, 3, 3)
    mgr.check_invariants()

    if evict_device_copies:  # the device pool's cached copies of a's full blocks are reused meanwhile
        mgr.allocate_slots("x", [9] * 16, 0, 16)
        assert mgr.take_transfers() == ([], [])  # pinned in the host tier already: nothing to save
        mgr.free("x")
    tokens.append(10)  # the token sampled before the swap: it resumes once that is known
    hit = mgr.find_prefix("a", tokens)
    assert hit.swapped and hit.num_tokens == 10
    num_on_device = 0 if evict_device_copies else 2
    assert len(hit.device_blocks) == num_on_device and hit.num_device_tokens == 4 * num_on_device
    assert hit.host_blocks == [hb for _, hb in saves][num_on_device:]
    assert hit.host_hashes == [*hashes, None][num_on_device:]
    new_ids = mgr.allocate_slots("a", tokens, hit.num_tokens, 1, prefix=hit)
    mgr.record_prefix_hit(len(tokens), hit)  # a swapped request's own KV: not a lookup, not counted
    assert len(new_ids) == 3 - num_on_device
    assert not mgr.is_swapped("a") and len(mgr.get_block_ids("a")) == 3
    loads, saves = mgr.take_transfers()
    assert loads == list(zip(hit.host_blocks, new_ids))
    assert saves == [] or evict_device_copies  # (x's cached blocks are evicted now, and saved)
    stats = mgr.get_stats()
    assert stats.prefix_cache_queries == 0 and stats.host.external_prefix_cache_queries == 0
    assert (stats.host.num_swapped_requests, stats.host.num_swapped_in_blocks) == (0, 3)
    assert stats.host.num_blocks_loaded == 3 - num_on_device
    assert mgr.host.pin_counts() == {} and mgr.host.owned_blocks() == []  # all released once the copies are taken
    assert all(mgr.host.lookup(x) is not None for x in hashes)  # and still cached there
    mgr.check_invariants()


def test_swap_out_of_fewer_tokens_than_allocated() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=4)
    tokens = list(range(9))
    mgr.allocate_slots("a", tokens, 0, 9)
    assert mgr.swap_out("a", tokens, 5)  # e.g. 4 tokens in flight: only the computed ones are kept
    _, saves = mgr.take_transfers()
    assert len(saves) == 2 and len(mgr.host.owned_blocks()) == 1
    hit = mgr.find_prefix("a", tokens)
    assert hit.swapped and hit.num_tokens == 5
    assert mgr.allocate_slots("a", tokens, 5, 4, prefix=hit) is not None
    assert len(mgr.get_block_ids("a")) == 3
    mgr.take_transfers()
    mgr.check_invariants()


def test_swap_out_refused_when_the_host_tier_cannot_hold_it() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=2)
    tokens = list(range(10))  # 3 blocks
    mgr.allocate_slots("a", tokens, 0, 10)
    mgr.take_transfers()
    before = state_of(mgr, ["a"])
    assert not mgr.swap_out("a", tokens, 10)
    assert state_of(mgr, ["a"]) == before and mgr.take_transfers() == ([], [])
    assert not mgr.swap_out("a", tokens, 0)  # nothing to keep
    assert not mgr.swap_out("a", tokens, 11)  # more than it holds
    assert not mgr.swap_out("nobody", tokens, 4)
    assert state_of(mgr, ["a"]) == before
    # Blocks held by another swapped-out request do not count as room; cached ones do.
    mgr2 = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=3)
    mgr2.allocate_slots("a", [1] * 6, 0, 6)
    mgr2.allocate_slots("b", [2] * 6, 0, 6)
    assert mgr2.swap_out("a", [1] * 6, 6)  # 2 of 3 host blocks held
    before = state_of(mgr2, ["a", "b"])
    assert not mgr2.swap_out("b", [2] * 6, 6)
    assert state_of(mgr2, ["a", "b"]) == before
    assert mgr2.swap_out("b", [2] * 6, 4)  # one block fits
    mgr2.check_invariants()


def test_swap_out_shares_host_blocks_by_hash() -> None:
    """Two requests with the same full blocks swapped out hold the same host blocks (two pins), copied once."""
    mgr = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=4)
    a = [1] * 4 + [2]
    b = [1] * 4 + [3, 3]
    mgr.allocate_slots("a", a, 0, 5)
    hit = mgr.find_prefix("b", b)
    mgr.allocate_slots("b", b, 4, 2, prefix=hit)
    assert mgr.swap_out("a", a, 5) and mgr.swap_out("b", b, 6)
    _, saves = mgr.take_transfers()
    assert len(saves) == 3  # the shared block once, each request's own partial block
    assert mgr.host.pin_counts() == {full_hashes(a, 1)[0]: 2}
    assert mgr.get_stats().host.num_swapped_out_blocks == 4
    mgr.free("a")
    assert mgr.host.pin_counts() == {full_hashes(a, 1)[0]: 1} and len(mgr.host.owned_blocks()) == 1
    mgr.check_invariants()


def test_free_releases_a_swapped_out_requests_host_blocks() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=4)
    tokens = list(range(10))
    mgr.allocate_slots("a", tokens, 0, 10)
    assert mgr.swap_out("a", tokens, 10)
    mgr.take_transfers()
    assert mgr.host.block_states().tolist().count(HOST_HELD) == 3
    mgr.free("a")
    assert not mgr.is_swapped("a") and mgr.get_stats().host.num_swapped_requests == 0
    assert mgr.host.pin_counts() == {} and mgr.host.owned_blocks() == []
    # The full blocks stay cached in the host tier (evictable); the owned block is free again.
    assert mgr.host.block_states().tolist().count(HOST_CACHED) == 2 and mgr.host.num_free_blocks == 2
    hit = mgr.find_prefix("b", tokens)
    assert hit.num_tokens == 8 and not hit.swapped
    mgr.check_invariants()


# ---------------------------------------------------------------------------- regressions (found by the machine below)


def test_a_host_hit_is_pinned_before_its_allocation_evicts_into_the_host_tier() -> None:
    """allocate_slots pinned a host hit's blocks only after allocating its new device blocks; the cached blocks that
    allocation evicted were stored in the host tier first and could evict the very host blocks about to be loaded
    (a KeyError here, a load of another prefix's KV where the block was reused for it)."""
    mgr = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4)  # 3 device blocks
    a = [1] * 8 + [2]
    mgr.allocate_slots("a", a, 0, 9)
    mgr.free("a")
    b = [7] * 12
    mgr.allocate_slots("b", b, 0, 12)  # a's two full blocks go to host blocks 0 and 1
    mgr.take_transfers()
    mgr.free("b")
    c = a[:8] + [5]
    hit = mgr.find_prefix("c", c)
    assert hit.host_blocks == [1, 0]
    # Its 3 new blocks evict b's 3 cached blocks (tail first) into the host tier: two go to the free host blocks,
    # the third evicts the least recently used evictable one, which must be b's tail (stored a moment ago), not
    # one of a's (the oldest).
    assert mgr.allocate_slots("c", c, 8, 1, prefix=hit) == [1, 2, 3]
    assert [mgr.host.lookup(x) for x in full_hashes(a, 2)] == [1, 0]
    assert [mgr.host.lookup(x) is not None for x in full_hashes(b, 3)] == [True, True, False]
    loads, _ = mgr.take_transfers()
    assert loads == [(1, 1), (0, 2)]
    mgr.check_invariants()


def test_no_host_hit_on_a_block_whose_save_is_not_made_yet() -> None:
    """A block evicted in a step is saved to a host block with the step's copies; a lookup in the same step found
    it there and planned a load from it, but the runner reads the loads' host blocks before it writes the saves':
    the load got the host block's old contents."""
    mgr = KVCacheManager(num_blocks=6, block_size=BS, num_host_blocks=4)  # 5 device blocks
    a = [1] * 4
    mgr.allocate_slots("a", a, 0, 4)
    mgr.allocate_slots("f", [9] * 16, 0, 16)
    mgr.free("a")
    mgr.free("f")  # free queue: a's block first
    # One step: b's allocation evicts a's block (saved to host block 0), then c looks a's prefix up.
    mgr.allocate_slots("b", [8, 8, 8], 0, 3)
    c = a + [3]
    assert mgr.host.lookup(full_hashes(a, 1)[0]) == 0
    hit = mgr.find_prefix("c", c)
    assert hit.num_tokens == 0 and hit.host_blocks == []
    assert mgr.take_transfers() == ([], [(1, 0)])
    # Once the copies are made, the block is a hit like any other.
    hit = mgr.find_prefix("c", c)
    assert hit.host_blocks == [0] and hit.num_tokens == 4
    assert mgr.allocate_slots("c", c, 4, 1, prefix=hit) is not None
    loads, _ = mgr.take_transfers()
    assert loads == [(0, mgr.get_block_ids("c")[0])]
    mgr.check_invariants()


def test_a_request_resumed_before_its_swap_copies_are_made_is_recomputed() -> None:
    """A request swapped out and resumed in one batch of copies (the same step, or after a step that scheduled
    nothing and left its copies to the next) loaded host blocks not written yet. Now it lets its host blocks go and
    is looked up like any request: what the device still caches is shared, the rest recomputed."""
    mgr = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=4)
    tokens = list(range(6))  # one full block and two tokens
    mgr.allocate_slots("a", tokens, 0, 6)
    mgr.take_transfers()
    assert mgr.swap_out("a", tokens, 5)  # saves planned, not taken
    hit = mgr.find_prefix("a", tokens)
    assert not hit.swapped and mgr.is_swapped("a")  # a lookup takes nothing
    assert hit.num_tokens == 4 and len(hit.device_blocks) == 1 and hit.host_blocks == []
    mgr.check_invariants()
    assert len(mgr.allocate_slots("a", tokens, 4, 2, prefix=hit)) == 1  # taking it lets the swapped KV go
    assert not mgr.is_swapped("a") and mgr.get_stats().host.num_swapped_requests == 0
    assert mgr.host.pin_counts() == {} and mgr.host.owned_blocks() == []
    loads, saves = mgr.take_transfers()
    assert loads == [] and len(saves) == 2  # the swap's copies, harmless: nothing reads the owned block now
    mgr.check_invariants()
    # A swap whose copies were made comes back as swapped KV, as ever.
    assert mgr.swap_out("a", tokens, 5)
    mgr.take_transfers()
    hit = mgr.find_prefix("a", tokens)
    assert hit.swapped and hit.num_tokens == 5


def test_manager_check_invariants_detects_a_lost_pin() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=4)
    tokens = list(range(10))
    mgr.allocate_slots("a", tokens, 0, 10)
    mgr.swap_out("a", tokens, 10)
    mgr.check_invariants()
    mgr.host.unpin(full_hashes(tokens, 1)[0])  # a pin no holder dropped
    with pytest.raises(AssertionError, match="pins"):
        mgr.check_invariants()


# ---------------------------------------------------------------------------- state machine

SM_DEVICE_BLOCKS = 9  # 8 usable: small, so that blocks are evicted (and saved) all the time
SM_HOST_BLOCKS = 6
SM_VOCAB = 2  # tiny, so that prompts share prefixes often
SM_PREFIXES = [[], [0] * 8, [1, 0, 1, 0, 1]]
SM_MAX_REQUESTS = 5


def kv_of(tokens: list[int], pos: int) -> tuple[int, ...]:
    """What the KV of token ``pos`` "is": it depends on the token and everything before it."""
    return tuple(tokens[: pos + 1])


@dataclasses.dataclass
class SimRequest:
    tokens: list[int]
    state: str = "waiting"  # waiting | running | swapped
    num_computed: int = 0  # running: the tokens its table holds, all computed by the end of each step
    num_swapped: int = 0  # swapped: the tokens it swapped out


class HostTierMachine(RuleBasedStateMachine):
    """Scheduler-like steps against a manager with a host tier, and simulated KV contents of both tiers.

    A step is what the scheduler does: running requests grow, or are preempted (by swap or by recompute),
    then waiting requests are admitted (a prefix lookup, or a swapped-out request resumed); then the step's
    copies are taken once and made in the runner's order, and the forward pass writes the KV of every
    scheduled token. A step that schedules nothing leaves its copies to the next one, as the scheduler does.
    Between steps requests finish (or are aborted while swapped out). Invariant: every computed token of every
    request holding blocks reads back the KV its tokens say, and so does every block findable by hash.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(SM_DEVICE_BLOCKS, BS, num_host_blocks=SM_HOST_BLOCKS)
        self.dev: list[list] = [[None] * BS for _ in range(SM_DEVICE_BLOCKS)]
        self.host: list[list] = [[None] * BS for _ in range(SM_HOST_BLOCKS)]
        self.reqs: dict[str, SimRequest] = {}
        self.next_id = 0
        self.tokens_of_hash: dict[bytes, list[int]] = {}  # every chained hash seen: the tokens it covers
        self.copies_pending = False  # copies may have been planned since the last were made

    # ------------------------------------------------------------------ helpers

    def _ids(self, state: str) -> list[str]:
        return sorted(rid for rid, r in self.reqs.items() if r.state == state)

    def _learn_hashes(self, tokens: list[int]) -> None:
        for i, x in enumerate(full_hashes(tokens, len(tokens) // BS)):
            self.tokens_of_hash.setdefault(x, tokens[: (i + 1) * BS])

    def _block_kv(self, block_hash: bytes) -> list:
        tokens = self.tokens_of_hash[block_hash]
        return [kv_of(tokens, pos) for pos in range(len(tokens) - BS, len(tokens))]

    def _state(self) -> tuple:
        return state_of(self.mgr, list(self.reqs))

    def _admit(self, data: st.DataObject, rid: str, scheduled: dict[str, tuple[int, int]]) -> None:
        req, mgr = self.reqs[rid], self.mgr
        if req.state == "swapped" and req.num_swapped == len(req.tokens):
            # The token sampled before the swap: the scheduler resumes a request once that is known.
            req.tokens.append(data.draw(st.integers(0, SM_VOCAB - 1), label="sampled"))
            self._learn_hashes(req.tokens)
        hit = mgr.find_prefix(rid, req.tokens)
        n_dev, n_host = len(hit.device_blocks), len(hit.host_blocks)
        swapped = req.state == "swapped" and hit.swapped
        if req.state == "swapped" and not hit.swapped:
            # Resumed before its swap's copies were made (in the step that swapped it, or after a step that ran
            # nothing): its host blocks are not written yet, so it is found as any request is; taking that lookup
            # lets its swapped KV go.
            assert self.copies_pending and mgr.is_swapped(rid)
        if swapped:
            assert hit.swapped and hit.num_tokens == req.num_swapped
            assert n_dev + n_host == -(-req.num_swapped // BS)
            assert hit.num_device_tokens == min(n_dev * BS, req.num_swapped)
        else:
            assert not hit.swapped and hit.num_tokens < len(req.tokens)  # never the last token
            assert hit.num_tokens == (n_dev + n_host) * BS and hit.num_device_tokens == n_dev * BS
            expected = full_hashes(req.tokens, n_dev + n_host)
            assert [b.block_hash for b in hit.device_blocks] == expected[:n_dev]
            assert hit.host_hashes == expected[n_dev:]
        num_new = data.draw(st.integers(1, len(req.tokens) - hit.num_tokens), label="num_new")
        before = self._state()
        new_ids = mgr.allocate_slots(rid, req.tokens, hit.num_tokens, num_new, prefix=hit)
        if new_ids is None:
            assert self._state() == before, "a refused allocation changed state"
            return
        mgr.record_prefix_hit(len(req.tokens), hit)
        self.copies_pending = True
        assert not mgr.is_swapped(rid)
        after = mgr.get_stats().host
        assert after.num_blocks_loaded - before[0].host.num_blocks_loaded == n_host
        if swapped:
            assert after.num_swapped_in_blocks - before[0].host.num_swapped_in_blocks == n_dev + n_host
            assert after.external_prefix_cache_queries == before[0].host.external_prefix_cache_queries
        else:
            assert (after.external_prefix_cache_queries - before[0].host.external_prefix_cache_queries
                    == len(req.tokens) - hit.num_device_tokens)
            assert after.external_prefix_cache_hits - before[0].host.external_prefix_cache_hits == n_host * BS
        table = mgr.get_block_ids(rid)
        assert [b.block_id for b in hit.device_blocks] == table[:n_dev]
        assert table[len(table) - len(new_ids):] == new_ids and len(new_ids) >= n_host
        req.state, req.num_computed = "running", hit.num_tokens + num_new
        scheduled[rid] = (hit.num_tokens, req.num_computed)

    def _grow(self, data: st.DataObject, rid: str, scheduled: dict[str, tuple[int, int]]) -> None:
        req = self.reqs[rid]
        if req.num_computed == len(req.tokens):  # decode: sampled tokens (several: a few steps' worth)
            req.tokens += data.draw(st.lists(st.integers(0, SM_VOCAB - 1), min_size=1, max_size=3), label="sampled")
            self._learn_hashes(req.tokens)
        num_new = data.draw(st.integers(1, len(req.tokens) - req.num_computed), label="num_new")
        before = self._state()
        new_ids = self.mgr.allocate_slots(rid, req.tokens, req.num_computed, num_new)
        if new_ids is None:
            assert self._state() == before, "a refused allocation changed state"
            return
        scheduled[rid] = (req.num_computed, req.num_computed + num_new)
        req.num_computed += num_new
        self.copies_pending = True

    def _swap_out(self, data: st.DataObject, rid: str) -> None:
        req = self.reqs[rid]
        num_tokens = data.draw(st.integers(max(1, req.num_computed - BS), req.num_computed), label="num_swapped")
        before = self._state()
        if not self.mgr.swap_out(rid, req.tokens, num_tokens):
            assert self._state() == before, "a refused swap changed state"
            return
        assert self.mgr.is_swapped(rid) and self.mgr.get_block_ids(rid) == []
        req.state, req.num_computed, req.num_swapped = "swapped", 0, num_tokens
        self.copies_pending = True

    def _run_copies(self) -> None:
        """The runner's order: read the saves' device blocks, read the loads' host blocks, write the saves' host
        blocks, write the loads' device blocks."""
        loads, saves = self.mgr.take_transfers()
        self.copies_pending = False
        assert len({d for _, d in loads}) == len(loads), "two loads into one device block"
        saved = [list(self.dev[d]) for d, _ in saves]
        loaded = [list(self.host[hb]) for hb, _ in loads]
        for (_, hb), kv in zip(saves, saved):
            self.host[hb] = kv
        for (_, d), kv in zip(loads, loaded):
            self.dev[d] = kv

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.reqs) < SM_MAX_REQUESTS)
    @rule(prefix=st.sampled_from(SM_PREFIXES), suffix=st.lists(st.integers(0, SM_VOCAB - 1), min_size=1, max_size=10))
    def add_request(self, prefix: list[int], suffix: list[int]) -> None:
        tokens = prefix + suffix
        self.reqs[f"r{self.next_id}"] = SimRequest(tokens=tokens)
        self.next_id += 1
        self._learn_hashes(tokens)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        scheduled: dict[str, tuple[int, int]] = {}  # rid -> the token positions the forward pass computes
        # 1. Running requests: each grows, or is preempted (by swap, or freed for recompute), at most once.
        for rid in self._ids("running"):
            action = data.draw(st.sampled_from(["skip", "grow", "grow", "swap", "recompute"]), label=f"{rid}")
            if action == "grow":
                self._grow(data, rid, scheduled)
            elif action == "swap":
                self._swap_out(data, rid)
            elif action == "recompute":
                self.mgr.free(rid)
                self.reqs[rid].state, self.reqs[rid].num_computed = "waiting", 0
        # 2. Waiting and swapped-out requests are admitted (even one preempted just now, as the scheduler does
        # when it makes room for a parked beam group).
        candidates = [rid for rid in sorted(self.reqs) if self.reqs[rid].state != "running"]
        if candidates:
            for rid in data.draw(st.lists(st.sampled_from(candidates), unique=True, max_size=3), label="admit"):
                self._admit(data, rid, scheduled)
        # 3. The copies, once per step that runs something; then the forward pass writes the scheduled tokens.
        if not scheduled:
            return
        self._run_copies()
        for rid, (start, end) in scheduled.items():
            req, table = self.reqs[rid], self.mgr.get_block_ids(rid)
            for pos in range(start, end):
                self.dev[table[pos // BS]][pos % BS] = kv_of(req.tokens, pos)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Between steps: a request finishes, or is aborted (running, waiting or swapped out)."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)), label="rid")
        self.mgr.free(rid)
        del self.reqs[rid]
        assert not self.mgr.is_swapped(rid) and self.mgr.get_block_ids(rid) == []

    # ------------------------------------------------------------------ invariants

    @invariant()
    def books_agree(self) -> None:
        self.mgr.check_invariants()
        assert self.mgr.num_requests == len(self._ids("running"))
        assert self.mgr.get_stats().host.num_swapped_requests == len(self._ids("swapped"))
        for rid, req in self.reqs.items():
            assert self.mgr.is_swapped(rid) == (req.state == "swapped")
            table = self.mgr.get_block_ids(rid)
            assert len(table) == (-(-req.num_computed // BS) if req.state == "running" else 0)

    @invariant()
    def device_kv_is_what_the_tokens_say(self) -> None:
        for rid, req in self.reqs.items():
            table = self.mgr.get_block_ids(rid)
            for pos in range(req.num_computed):
                got = self.dev[table[pos // BS]][pos % BS]
                assert got == kv_of(req.tokens, pos), f"{rid} token {pos} in block {table[pos // BS]}: {got}"
        for block in self.mgr.pool.blocks:  # a block findable by hash holds that prefix's KV
            if block.block_hash is not None:
                assert self.dev[block.block_id] == self._block_kv(block.block_hash), f"device block {block.block_id}"

    @invariant()
    def host_kv_is_what_the_hashes_say(self) -> None:
        if self.copies_pending:  # a step that ran nothing left its copies (a swap's) to the next
            return
        for block_hash in self.tokens_of_hash:
            host_block = self.mgr.host.lookup(block_hash)
            if host_block is not None:
                assert self.host[host_block] == self._block_kv(block_hash), f"host block {host_block}"
        for rid in self._ids("swapped"):  # a swapped-out request's own blocks too (a lookup takes nothing)
            req = self.reqs[rid]
            hit = self.mgr.find_prefix(rid, req.tokens)
            for i, host_block in enumerate(hit.host_blocks, start=len(hit.device_blocks)):
                for slot in range(min(BS, req.num_swapped - i * BS)):
                    assert self.host[host_block][slot] == kv_of(req.tokens, i * BS + slot), f"{rid} host {host_block}"

    def teardown(self) -> None:
        for rid in list(self.reqs):
            self.mgr.free(rid)
        loads, _ = self.mgr.take_transfers()
        assert loads == []
        self.mgr.check_invariants()
        assert self.mgr.num_free_blocks == SM_DEVICE_BLOCKS - 1
        assert not np.any(self.mgr.pool.block_states()[1:] % 2 == 1), "a device block is still referenced"
        assert self.mgr.host.pin_counts() == {} and self.mgr.host.owned_blocks() == []
        assert not np.any(self.mgr.host.block_states() == HOST_HELD), "a host block is still held"


HostTierMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_host_tier_state_machine = HostTierMachine.TestCase


def test_a_request_swapped_out_with_every_tokens_kv_is_looked_up_as_usual() -> None:
    """A beam parked until its next token is chosen holds the KV of all its tokens; resumed before that token is
    known, it could compute nothing, so it lets go of its swap and is looked up like any request (the last token
    recomputed)."""
    mgr = KVCacheManager(num_blocks=6, block_size=BS, num_host_blocks=6)
    tokens = list(range(10))
    mgr.allocate_slots("a", tokens, 0, 10)
    mgr.take_transfers()
    assert mgr.swap_out("a", tokens, 10)
    mgr.allocate_slots("x", [50], 0, 1)  # a step runs: the swap's copies are made
    mgr.take_transfers()
    hit = mgr.find_prefix("a", tokens)
    assert not hit.swapped and hit.num_tokens == 8 and mgr.is_swapped("a")  # two full blocks, never the last
    assert mgr.allocate_slots("a", tokens, 8, 2, prefix=hit) is not None
    assert not mgr.is_swapped("a") and mgr.host.owned_blocks() == []
    mgr.take_transfers()
    assert mgr.host.pin_counts() == {}
    mgr.check_invariants()
