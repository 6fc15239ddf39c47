"""The host KV tier end to end on tiny models: the tokens a request gets are the ones it gets without the tier,
however its KV travelled (evicted to the host and loaded back, swapped out and in), and nothing is left held."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch

pytest.register_assert_rewrite("tests.server_helpers")
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import ConfigError  # noqa: E402
from tests.helpers import VOCAB, save_tiny_model  # noqa: E402
from tests.server_helpers import TINY_MODEL_NAME, start_server, wait_until_idle  # noqa: E402

pytest_plugins = ["tests.server_helpers"]

BLOCK = 16
# A pool of 14 blocks (13 usable, 208 tokens) under 8 requests of up to 178 tokens: preemptions and evictions.
COMMON = dict(max_model_len=192, num_kvcache_blocks=14, kvcache_block_size=BLOCK, max_num_batched_tokens=48,
              max_num_seqs=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_tiny_model("llama", tmp_path_factory.mktemp("llama")))


def make_prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, VOCAB, (48,), generator=gen).tolist()  # three full blocks every prompt starts with
    return [system + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (30, 70, 9, 55, 41, 90, 17, 62)]


def greedy(llm: LLM, prompts, max_tokens: int = 40) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def tier_gib(llm: LLM, num_blocks: int) -> float:
    """The --kv-offloading-size that holds ``num_blocks`` blocks of this model."""
    return num_blocks * llm.engine.runner.bytes_per_block() / 2**30


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy tokens without a host tier, and the tier size that holds 64 blocks."""
    with LLM(checkpoint, **COMMON) as llm:
        return greedy(llm, make_prompts(0)), tier_gib(llm, 64)


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_tokens_are_the_same_with_the_host_tier_in_every_preemption_mode(checkpoint, reference, mode):
    tokens, gib = reference
    with LLM(checkpoint, kv_offloading_size_gib=gib, preemption_mode=mode, **COMMON) as llm:
        assert greedy(llm, make_prompts(0)) == tokens
        engine = llm.engine
        host = engine.kv_manager.get_stats().host
        assert engine.scheduler.num_preemptions_total > 0
        assert host.num_blocks_saved > 0  # evicted cached blocks at least
        if mode == "swap":
            assert engine.scheduler.num_swapped_out > 0
            assert host.num_swapped_in_blocks == host.num_swapped_out_blocks > 0  # every swapped request came back
        if mode == "recompute":
            assert engine.scheduler.num_swapped_out == 0 and host.num_swapped_out_blocks == 0
        # Idle: nothing held in either tier (LLM.generate checked both tiers' invariants on its way out).
        assert engine.kv_manager.num_requests == 0 and host.num_swapped_requests == 0
        assert engine.kv_manager.host.num_evictable_blocks == engine.kv_manager.host.num_used_blocks
        transfers = engine.stats().kv_transfers
        assert transfers.blocks_to_host == host.num_blocks_saved
        assert transfers.blocks_to_device == host.num_blocks_loaded
        assert transfers.bytes_to_host == host.num_blocks_saved * engine.runner.offloader.bytes_per_block


def test_a_prefix_pushed_out_of_the_device_comes_back_from_the_host_tier(checkpoint, reference):
    _, gib = reference
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(0, VOCAB, (81,), generator=gen).tolist()  # 5 full blocks can come back (never the last)
    others = [torch.randint(0, VOCAB, (120,), generator=gen).tolist() for _ in range(4)]
    with LLM(checkpoint, **COMMON) as plain:
        expected = greedy(plain, [first], max_tokens=12)
        expected_others = [greedy(plain, [prompt], max_tokens=4) for prompt in others]
    with LLM(checkpoint, kv_offloading_size_gib=gib, **COMMON) as llm:
        assert greedy(llm, [first], max_tokens=12) == expected
        for prompt in others:  # each fills most of the device pool: the first prompt's blocks are evicted
            greedy(llm, [prompt], max_tokens=4)
        manager = llm.engine.kv_manager
        before = manager.get_stats()
        assert greedy(llm, [first], max_tokens=12) == expected
        after = manager.get_stats()
        assert after.host.external_prefix_cache_hits - before.host.external_prefix_cache_hits == 80
        assert after.host.external_prefix_cache_queries - before.host.external_prefix_cache_queries == 81
        assert after.prefix_cache_hits == before.prefix_cache_hits  # none of it was still on the device
        assert after.host.num_blocks_loaded - before.host.num_blocks_loaded == 5
        # Coming back, the first prompt's blocks were loaded into blocks whose KV was evicted (and saved) in the
        # same step: that KV is read before it is overwritten, and comes back right in its turn.
        assert [greedy(llm, [prompt], max_tokens=4) for prompt in others] == expected_others
        assert manager.get_stats().host.external_prefix_cache_hits > after.host.external_prefix_cache_hits


def test_fp8_kv_blocks_travel_with_their_scales(checkpoint):
    fp8 = dict(COMMON, kv_cache_dtype="fp8")
    with LLM(checkpoint, **fp8) as llm:
        expected = greedy(llm, make_prompts(1))
        gib = tier_gib(llm, 64)
    with LLM(checkpoint, kv_offloading_size_gib=gib, preemption_mode="swap", **fp8) as llm:
        assert greedy(llm, make_prompts(1)) == expected
        assert llm.engine.kv_manager.get_stats().host.num_swapped_in_blocks > 0


def test_beam_search_forks_with_requests_swapped_out(checkpoint, reference):
    _, gib = reference
    prompts = make_prompts(2)[:3]
    params = SamplingParams(use_beam_search=True, n=3, max_tokens=16, ignore_eos=True)

    def beams(llm):
        return [[c.token_ids for c in o.outputs] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                       params, use_tqdm=False)]

    with LLM(checkpoint, **COMMON) as llm:
        expected = beams(llm)
    with LLM(checkpoint, kv_offloading_size_gib=gib, preemption_mode="swap", **COMMON) as llm:
        assert beams(llm) == expected


def test_aborts_while_swapped_out_or_loading_leave_both_tiers_clean(checkpoint, reference):
    """Requests aborted at every step of a run, whatever their KV is doing (swapped out, on its way back,
    being saved): the others get their tokens, and afterwards no block is referenced, pinned or owned."""
    tokens, gib = reference
    prompts = make_prompts(0)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(checkpoint, kv_offloading_size_gib=gib, preemption_mode="swap", **COMMON) as llm:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        doomed = {"1", "4", "6"}
        got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        step = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
            step += 1
            victim = next((rid for rid in sorted(doomed) if engine.kv_manager.is_swapped(rid)
                           or (step > 6 and engine.scheduler.get_request(rid) is not None)), None)
            if victim is not None:
                engine.abort_requests([victim])
                doomed.discard(victim)
            engine.kv_manager.check_invariants()
        for i in range(len(prompts)):
            if str(i) not in {"1", "4", "6"}:
                assert got[str(i)] == tokens[i]
        assert engine.scheduler.num_swapped_out > 0
        manager = engine.kv_manager
        manager.check_invariants()
        assert manager.num_requests == 0 and manager.pool.num_used_blocks == 0
        assert manager.host.num_evictable_blocks == manager.host.num_used_blocks  # nothing pinned or owned


def test_tensor_parallel_ranks_each_move_their_share_of_the_heads(checkpoint, reference, one_thread_per_rank):
    """Rank 1 (a process of its own, over gloo) makes the copies rank 0 plans, on its half of the KV heads."""
    tokens, gib = reference
    with LLM(checkpoint, tensor_parallel_size=2, kv_offloading_size_gib=gib, preemption_mode="swap", **COMMON) as llm:
        assert greedy(llm, make_prompts(0)) == tokens
        assert llm.engine.kv_manager.host.num_blocks == 64  # the size holds as many blocks as at TP=1
        assert llm.engine.kv_manager.get_stats().host.num_swapped_in_blocks > 0


def test_the_tier_settings_are_checked(checkpoint):
    with pytest.raises(ConfigError, match="needs prefix caching"):
        LLM(checkpoint, kv_offloading_size_gib=1, enable_prefix_caching=False, **COMMON)
    with pytest.raises(ConfigError, match="set kv_offloading_size"):
        LLM(checkpoint, preemption_mode="swap", **COMMON)
    with pytest.raises(ConfigError, match="holds no KV block"):
        LLM(checkpoint, kv_offloading_size_gib=1e-9, **COMMON)


@pytest.mark.server
def test_clients_that_disconnect_while_their_kv_moves_leave_both_tiers_clean(tmp_path, tiny_model_path):
    """A real server with a small pool over a host tier, swapping: twelve streams at once, half of them dropped by
    their clients after a few tokens. The rest finish with every token; afterwards no device block is in use and no
    host block is held (only cached ones remain)."""
    args = ["--model", str(tiny_model_path), "--served-model-name", TINY_MODEL_NAME, "--num-kvcache-blocks", "20",
            "--kvcache-block-size", "16", "--max-model-len", "256", "--max-num-batched-tokens", "64",
            "--kv-offloading-size", "0.002", "--preemption-mode", "swap"]
    server = start_server(tmp_path, "host-tier-disconnects", args)
    try:
        url = server.url
        results: dict[int, int] = {}

        def stream(i: int) -> None:
            prompt = [(7 * i + j) % 250 + 3 for j in range(60 + 9 * i)]
            body = {"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": 48, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                chunks = 0
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        if i % 2 and chunks == 3:
                            return  # the client goes away mid-stream
                        usage = json.loads(line.removeprefix("data: ")).get("usage")
                        if usage:
                            results[i] = usage["completion_tokens"]

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=180)
        assert {i: results.get(i) for i in range(0, 12, 2)} == {i: 48 for i in range(0, 12, 2)}
        metrics = wait_until_idle(url)
        assert metrics["minivllm:kv_cache_blocks_used"] == 0
        assert metrics["minivllm:num_preemptions_total"] > 0 and metrics["minivllm:kv_swap_out_blocks_total"] > 0
        host = httpx.get(f"{url}/dashboard/snapshot", timeout=10).json()["host"]
        assert host["by_state"]["held"] == 0 and host["num_swapped_requests"] == 0
        assert metrics["minivllm:kv_host_blocks_used"] == host["by_state"]["cached"]
    finally:
        server.stop()
