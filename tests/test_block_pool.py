"""Block pool: LRU eviction, the null block, reference counts, block states, and the hash."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvcache.block_pool import (
    STATE_CACHED_FREE,
    STATE_FREE,
    STATE_IN_USE,
    STATE_NULL,
    STATE_SHARED,
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
)


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------------------- hash


def test_hash_is_chained_and_deterministic() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4))
    assert h0 == hash_block_tokens(None, np.array([1, 2, 3, 4], dtype=np.int32))
    assert isinstance(h0, bytes) and len(h0) == 16
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    # Same tokens under a different parent must hash differently.
    assert h1 != hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert h1 != hash_block_tokens(None, [5, 6, 7, 8])


def test_hash_no_parent_differs_from_parent_bytes_as_tokens() -> None:
    # A root block whose token bytes happen to start like a parent digest must not collide.
    parent = hash_block_tokens(None, [7])
    as_tokens = list(np.frombuffer(parent, dtype="<i8")) + [3]
    assert hash_block_tokens(parent, [3]) != hash_block_tokens(None, as_tokens)


def test_hash_is_stable_across_processes() -> None:
    code = "from kvcache.block_pool import hash_block_tokens as h; print(h(h(None, [1, 2]), [3, 4]).hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4]).hex()


# ---------------------------------------------------------------------------- free queue


def test_free_queue_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert ids(list(q)) == [0, 1, 2, 3, 4] and q.num_free_blocks == 5
    q.remove(blocks[2])
    assert ids(list(q)) == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert ids(list(q)) == [1, 3, 4, 2, 0] and len(q) == 5
    assert ids(q.check_links()) == [1, 3, 4, 2, 0]
    with pytest.raises(ValueError):
        q.append(blocks[0])  # already queued
    for _ in range(5):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[1])


# ---------------------------------------------------------------------------- pool


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_total_blocks == 4 and pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert sorted(ids(blocks)) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # ignored: never freed
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.touch([pool.null_block])
    pool.check_invariants()


def test_initial_allocation_is_in_id_order() -> None:
    pool = BlockPool(6)
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]


def test_over_allocation_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    before = pool.block_states()
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2
    np.testing.assert_array_equal(pool.block_states(), before)
    pool.check_invariants()


def test_lru_eviction_order() -> None:
    pool = BlockPool(4)  # usable: 1, 2, 3
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([a])
    pool.free_blocks([b])
    # A was freed first, so it is reused first.
    assert pool.get_new_blocks(1) == [a]
    assert pool.get_new_blocks(1) == [b]
    pool.free_blocks([c, b])  # given order is the eviction order
    assert pool.get_new_blocks(2) == [c, b]
    pool.check_invariants()


def test_cached_free_block_is_evicted_and_loses_hash() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_block(a, h)
    pool.free_blocks([a])
    # Freed but still findable.
    assert pool.get_cached_block(h) is a and a.block_hash == h
    assert pool.num_cached_blocks == 1 and pool.num_free_blocks == 1
    (reused,) = pool.get_new_blocks(1)
    assert reused is a
    assert a.block_hash is None and pool.get_cached_block(h) is None
    assert pool.num_cached_blocks == 0
    pool.check_invariants()


def test_touching_a_cached_free_block_removes_it_from_the_queue() -> None:
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [1])
    pool.cache_full_block(a, h)
    pool.free_blocks([a, b])
    assert pool.num_free_blocks == 2
    pool.touch([pool.get_cached_block(h)])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    assert a not in list(pool.free_queue)
    # The next allocation takes b, not the touched a.
    assert pool.get_new_blocks(1) == [b]
    assert pool.get_cached_block(h) is a
    pool.check_invariants()


def test_ref_counts_with_sharing() -> None:
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, hash_block_tokens(None, [1]))
    pool.touch([a])
    pool.touch([a])
    assert a.ref_cnt == 3 and pool.num_used_blocks == 1
    pool.free_blocks([a])
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 0 and pool.num_free_blocks == 3
    with pytest.raises(ValueError):
        pool.free_blocks([a])  # double free
    pool.check_invariants()


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_block(a, h)
    pool.cache_full_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    # Evicting the uncached duplicate must not drop a's entry.
    pool.free_blocks([b])
    pool.get_new_blocks(2)
    assert pool.get_cached_block(h) is a
    pool.check_invariants()


def test_caching_disabled_is_a_no_op() -> None:
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_block(a, h)
    assert a.block_hash is None and pool.get_cached_block(h) is None and pool.num_cached_blocks == 0


def test_usage() -> None:
    pool = BlockPool(5)
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(3)
    assert pool.usage == pytest.approx(3 / 4)
    pool.free_blocks(blocks)
    assert pool.usage == 0.0


def test_block_states() -> None:
    pool = BlockPool(6)
    a, b, c, d = pool.get_new_blocks(4)  # 1, 2, 3, 4; block 5 stays free
    pool.cache_full_block(a, hash_block_tokens(None, [1]))
    pool.cache_full_block(c, hash_block_tokens(None, [2]))
    pool.touch([c])
    pool.free_blocks([a, d])
    states = pool.block_states()
    assert states.dtype == np.int8 and states.shape == (6,)
    assert list(states) == [STATE_NULL, STATE_CACHED_FREE, STATE_IN_USE, STATE_SHARED, STATE_FREE, STATE_FREE]
    # Evicting a drops it to plain in-use.
    pool.get_new_blocks(3)
    assert pool.block_states()[1] == STATE_IN_USE
    # A copy: mutating it does not change the pool.
    states[:] = 0
    assert pool.block_states()[0] == STATE_NULL
    pool.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.check_invariants()
    a.ref_cnt = 0  # in use by the queue's account, but ref 0
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_invariants()
    a.ref_cnt = 1
    a.block_hash = b"x" * 16  # a hash that is not in the map
    with pytest.raises(AssertionError, match="hash"):
        pool.check_invariants()


def test_pool_needs_two_blocks() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)
