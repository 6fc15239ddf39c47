"""The scheduler alone: real KV manager, hand-built runner outputs, no model."""

from __future__ import annotations

import pytest

from engine.core.request import Request, RequestGroup, RequestStatus
from engine.core.scheduler import Scheduler
from engine.outputs import Logprobs, ModelRunnerOutput, SchedulerOutput
from engine.sampling_params import SamplingParams
from kvcache.manager import KVCacheManager

BLOCK = 16
EOS = 0


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, max_model_len=256, chunked=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=True)
    return Scheduler(kv, budget, max_seqs, max_model_len, enable_chunked_prefill=chunked)


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, first_token: int = 100) -> Request:
    prompt = list(range(first_token, first_token + prompt_len))
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), frozenset({EOS}))


def run_step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    """Schedule, then 'sample' ``token`` for every request whose known tokens are all computed."""
    out = sched.schedule()
    # A request samples when the step computes its last known token: it then holds a placeholder.
    sampled = [rid for rid in out.num_scheduled_tokens if sched.get_request(rid).num_placeholders > 0]
    events = sched.update_from_output(out, ModelRunnerOutput(sampled, [token] * len(sampled)))
    sched.kv.check_invariants()
    return out, events


def test_prefill_is_chunked_by_the_token_budget_then_decodes():
    sched = make_scheduler(budget=32)
    sched.add_request(make_request("a", 70))
    counts = []
    for _ in range(4):
        out, events = run_step(sched)
        counts.append(out.num_scheduled_tokens["a"])
    # 70 prompt tokens in chunks of 32, 32, 6; the last chunk samples, then a 1-token decode.
    assert counts == [32, 32, 6, 1]
    assert sched.get_request("a").num_output_tokens == 2


def test_one_step_mixes_decodes_and_a_new_prefill_within_the_budget():
    sched = make_scheduler(budget=40)
    sched.add_request(make_request("a", 10, max_tokens=10))
    run_step(sched)  # a's prefill
    sched.add_request(make_request("b", 100, first_token=300))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 39}
    assert out.total_num_scheduled_tokens == 40
    assert [r.request_id for r in out.new_requests] == ["b"]
    assert [r.request_id for r in out.cached_requests] == ["a"]


def test_waiting_requests_are_served_first_come_first_served_up_to_max_num_seqs():
    sched = make_scheduler(budget=1000, max_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 5, first_token=ord(rid) * 10))
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_finishes_on_max_tokens_eos_and_stop_token_ids():
    sched = make_scheduler()
    sched.add_request(make_request("len", 5, max_tokens=2))
    eos_req = make_request("eos", 5, max_tokens=10, first_token=200)
    sched.add_request(eos_req)
    finished = {}
    for token in (7, 7, EOS, 7):
        _, events = run_step(sched, token)
        finished.update({e.request_id: e.finish_reason for e in events if e.finished})
    assert finished == {"eos": "stop", "len": "length"}
    assert not sched.has_unfinished_requests()
    assert sched.kv.get_stats().num_used_blocks == 0

    ignore = Request("ign", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), frozenset({EOS}))
    stopper = Request("st", [4, 5, 6], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                      stop_token_ids=[9]), frozenset({EOS}))
    sched.add_request(ignore)
    sched.add_request(stopper)
    _, events = run_step(sched, EOS)
    assert not any(e.finished for e in events)  # both ignore EOS
    _, events = run_step(sched, 9)
    reasons = {e.request_id: e.finish_reason for e in events if e.finished}
    assert reasons == {"ign": "length", "st": "stop"}


def test_eos_before_min_tokens_does_not_stop():
    sched = make_scheduler()
    req = Request("m", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5, min_tokens=2), frozenset({EOS}))
    sched.add_request(req)
    _, events = run_step(sched, EOS)
    assert not events[0].finished
    _, events = run_step(sched, EOS)
    assert events[0].finished and events[0].finish_reason == "stop"


def test_preemption_frees_the_newest_request_and_it_resumes_with_its_tokens():
    # 6 usable blocks; two requests of 3 full blocks each fill the pool, and the next decode needs a 4th.
    sched = make_scheduler(num_blocks=7, budget=512, max_model_len=96)
    sched.add_request(make_request("old", 48, max_tokens=8))
    sched.add_request(make_request("new", 48, max_tokens=8, first_token=500))
    run_step(sched)  # both prefilled (blocks 6 of 6) and both sampled a token
    out, _ = run_step(sched)  # each needs a new block: 'new' is preempted so 'old' can go on
    assert out.num_preempted == 1
    assert sched.num_preemptions_total == 1
    preempted = sched.get_request("new")
    assert preempted.status == RequestStatus.WAITING and preempted.num_computed_tokens == 0
    assert preempted.output_token_ids == [7]  # its generated token is kept
    assert "new" in out.freed_request_ids  # the runner is told to drop its state
    # Drive to completion: everything finishes and no block leaks.
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        run_step(sched)
    assert not sched.has_unfinished_requests()
    stats = sched.kv.get_stats()
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_prefix_cache_hit_skips_cached_tokens():
    sched = make_scheduler(budget=1000)
    sched.add_request(make_request("a", 40, max_tokens=1))
    run_step(sched)
    assert not sched.has_unfinished_requests()
    b = make_request("b", 40, max_tokens=1)  # same prompt: 2 full blocks are cached
    sched.add_request(b)
    out, events = run_step(sched)
    assert out.num_scheduled_tokens["b"] == 40 - 32
    assert events[0].num_cached_tokens == 32
    stats = sched.kv.get_stats()
    assert stats.prefix_cache_hits == 32 and stats.prefix_cache_queries == 80


def test_a_request_waiting_for_blocks_counts_one_prefix_lookup():
    """The hit-rate counters see each admission once, not every step a request waits for blocks."""
    sched = make_scheduler(num_blocks=6, budget=1000)  # 5 usable blocks of 16
    sched.add_request(make_request("a", 60, max_tokens=6))  # 4 blocks, a 5th once it passes 64 tokens
    sched.add_request(make_request("b", 40, first_token=500, max_tokens=1))  # needs 3 blocks
    waited = 0
    for _ in range(20):
        out, _ = run_step(sched)
        if "b" in out.num_scheduled_tokens:
            break
        waited += 1
    assert waited >= 2, "b should have waited for a's blocks over several steps"
    stats = sched.kv.get_stats()
    assert stats.prefix_cache_queries == 60 + 40


def test_abort_frees_blocks_of_running_and_waiting_requests():
    sched = make_scheduler(max_seqs=1)
    sched.add_request(make_request("run", 20, max_tokens=50))
    sched.add_request(make_request("wait", 20, max_tokens=50, first_token=400))
    run_step(sched)
    assert sched.kv.get_stats().num_used_blocks > 0
    events = sched.abort_requests(["run", "wait", "unknown"])
    assert [(e.request_id, e.finish_reason) for e in events] == [("run", "abort"), ("wait", "abort")]
    assert sched.kv.get_stats().num_used_blocks == 0
    assert sched.schedule().freed_request_ids == {"run", "wait"}


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("x", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("x", 3))


def test_a_group_holds_its_seats_reports_instead_of_appending_and_ends_with_its_last_request():
    """A beam search's requests (one RequestGroup): once its first is admitted the group holds its width in seats;
    their tokens go back to their coordinator as logprobs, not into the requests; forks share the parent's
    blocks; when the last one is dropped its seats are free again."""
    sched = make_scheduler(max_seqs=3)
    group = RequestGroup("g", width=2)
    first = make_request("g#0", 20)
    first.group = group
    for request in (first, make_request("a", 10, first_token=300), make_request("b", 10, first_token=400)):
        sched.add_request(request)
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"g#0", "a"}  # two seats for the group, one for "a": "b" waits
    entry = Logprobs(7, -0.1, 1, [7, 8], [-0.1, -2.0])
    sched.update_from_output(out, ModelRunnerOutput(["g#0", "a"], [7, 9], logprobs={"g#0": [entry]}))
    assert sched.take_group_reports() == [(first, entry)] and first.output_token_ids == []
    child = sched.fork_request(first, "g#1", 8)
    sched.append_chosen_token(first, 7)
    assert child.group is group and child.all_token_ids == first.prompt_token_ids + [8]
    assert sched.kv.get_block_ids("g#1")[:1] == sched.kv.get_block_ids("g#0")[:1]  # the full block is shared
    assert "b" not in sched.schedule().num_scheduled_tokens  # three running: no seat for "b"
    sched.drop_request(first)
    sched.drop_request(child)
    assert sched.get_request("g#0") is None and sched.get_request("g#1") is None
    out = sched.schedule()
    assert "b" in out.num_scheduled_tokens and {"g#0", "g#1"} <= out.freed_request_ids
    sched.kv.check_invariants()
