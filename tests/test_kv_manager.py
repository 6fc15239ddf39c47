"""KV cache manager: prefix hits, counters, all-or-nothing allocation, eviction order,
fragmentation, and a randomized state machine that checks invariants after every step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.block_pool import hash_block_tokens
from kvcache.manager import KVCacheManager
from kvcache.metrics import KVCacheStats


def snapshot(mgr: KVCacheManager, request_ids: list[str]) -> tuple:
    return (
        mgr.get_stats(),
        mgr.pool.block_states().tobytes(),
        {rid: mgr.get_block_ids(rid) for rid in request_ids},
        mgr.num_requests,
    )


# ---------------------------------------------------------------------------- prefix caching


def test_prefix_hit_on_shared_prompt_never_whole_prompt() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=16)
    prefix = list(range(100, 140))  # 40 tokens: 2 full blocks + 8
    a = prefix + [1] * 8  # 48 tokens = exactly 3 blocks
    b = prefix + [1] * 8  # identical prompt

    blocks, n = mgr.get_computed_blocks("a", a)
    assert (blocks, n) == ([], 0)
    assert mgr.allocate_slots("a", a, 0, len(a)) is not None
    mgr.check_invariants()

    blocks, n = mgr.get_computed_blocks("b", b)
    # All 3 blocks of b are cached, but the last token must be computed: 2 blocks.
    assert n == 32 and len(blocks) == 2
    assert [blk.block_id for blk in blocks] == mgr.get_block_ids("a")[:2]
    new_ids = mgr.allocate_slots("b", b, n, len(b) - n, blocks)
    assert new_ids is not None and len(new_ids) == 1
    assert mgr.get_block_ids("b")[:2] == mgr.get_block_ids("a")[:2]
    assert mgr.get_block_ids("b")[2] != mgr.get_block_ids("a")[2]
    assert [mgr.pool.blocks[i].ref_cnt for i in mgr.get_block_ids("b")] == [2, 2, 1]
    mgr.check_invariants()

    stats = mgr.get_stats()
    assert stats.prefix_cache_queries == 96 and stats.prefix_cache_hits == 32
    assert stats.prefix_cache_hit_rate == pytest.approx(32 / 96)


def test_prefix_hit_stops_at_first_difference() -> None:
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    mgr.allocate_slots("a", a, 0, len(a))
    b = [1, 2, 3, 4, 5, 6, 0, 8, 9, 10, 11, 12, 13]  # differs in block 1
    blocks, n = mgr.get_computed_blocks("b", b)
    assert n == 4 and [blk.block_id for blk in blocks] == mgr.get_block_ids("a")[:1]
    # Same tokens as a's block 2 but after a different prefix: the chained hash misses.
    c = [0, 0, 0, 0, 5, 6, 7, 8, 9]
    assert mgr.get_computed_blocks("c", c) == ([], 0)


def test_block_cached_under_another_prefix_is_not_a_hit() -> None:
    # A block's KV depends on everything before it, so equal tokens after a different
    # prefix must not match: the hash is chained.
    mgr = KVCacheManager(num_blocks=20, block_size=4)
    block_a, block_b, block_c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    mgr.allocate_slots("x", block_a + [9], 0, 5)  # caches A
    mgr.allocate_slots("y", block_c + block_b + [9], 0, 9)  # caches C, then B after C
    blocks, n = mgr.get_computed_blocks("z", block_a + block_b + [9])
    assert n == 4 and [b.block_id for b in blocks] == mgr.get_block_ids("x")[:1]


def test_freed_blocks_stay_cached_and_hit_touches_them() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    prompt = list(range(9))  # 2 full blocks + 1 token
    mgr.allocate_slots("a", prompt, 0, 9)
    a_ids = mgr.get_block_ids("a")
    mgr.free("a")
    assert mgr.num_free_blocks == 5 and mgr.get_stats().num_cached_blocks == 2

    blocks, n = mgr.get_computed_blocks("b", prompt)
    assert n == 8 and [blk.block_id for blk in blocks] == a_ids[:2]
    # 5 free blocks, 2 of them are the hits: only 3 remain for new allocation.
    too_many = list(range(8)) + list(range(100, 100 + 4 * 4))  # 24 tokens = 6 blocks
    assert mgr.allocate_slots("b", too_many, 8, 16, blocks) is None
    assert mgr.num_requests == 0 and mgr.num_free_blocks == 5
    ok = prompt + [50] * 11  # 20 tokens = 5 blocks: 2 hits + 3 new
    assert mgr.allocate_slots("b", ok, 8, 12, blocks) is not None
    assert mgr.num_free_blocks == 0
    mgr.check_invariants()


def test_counters_not_updated_when_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    prompt = list(range(12))
    mgr.allocate_slots("a", prompt, 0, 12)
    assert mgr.get_computed_blocks("b", prompt) == ([], 0)
    stats = mgr.get_stats()
    assert stats.prefix_cache_queries == 0 and stats.num_cached_blocks == 0
    mgr.check_invariants()


def test_decode_caches_blocks_as_they_fill() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    tokens = [1, 2, 3]
    mgr.allocate_slots("a", tokens, 0, 3)
    assert mgr.get_stats().num_cached_blocks == 0
    tokens.append(4)
    assert mgr.allocate_slots("a", tokens, 3, 1) == []  # fills block 0, no new block
    assert mgr.get_stats().num_cached_blocks == 1
    tokens.append(5)
    assert len(mgr.allocate_slots("a", tokens, 4, 1)) == 1
    first = mgr.pool.blocks[mgr.get_block_ids("a")[0]]
    assert first.block_hash == hash_block_tokens(None, [1, 2, 3, 4])
    mgr.check_invariants()


# ---------------------------------------------------------------------------- allocation


def test_allocate_returns_none_and_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks
    mgr.allocate_slots("a", list(range(10)), 0, 10)  # 3 blocks
    before = snapshot(mgr, ["a", "b"])
    assert mgr.allocate_slots("b", list(range(50, 58)), 0, 8) is None  # needs 2, 1 free
    tokens = list(range(10)) + [7] * 8
    assert mgr.allocate_slots("a", tokens, 10, 8) is None  # needs 2 more
    assert snapshot(mgr, ["a", "b"]) == before
    mgr.check_invariants()


def test_allocate_returns_new_block_ids_in_order() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    assert mgr.allocate_slots("a", list(range(10)), 0, 10) == [1, 2, 3]
    assert mgr.get_block_ids("a") == [1, 2, 3]
    assert mgr.allocate_slots("a", list(range(13)), 10, 3) == [4]
    assert mgr.get_block_ids("a") == [1, 2, 3, 4]
    assert mgr.get_block_ids("unknown") == []


def test_allocate_rejects_bad_arguments() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    with pytest.raises(ValueError):
        mgr.allocate_slots("a", [1, 2], 0, 4)  # two more tokens than known
    prompt = list(range(9))
    mgr.allocate_slots("a", prompt, 0, 9)
    blocks, n = mgr.get_computed_blocks("b", prompt)
    with pytest.raises(ValueError):
        mgr.allocate_slots("a", prompt + [1], 9, 1, blocks)  # hit blocks after the first allocation
    with pytest.raises(ValueError):
        mgr.allocate_slots("b", prompt, 0, 9, blocks)  # hit blocks not counted as computed


def test_a_block_ending_in_an_unknown_token_is_cached_once_the_token_is_known() -> None:
    """Slots for the token a step in flight is sampling: allocated now, hashed when it arrives."""
    mgr = KVCacheManager(num_blocks=10, block_size=4)
    known = [5, 6, 7]
    assert mgr.allocate_slots("a", known, 0, 4) == [1]  # 3 known tokens + 1 being sampled
    assert mgr.pool.num_cached_blocks == 0  # its 4th token is unknown: not cached yet
    mgr.check_invariants()
    assert mgr.allocate_slots("a", known + [8], 4, 1) == [2]  # the token arrived; the next one is in flight
    assert mgr.pool.num_cached_blocks == 1
    blocks, num_cached = mgr.get_computed_blocks("b", [5, 6, 7, 8, 9])
    assert num_cached == 4 and [b.block_id for b in blocks] == [1]
    mgr.check_invariants()


def test_free_in_reverse_order_evicts_tail_first() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=4)
    prompt = list(range(12))
    mgr.allocate_slots("a", prompt, 0, 12)
    ids = mgr.get_block_ids("a")
    mgr.free("a")
    assert mgr.num_requests == 0
    assert [b.block_id for b in mgr.pool.free_queue] == [4] + ids[::-1]
    # The never-used block goes first, then a's tail; the head block stays cached longest.
    assert mgr.allocate_slots("x", [99] * 8, 0, 8) == [4, ids[2]]
    blocks, n = mgr.get_computed_blocks("y", prompt)
    assert n == 8 and [b.block_id for b in blocks] == ids[:2]
    mgr.free("never-seen")  # no-op
    mgr.check_invariants()


# ---------------------------------------------------------------------------- stats


def test_fragmentation_single_request() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=16)
    assert mgr.get_stats().fragmentation == 0.0
    mgr.allocate_slots("a", list(range(20)), 0, 20)  # 2 blocks, 12 slots wasted
    stats = mgr.get_stats()
    assert stats.num_used_blocks == 2
    assert stats.fragmentation == pytest.approx(12 / 32)
    assert stats.usage == pytest.approx(2 / 9)


def test_fragmentation_counts_shared_blocks_once() -> None:
    mgr = KVCacheManager(num_blocks=10, block_size=16)
    prompt = list(range(40))  # 3 blocks: 16, 16, 8
    mgr.allocate_slots("a", prompt, 0, 40)
    blocks, n = mgr.get_computed_blocks("b", prompt)
    assert n == 32
    mgr.allocate_slots("b", prompt, n, 8, blocks)  # shares 2 blocks, own last block with 8
    stats = mgr.get_stats()
    # 4 blocks in use = 64 slots; used: 32 shared + 8 + 8 = 48.
    assert stats.num_used_blocks == 4
    assert stats.fragmentation == pytest.approx(16 / 64)
    mgr.free("a")
    mgr.free("b")
    assert mgr.get_stats().fragmentation == 0.0


def test_stats_is_a_frozen_snapshot() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    stats = mgr.get_stats()
    assert isinstance(stats, KVCacheStats)
    assert (stats.num_total_blocks, stats.num_free_blocks, stats.block_size) == (3, 3, 4)
    assert stats.prefix_cache_hit_rate == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.usage = 1.0  # type: ignore[misc]


def test_check_invariants_detects_a_leaked_reference() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=4)
    mgr.allocate_slots("a", list(range(5)), 0, 5)
    mgr.check_invariants()
    mgr.pool.touch([mgr.pool.blocks[mgr.get_block_ids("a")[0]]])  # a reference no table holds
    with pytest.raises(AssertionError, match="ref_cnt"):
        mgr.check_invariants()


def test_rejected_proposals_give_their_blocks_back_to_be_taken_first() -> None:
    """A step verifying 5 proposals of which none is accepted: the block only the proposals reached goes back, to
    the front of the free queue, so the next allocation takes it rather than evicting a cached prefix."""
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    assert mgr.allocate_slots("old", [9, 9, 9, 9, 9], 0, 5) is not None
    mgr.free("old")  # its first block stays cached, free
    tokens = list(range(6))
    assert len(mgr.allocate_slots("r", tokens, 0, 6)) == 2
    tokens.append(6)  # the token sampled after the prompt, then 5 proposals after it
    tail = mgr.allocate_slots("r", tokens, 6, 6, num_lookahead_tokens=5)
    assert len(tail) == 1 and len(mgr.get_block_ids("r")) == 3
    free_before = mgr.num_free_blocks
    assert mgr.trim("r", 7) == 1  # none accepted: 7 tokens computed, the 8th sampled
    assert mgr.num_free_blocks == free_before + 1 and len(mgr.get_block_ids("r")) == 2
    mgr.check_invariants()
    assert mgr.trim("r", 7) == 0
    assert mgr.allocate_slots("new", [5] * 4, 0, 4) == tail
    assert mgr.get_computed_blocks("x", [9, 9, 9, 9, 9], record=False)[1] == 4  # the cached prefix is still there
    with pytest.raises(ValueError, match="cached block"):
        mgr.trim("r", 3)  # the first block is full and cached: its 4th token cannot go
    mgr.check_invariants()


# ---------------------------------------------------------------------------- state machine

BLOCK_SIZE = 4
NUM_BLOCKS = 12  # small, so that allocations fail and cached blocks get evicted
VOCAB = 3  # tiny, so that random prompts share prefixes often
SHARED_PREFIXES = [[0] * 8, [1, 2] * 5]
MAX_LIVE_REQUESTS = 6


def expected_hashes(tokens: list[int], num_blocks: int) -> list[bytes]:
    """Oracle: chained hashes computed straight from the request's tokens."""
    hashes, parent = [], None
    for i in range(num_blocks):
        parent = hash_block_tokens(parent, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        hashes.append(parent)
    return hashes


@dataclasses.dataclass
class Req:
    tokens: list[int]
    num_computed: int = 0  # tokens the table holds (allocated for)
    running: bool = False


class KVManagerMachine(RuleBasedStateMachine):
    """Random request lifecycles against one manager, with an oracle for hashes."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        self.reqs: dict[str, Req] = {}
        self.next_id = 0

    def _running(self) -> list[str]:
        return [rid for rid, r in self.reqs.items() if r.running]

    def _waiting(self) -> list[str]:
        return [rid for rid, r in self.reqs.items() if not r.running]

    def _decodable(self) -> list[str]:
        return [rid for rid, r in self.reqs.items() if r.running and r.num_computed == len(r.tokens)]

    @precondition(lambda self: len(self.reqs) < MAX_LIVE_REQUESTS)
    @rule(
        prefix=st.sampled_from([[]] + SHARED_PREFIXES),
        suffix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
    )
    def add_request(self, prefix: list[int], suffix: list[int]) -> None:
        self.reqs[f"r{self.next_id}"] = Req(tokens=prefix + suffix)
        self.next_id += 1

    @precondition(lambda self: self._waiting())
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Prefix lookup, then the first allocation (whole prompt or its first chunk)."""
        rid = data.draw(st.sampled_from(self._waiting()), label="rid")
        req = self.reqs[rid]
        blocks, num_cached = self.mgr.get_computed_blocks(rid, req.tokens)
        assert num_cached == len(blocks) * BLOCK_SIZE and num_cached < len(req.tokens)
        # A hit is only valid if the cached block holds exactly this prefix.
        assert [b.block_hash for b in blocks] == expected_hashes(req.tokens, len(blocks))
        num_new = data.draw(st.integers(1, len(req.tokens) - num_cached), label="num_new")
        self._allocate(rid, req, num_cached, num_new, blocks)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """Chunked prefill if tokens remain, else decode one freshly sampled token."""
        rid = data.draw(st.sampled_from(self._running()), label="rid")
        req = self.reqs[rid]
        if req.num_computed == len(req.tokens):
            req.tokens.append(data.draw(st.integers(0, VOCAB - 1), label="sampled"))
        num_new = data.draw(st.integers(1, len(req.tokens) - req.num_computed), label="num_new")
        self._allocate(rid, req, req.num_computed, num_new, None)

    @precondition(lambda self: self._decodable())
    @rule(data=st.data(), sampled=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
    def decode_steps(self, data: st.DataObject, sampled: list[int]) -> None:
        """Several decode steps in a row, one token each, until one fails to allocate."""
        rid = data.draw(st.sampled_from(self._decodable()), label="rid")
        req = self.reqs[rid]
        for token in sampled:
            req.tokens.append(token)
            if not self._allocate(rid, req, req.num_computed, 1, None):
                return

    @precondition(lambda self: self._decodable())
    @rule(data=st.data(), proposals=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    def verify_proposals(self, data: st.DataObject, proposals: list[int]) -> None:
        """A speculative step: slots for the sampled token and k proposals; the first few proposals are
        accepted, and the rest give back the blocks only they reached."""
        rid = data.draw(st.sampled_from(self._decodable()), label="rid")
        req = self.reqs[rid]
        req.tokens.append(data.draw(st.integers(0, VOCAB - 1), label="sampled"))
        if not self._allocate(rid, req, req.num_computed, 1 + len(proposals), None, len(proposals)):
            return
        num_accepted = data.draw(st.integers(0, len(proposals)), label="num_accepted")
        req.tokens.extend(proposals[:num_accepted])
        kept = len(req.tokens)
        held = len(self.mgr.get_block_ids(rid))
        assert self.mgr.trim(rid, kept) == held - -(-kept // BLOCK_SIZE)
        req.num_computed = kept

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)), label="rid")
        self.mgr.free(rid)
        del self.reqs[rid]

    @precondition(lambda self: self._running())
    @rule(data=st.data(), readmit=st.booleans())
    def preempt(self, data: st.DataObject, readmit: bool) -> None:
        """Free everything; the request restarts from the tokens known so far, at once or later."""
        rid = data.draw(st.sampled_from(self._running()), label="rid")
        req = self.reqs[rid]
        self.mgr.free(rid)
        req.num_computed, req.running = 0, False
        if readmit:
            blocks, num_cached = self.mgr.get_computed_blocks(rid, req.tokens)
            self._allocate(rid, req, num_cached, len(req.tokens) - num_cached, blocks)

    def _allocate(self, rid: str, req: Req, num_computed: int, num_new: int, blocks, num_lookahead: int = 0) -> bool:
        before = snapshot(self.mgr, list(self.reqs))
        new_ids = self.mgr.allocate_slots(rid, req.tokens, num_computed, num_new, blocks,
                                          num_lookahead_tokens=num_lookahead)
        if new_ids is None:
            assert snapshot(self.mgr, list(self.reqs)) == before, "failed allocation changed state"
            return False
        req.num_computed, req.running = num_computed + num_new, True
        table = self.mgr.get_block_ids(rid)
        assert table[len(table) - len(new_ids) :] == new_ids
        return True

    @invariant()
    def invariants_hold(self) -> None:
        self.mgr.check_invariants()
        stats = self.mgr.get_stats()
        assert stats.num_free_blocks + stats.num_used_blocks == stats.num_total_blocks
        assert 0.0 <= stats.fragmentation < 1.0
        assert self.mgr.num_requests == len(self._running())
        owners: dict[int, list[tuple[str, int]]] = {}
        for rid, req in self.reqs.items():
            table = self.mgr.get_block_ids(rid)
            expected_len = -(-req.num_computed // BLOCK_SIZE) if req.running else 0
            assert len(table) == expected_len, f"{rid}: {len(table)} blocks for {req.num_computed} tokens"
            for pos, block_id in enumerate(table):
                owners.setdefault(block_id, []).append((rid, pos))
        for block_id, holders in owners.items():
            if len(holders) < 2:
                continue
            block = self.mgr.pool.blocks[block_id]
            assert block.block_hash is not None, f"shared block {block_id} has no hash"
            for rid, pos in holders:
                req = self.reqs[rid]
                assert (pos + 1) * BLOCK_SIZE <= req.num_computed, f"shared block {block_id} not full in {rid}"
                assert expected_hashes(req.tokens, pos + 1)[pos] == block.block_hash, (
                    f"block {block_id} shared by requests with different prefixes"
                )

    def teardown(self) -> None:
        for rid in list(self.reqs):
            self.mgr.free(rid)
        self.mgr.check_invariants()
        assert self.mgr.num_free_blocks == NUM_BLOCKS - 1
        assert not np.any(self.mgr.pool.block_states()[1:] % 2 == 1), "a block is still in use after freeing all"


KVManagerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_manager_state_machine = KVManagerMachine.TestCase


# ---------------------------------------------------------------------------- beams (copy-on-write)


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    """A beam's child holds the parent's full blocks (one more reference each) and a block of its own for
    the partial last one, whose KV the cache copies; both grow apart, and freeing both frees everything."""
    import torch

    from kvcache.paged_cache import PagedKVCache

    mgr = KVCacheManager(num_blocks=16, block_size=8)
    cache = PagedKVCache(num_layers=2, num_blocks=16, block_size=8, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                         device="cpu")
    tokens = list(range(20))  # two full blocks and 4 tokens in a third
    assert mgr.allocate_slots("parent", tokens, 0, 20) is not None
    parent_ids = mgr.get_block_ids("parent")
    cache.kv[:, :, parent_ids[2]] = torch.randn(2, 2, 8, 2, 4)
    copies = mgr.fork("parent", "child", 20)
    child_ids = mgr.get_block_ids("child")
    assert child_ids[:2] == parent_ids[:2] and child_ids[2] != parent_ids[2]
    assert copies == [(parent_ids[2], child_ids[2])]
    cache.copy_blocks(copies)
    assert torch.equal(cache.kv[:, :, child_ids[2]], cache.kv[:, :, parent_ids[2]])
    assert [mgr.pool.blocks[b].ref_cnt for b in child_ids] == [2, 2, 1]
    mgr.check_invariants()
    # Each writes its own next tokens: the parent into its partial block, the child into its copy.
    assert mgr.allocate_slots("parent", tokens + [100], 20, 1) == []
    assert mgr.allocate_slots("child", tokens + [200], 20, 1) == []
    mgr.check_invariants()
    # A fork at a block boundary copies nothing.
    assert mgr.fork("parent", "grandchild", 16) == []
    assert mgr.get_block_ids("grandchild") == parent_ids[:2]
    mgr.check_invariants()
    for rid in ("parent", "child", "grandchild"):
        mgr.free(rid)
    assert mgr.num_free_blocks == mgr.pool.num_total_blocks
    mgr.check_invariants()


def test_fork_without_a_free_block_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=8)  # 3 usable blocks
    assert mgr.allocate_slots("parent", list(range(20)), 0, 20) is not None
    before = snapshot(mgr, ["parent"])
    assert mgr.fork("parent", "child", 20) is None
    assert snapshot(mgr, ["parent"]) == before
    assert mgr.fork("parent", "child", 16) == []  # full blocks only: no block needed
    mgr.check_invariants()
