"""Requests that end badly, and a server that does: disconnects, a dying engine, overload, SIGTERM, metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    REPO_ROOT,
    TINY_MODEL_NAME,
    assert_error_shape,
    engine_core_pid,
    failing_step_env,
    free_port,
    process_alive,
    scrape_metrics,
    start_server,
    tiny_server_args,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

ABORTS = 'minivllm:request_success_total{finished_reason="abort"}'
LONG = {"model": TINY_MODEL_NAME, "max_tokens": 4000, "ignore_eos": True}  # far longer than any test waits


def async_client(url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=url, timeout=120, limits=limits)


async def read_some_chunks(client: httpx.AsyncClient, body: dict, num_chunks: int) -> int:
    """Open a stream, read ``num_chunks`` events, then drop the connection."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen == num_chunks:
                    break
    return seen


async def read_stream(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]


def assert_idle_and_serving(url: str, metrics: dict[str, float]) -> None:
    assert metrics["minivllm:num_requests_running"] == 0
    assert metrics["minivllm:num_requests_waiting"] == 0
    assert metrics["minivllm:kv_cache_blocks_used"] == 0
    assert metrics["minivllm:kv_cache_usage_perc"] == 0.0
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "again", "max_tokens": 3}, timeout=60)
    assert response.status_code == 200, response.text


# --------------------------------------------------------------------- disconnects


def check_cancelled_streams_free_everything(url: str, num_streams: int) -> None:
    """Open streams, drop each after 3 events: every one counts as aborted and the server ends idle."""
    before = scrape_metrics(url)

    async def scenario():
        async with async_client(url) as client:
            bodies = [{**LONG, "prompt": f"stream number {i}", "stream": True} for i in range(num_streams)]
            return await asyncio.gather(*(read_some_chunks(client, body, 3) for body in bodies))

    assert asyncio.run(scenario()) == [3] * num_streams
    after = wait_until_idle(url, timeout_s=15)
    assert after[ABORTS] - before[ABORTS] == num_streams
    assert_idle_and_serving(url, after)


def test_cancelled_streams_free_everything(tiny_server):
    check_cancelled_streams_free_everything(tiny_server.url, 100)


def test_non_streamed_client_timeout_aborts(tiny_server):
    before = scrape_metrics(tiny_server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_server.url}/v1/completions", json={**LONG, "prompt": "wait for me"},
                   timeout=httpx.Timeout(60, read=1.0))
    after = wait_until_idle(tiny_server.url, timeout_s=15)
    assert after[ABORTS] - before[ABORTS] == 1
    assert_idle_and_serving(tiny_server.url, after)


def test_steps_planned_ahead_serve_the_same_tokens_and_free_everything(tiny_server, tmp_path, tiny_model_path):
    """The step pipeline CUDA uses by default (overlapped steps, async scheduling), forced on with the CPU:
    the same greedy completions as step-by-step serving, and cancelled streams still free their blocks."""
    server = start_server(tmp_path, "ahead", tiny_server_args(tiny_model_path) + ["--overlap-steps",
                                                                                    "--async-scheduling"])
    try:
        assert "overlap_steps=True, async_scheduling=True" in server.log_path.read_text()
        assert "overlap_steps=False, async_scheduling=False" in tiny_server.log_path.read_text()
        body = {"model": TINY_MODEL_NAME, "max_tokens": 12, "temperature": 0, "ignore_eos": True}

        async def completions(url: str) -> list[str]:
            async with async_client(url) as client:
                responses = await asyncio.gather(*(client.post("/v1/completions", json={**body, "prompt": f"p {i}"})
                                                   for i in range(8)))
            return [r.json()["choices"][0]["text"] for r in responses]

        assert asyncio.run(completions(server.url)) == asyncio.run(completions(tiny_server.url))
        check_cancelled_streams_free_everything(server.url, 30)
    finally:
        server.stop()


# ------------------------------------------------------------------------ metrics

GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_blocks_total", "kv_cache_blocks_free",
          "kv_cache_blocks_used", "kv_cache_blocks_cached", "kv_cache_usage_perc", "kv_cache_fragmentation_ratio"]
COUNTERS = ["prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
            "generation_tokens_total"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"]


def test_metrics_names_and_counters(tiny_server):
    before = scrape_metrics(tiny_server.url)
    for name in GAUGES + COUNTERS:
        assert f"minivllm:{name}" in before, name
    assert before["minivllm:engine_up"] == 1
    for name in HISTOGRAMS:
        assert f"minivllm:{name}_count" in before and f"minivllm:{name}_sum" in before, name
    for reason in ("stop", "length", "abort"):
        assert f'minivllm:request_success_total{{finished_reason="{reason}"}}' in before
    assert before["minivllm:kv_cache_blocks_total"] > 0

    body = {"prompt": "The same prefix for both requests, long enough to fill a block or two. " * 3,
            "max_tokens": 5, "ignore_eos": True}
    for _ in range(2):
        assert httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60).status_code == 200
    after = scrape_metrics(tiny_server.url)
    grew = ["prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total"]
    grew += [f"{name}_count" for name in HISTOGRAMS]
    for name in grew:
        assert after[f"minivllm:{name}"] > before[f"minivllm:{name}"], name
    assert after["minivllm:generation_tokens_total"] - before["minivllm:generation_tokens_total"] == 10
    length = 'minivllm:request_success_total{finished_reason="length"}'
    assert after[length] - before[length] == 2
    # On the CPU every step runs eagerly: one prefill step and four decode steps a request at least.
    steps = 'minivllm:engine_steps_total{kind="%s"}'
    assert after[steps % "eager"] - before[steps % "eager"] >= 2 * 5
    assert after[steps % "decode_graph"] == after[steps % "mixed_graph"] == 0


# ------------------------------------------------------------------- engine failure


@pytest.fixture
def failing_server(tmp_path_factory, tiny_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "failing", tiny_server_args(tiny_model_path),
                          env=failing_step_env(40))
    yield server
    assert server.stop() == 0


def test_engine_step_failure_fails_requests_and_health(failing_server):
    url = failing_server.url

    async def scenario():
        async with async_client(url) as client:
            async with client.stream("POST", "/v1/completions", json={**LONG, "prompt": "a", "stream": True}) as stream:
                assert stream.status_code == 200
                plain = asyncio.create_task(client.post("/v1/completions", json={**LONG, "prompt": "b"}))
                events = await asyncio.wait_for(read_stream(stream), timeout=60)
            return events, await asyncio.wait_for(plain, timeout=60)

    events, plain = asyncio.run(scenario())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    assert_error_shape(plain, 503)
    assert_dead_and_refusing(url)
    assert not process_alive(engine_core_pid(failing_server))
    metrics = scrape_metrics(url)
    assert metrics["minivllm:engine_up"] == 0 and "minivllm:num_requests_running" not in metrics


def assert_dead_and_refusing(url: str) -> None:
    health = httpx.get(f"{url}/health", timeout=10)
    assert assert_error_shape(health, 503)["code"] == "engine_dead"
    assert_error_shape(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10), 503)
    chat = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    assert_error_shape(httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=10), 503)


def test_killed_engine_process_ends_streams_and_health_within_a_second(tmp_path, tiny_model_path):
    server = start_server(tmp_path, "killed-engine", tiny_server_args(tiny_model_path))
    try:
        url = server.url

        async def scenario():
            async with async_client(url) as client:
                streams = [await client.send(client.build_request(
                    "POST", "/v1/completions", json={**LONG, "prompt": f"s{i}", "stream": True}), stream=True)
                    for i in range(3)]
                assert all(s.status_code == 200 for s in streams)
                await asyncio.to_thread(wait_for_metric, url, "minivllm:num_requests_running", 3)
                os.kill(engine_core_pid(server), signal.SIGKILL)
                killed = time.monotonic()
                events = await asyncio.wait_for(asyncio.gather(*(read_stream(s) for s in streams)), timeout=10)
                while httpx.get(f"{url}/health", timeout=5).status_code != 503:
                    await asyncio.sleep(0.02)
                return events, time.monotonic() - killed

        streams, seconds_to_503 = asyncio.run(scenario())
        assert seconds_to_503 < 1.0
        for events in streams:
            assert events[-1] == "[DONE]"
            message = json.loads(events[-2])["error"]["message"]
            assert "exited unexpectedly (killed by SIGKILL)" in message  # the real cause, not "exit code None"
        assert_dead_and_refusing(url)
        health = httpx.get(f"{url}/health", timeout=10).json()["error"]["message"]
        assert "killed by SIGKILL" in health
        assert server.stop() == 0
    finally:
        server.stop()


def test_killed_api_server_takes_the_engine_process_down(tmp_path, tiny_model_path):
    server = start_server(tmp_path, "killed-server", tiny_server_args(tiny_model_path))
    core = engine_core_pid(server)
    assert process_alive(core)
    server.send_signal(signal.SIGKILL)
    server.wait(timeout_s=10)
    deadline = time.monotonic() + 10
    while process_alive(core):
        assert time.monotonic() < deadline, "the engine core outlived its API server"
        time.sleep(0.05)


@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--cpu-kvcache-space-gib", "100000"], "memory"),
], ids=["missing-model-dir", "kv-cache-out-of-memory"])
def test_engine_start_up_failure_is_a_clear_error_and_exit_code(args, message, tiny_model_path):
    base = ["--model", str(tiny_model_path)] if args[0] != "--model" else []
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", str(free_port()), *base, *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error_line = [line for line in proc.stderr.splitlines() if line.startswith("minivllm serve: error:")]
    assert error_line and message in error_line[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("where", ["port", "unix-socket"])
def test_an_address_in_use_is_refused_before_the_model_loads(where, tmp_path, tiny_model_path):
    """Another server holds the address: exit 2 with a clear line at once, before any engine process starts."""
    holder = socket.socket(socket.AF_UNIX if where == "unix-socket" else socket.AF_INET, socket.SOCK_STREAM)
    with holder:
        if where == "unix-socket":
            address = str(tmp_path / "taken.sock")
            holder.bind(address)
            flags = ["--uds", address]
        else:
            holder.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{holder.getsockname()[1]}"
            flags = ["--host", "127.0.0.1", "--port", str(holder.getsockname()[1])]
        holder.listen()
        proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_path), *flags],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error_line = [line for line in proc.stderr.splitlines() if line.startswith("minivllm serve: error:")]
    assert error_line and f"cannot listen on {address}" in error_line[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "engine core process" not in proc.stderr  # refused before the model was even loading


# ------------------------------------------------------------ overload and shutdown


def small_server_args(tiny_model_path) -> list[str]:
    return tiny_server_args(tiny_model_path) + ["--max-num-seqs", "2", "--max-waiting-requests", "1",
                                                "--shutdown-timeout", "10", "--max-tokens-limit", "4000"]


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, tiny_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "small", small_server_args(tiny_model_path))
    yield server
    server.stop()


@pytest.fixture
def draining_server(tmp_path, tiny_model_path):
    """A small server of the test's own, for a test that shuts it down."""
    server = start_server(tmp_path, "draining", small_server_args(tiny_model_path))
    yield server
    server.stop()


def wait_for_metric(url: str, name: str, value: float, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while scrape_metrics(url)[name] != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


def ready_line_of(server) -> str:
    lines = [line for line in server.log_path.read_text().splitlines() if " ready: " in line]
    assert len(lines) == 1, server.log_tail()
    return lines[0]


def test_the_ready_line_says_how_long_a_chat_request_may_run(tiny_server, small_server):
    """vLLM's default: a chat request without max_tokens runs to the end of the context; the line says so, and
    names the flag that sets another default."""
    unlimited = ready_line_of(tiny_server)
    assert ("chat requests without max_tokens: up to the end of the context (4096 tokens with the prompt; "
            "--max-tokens-limit N sets a default)") in unlimited
    assert "chat requests without max_tokens: 4000 tokens (--max-tokens-limit)" in ready_line_of(small_server)


def test_full_waiting_queue_is_503(small_server):
    url = small_server.url

    async def scenario():
        async with async_client(url) as client:
            opened = []
            for i in range(3):  # two run (max-num-seqs 2), then one waits
                response = await client.send(client.build_request(
                    "POST", "/v1/completions", json={**LONG, "prompt": f"r{i}", "stream": True}), stream=True)
                assert response.status_code == 200
                opened.append(response)
                if i == 1:
                    await asyncio.to_thread(wait_for_metric, url, "minivllm:num_requests_running", 2)
            await asyncio.to_thread(wait_for_metric, url, "minivllm:num_requests_waiting", 1)
            refused = await client.post("/v1/completions", json={"prompt": "one too many", "max_tokens": 2})
            for response in opened:
                await response.aclose()
            return refused

    refused = asyncio.run(scenario())
    assert assert_error_shape(refused, 503)["code"] == "engine_overloaded"
    assert_idle_and_serving(url, wait_until_idle(url, timeout_s=15))


def test_sigterm_drains_then_aborts_then_exits_0(draining_server):
    """In flight at SIGTERM: a short request finishes, a long one is aborted at the deadline, then exit 0.

    Events decide, not speed: the short request (3 tokens, already running) has the whole drain
    (--shutdown-timeout 10) for its last two steps, and the engine core is paused once it has
    finished, so the long one (4000 tokens, in the same batch) cannot finish before the deadline
    on any machine."""
    url = draining_server.url
    core = engine_core_pid(draining_server)

    async def scenario():
        async with async_client(url) as client:
            long_req = {**LONG, "prompt": "long", "stream": True}
            short_req = {**LONG, "prompt": "short", "max_tokens": 3, "stream": True}
            long_stream = await client.send(client.build_request("POST", "/v1/completions", json=long_req), stream=True)
            short_stream = await client.send(client.build_request("POST", "/v1/completions", json=short_req),
                                             stream=True)
            assert long_stream.status_code == short_stream.status_code == 200
            short_lines = short_stream.aiter_lines()
            first = await anext_event(short_lines)  # the short request runs beside the long one
            draining_server.send_signal()
            await asyncio.to_thread(wait_for_health_code, url, "shutting_down")
            refused = await client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            short_events = [first] + await asyncio.wait_for(rest_of_events(short_lines), timeout=60)
            os.kill(core, signal.SIGSTOP)
            try:
                long_events = await asyncio.wait_for(read_stream(long_stream), timeout=60)
            finally:
                os.kill(core, signal.SIGCONT)
            return refused, short_events, long_events

    refused, short_events, long_events = asyncio.run(scenario())
    assert "shutting down" in assert_error_shape(refused, 503)["message"]
    for events, reason in ((short_events, "length"), (long_events, "abort")):
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] == reason
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert draining_server.wait(timeout_s=30) == 0
    assert "aborted 1 requests that did not finish in time" in draining_server.log_path.read_text()


async def anext_event(lines) -> str:
    async for line in lines:
        if line.startswith("data: "):
            return line[len("data: "):]
    raise AssertionError("the stream ended before its first event")


async def rest_of_events(lines) -> list[str]:
    return [line[len("data: "):] async for line in lines if line.startswith("data: ")]


def wait_for_health_code(url: str, code: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{url}/health", timeout=10)
        if response.status_code == 503 and response.json()["error"]["code"] == code:
            return
        assert time.monotonic() < deadline, f"/health never said {code}: {response.text}"
        time.sleep(0.05)


def test_second_ctrl_c_ends_the_drain_at_once_and_quietly(tmp_path, tiny_model_path):
    """Ctrl-C twice: the first starts a long drain, the second ends it; the open stream gets an error event
    and [DONE] (not a cut connection), no traceback is printed, and the process exits with 0."""
    server = start_server(tmp_path, "twice", tiny_server_args(tiny_model_path) + ["--shutdown-timeout", "600"])
    try:
        async def scenario():
            async with async_client(server.url) as client:
                body = {**LONG, "prompt": "keep going", "stream": True}
                stream = await client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
                lines = stream.aiter_lines()
                first = await anext_event(lines)
                server.send_signal(signal.SIGINT)
                await asyncio.to_thread(wait_for_health_code, server.url, "shutting_down")
                server.send_signal(signal.SIGINT)
                return [first] + await asyncio.wait_for(rest_of_events(lines), timeout=60)

        events = asyncio.run(scenario())
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "shut down before this request finished" in error["message"]
        assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
        assert server.wait(timeout_s=60) == 0  # far less than the 600 s drain it was given
        log = server.log_path.read_text()
        assert "stopping now: 1 requests in flight end with an error" in log
        assert "Traceback" not in log and "CancelledError" not in log
    finally:
        server.stop()
