"""A bounded soak: a few hundred mixed requests, many dropped at random points, against the shared tiny server.
Afterwards nothing runs or waits, every KV block is free, and the server's memory has not grown past a bound."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    TINY_MODEL_NAME,
    engine_core_pid,
    scrape_metrics,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

NUM_REQUESTS = 120
CONCURRENCY = 48
RSS_GROWTH_BOUND_MB = 128  # both processes together, after a warm-up round like it (seen: 6-95 MB)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def random_request(rng: random.Random) -> tuple[str, dict, bool, int | None]:
    """(path, body, stream, chunks to read before dropping the connection; None: read it all)."""
    stream = rng.random() < 0.7
    fields = {"model": TINY_MODEL_NAME, "max_tokens": rng.randint(1, 64), "stream": stream,
              "temperature": rng.choice([0, 0.7, 1.0]), "n": rng.choice([1, 1, 2, 3]),
              "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.3:
        fields["stop"] = rng.sample([" the", "a", ".", "\n", "ing"], rng.randint(1, 3))
    if rng.random() < 0.2:
        fields["seed"] = rng.randint(0, 1000)
    if rng.random() < 0.5:
        path, body = "/v1/completions", {**fields, "prompt": " ".join(rng.choices(["sea", "sky", "a", "b"], k=30))}
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
    else:
        path, body = "/v1/chat/completions", {**fields, "messages": [{"role": "user", "content": "tell me more"}]}
    if stream and rng.random() < 0.1:
        body["stream_options"] = {"include_usage": True}
    drop_after = rng.randint(1, 6) if rng.random() < 0.4 else None
    return path, body, stream, drop_after


async def one(client: httpx.AsyncClient, rng: random.Random, request) -> str:
    path, body, stream, drop_after = request
    if not stream:
        timeout = httpx.Timeout(60, read=rng.uniform(0.01, 0.3)) if drop_after else httpx.Timeout(60)
        try:
            response = await client.post(path, json=body, timeout=timeout)
        except httpx.ReadTimeout:
            return "dropped"
        assert response.status_code == 200, response.text
        return "done"
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), line  # an error event (the text may say "error")
                seen += 1
                if drop_after is not None and seen >= drop_after:
                    return "dropped"
    return "done"


async def soak(url: str, num: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    requests = [random_request(rng) for _ in range(num)]
    semaphore = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def limited(request):
            async with semaphore:
                return await one(client, rng, request)
        return await asyncio.gather(*(limited(r) for r in requests))


def test_soak_with_random_disconnects_leaves_nothing_behind(tiny_server):
    server = tiny_server
    pids = (server.proc.pid, engine_core_pid(server))
    asyncio.run(soak(server.url, NUM_REQUESTS, seed=1))  # warm-up: allocator pools and caches reach their size
    wait_until_idle(server.url)
    before_mb = sum(rss_mb(pid) for pid in pids)
    outcomes = asyncio.run(soak(server.url, NUM_REQUESTS, seed=2))
    assert outcomes.count("dropped") > 33 and outcomes.count("done") > 66
    metrics = wait_until_idle(server.url, timeout_s=30)
    assert metrics["minivllm:num_requests_running"] == 0 and metrics["minivllm:num_requests_waiting"] == 0
    assert metrics["minivllm:kv_cache_blocks_used"] == 0
    assert metrics["minivllm:kv_cache_blocks_free"] == metrics["minivllm:kv_cache_blocks_total"]
    growth_mb = sum(rss_mb(pid) for pid in pids) - before_mb
    assert growth_mb < RSS_GROWTH_BOUND_MB, f"RSS grew {growth_mb:.0f} MB"
    assert scrape_metrics(server.url)["minivllm:engine_up"] == 1
