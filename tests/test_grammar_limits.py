"""Grammars cannot stall the server: bounded in size, nesting and compile time, checked off the event loop,
compiled beside each other, cached within a memory bound, and waited for without spinning.

Against real servers: every /health probe answers within its own client timeout while large or slow
grammars compile, and the engine core's main thread stays asleep while its only requests wait for one.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time

import httpx
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    TINY_MODEL_NAME,
    assert_error_shape,
    engine_core_pid,
    scrape_metrics,
    start_server,
    tiny_server_args,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
DEFERRED = 'minivllm:num_requests_waiting_by_reason{reason="deferred"}'
COMPILE_TIMEOUT_S = 2
MAX_BYTES = 1_000_000
# Compiles for many seconds (60k alternatives over a 49k-token vocabulary): past the time bound on any
# machine. A choice of two compiles in milliseconds.
SLOW_SCHEMA = {"enum": [f"v_{i}" for i in range(60_000)]}
HEALTH_TIMEOUT_S = 5.0  # the stalls these tests guard against lasted tens of seconds


@pytest.fixture(scope="module")
def bounded_server(tmp_path_factory, tiny_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "grammar-bounds", tiny_server_args(tiny_model_path) + [
        "--structured-outputs-max-bytes", str(MAX_BYTES),
        "--structured-outputs-compile-timeout", str(COMPILE_TIMEOUT_S), "--xgrammar-cache-mb", "64"])
    yield server
    server.stop()


class HealthProbes:
    """GET /health again and again on a thread of its own until stopped; every probe must answer 200 within
    its own client timeout."""

    def __init__(self, url: str):
        self.url = url
        self.failures: list[str] = []
        self.num_answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbes:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=HEALTH_TIMEOUT_S) as client:
            while not self._stop.is_set():
                try:
                    status = client.get("/health").status_code
                    if status != 200:
                        self.failures.append(f"status {status}")
                    self.num_answered += 1
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self._stop.wait(0.05)

    def check(self) -> None:
        assert not self.failures, self.failures
        assert self.num_answered > 0


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.05)


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process's main thread has used."""
    with open(f"/proc/{pid}/task/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_events(url: str, body: dict) -> tuple[int, list]:
    events = []
    with httpx.stream("POST", f"{url}{CMPL}", json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):]))
        return response.status_code, events


# ------------------------------------------------------------------------------ size and nesting


BIG = "x" * (MAX_BYTES + 1)


@pytest.mark.parametrize("ask, param", [
    ({"guided_regex": BIG}, "guided_regex"),
    ({"guided_choice": [BIG]}, "guided_choice"),
    ({"structured_outputs": {"grammar": f'root ::= "{BIG}"'}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [BIG]}}}},
     "response_format"),
])
def test_a_grammar_over_the_size_bound_is_a_400_naming_its_field(bounded_server, ask, param):
    response = httpx.post(f"{bounded_server.url}{CMPL}", json={"model": TINY_MODEL_NAME, "prompt": "x", **ask},
                          timeout=60)
    error = assert_error_shape(response, 400)
    assert error["param"] == param
    assert "--structured-outputs-max-bytes" in error["message"] and str(MAX_BYTES) in error["message"]


def test_tools_over_the_size_bound_are_a_400(bounded_server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"enum": [BIG]}}}}}]
    body = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "tools": tools,
            "tool_choice": "required"}
    error = assert_error_shape(httpx.post(f"{bounded_server.url}{CHAT}", json=body, timeout=60), 400)
    assert error["param"] == "tools" and "--structured-outputs-max-bytes" in error["message"]


def nested_schema(depth: int) -> dict:
    schema = {"type": "boolean"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"], "additionalProperties": False}
    return schema


def test_a_schema_nested_too_deeply_is_a_400(bounded_server):
    # 100 objects deep: 201 levels of JSON (vLLM's bound is 64).
    body = {"model": TINY_MODEL_NAME, "prompt": "x", "guided_json": nested_schema(100)}
    error = assert_error_shape(httpx.post(f"{bounded_server.url}{CMPL}", json=body, timeout=60), 400)
    assert error["param"] == "guided_json" and "nested too deeply" in error["message"]


def test_a_deep_schema_for_many_prompts_is_checked_off_the_event_loop(bounded_server):
    """31 objects deep (63 levels of JSON, within the bound): building its grammar takes tens of milliseconds,
    which checked once per prompt on the event loop (256 prompts) stalled /health for many seconds."""
    schema = nested_schema(31)
    body = {"model": TINY_MODEL_NAME, "prompt": [f"p{i}" for i in range(256)], "max_tokens": 1, "guided_json": schema}
    with HealthProbes(bounded_server.url) as probes:
        response = httpx.post(f"{bounded_server.url}{CMPL}", json=body, timeout=300)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 256
    probes.check()
    wait_until_idle(bounded_server.url)


# ------------------------------------------------------------------------------ compile time


def test_a_slow_compile_fails_its_requests_and_holds_up_no_other(bounded_server):
    url = bounded_server.url
    slow = {"model": TINY_MODEL_NAME, "prompt": "Pick:", "max_tokens": 1, "guided_json": SLOW_SCHEMA}
    quick = {"model": TINY_MODEL_NAME, "prompt": "Yes or no?", "max_tokens": 5,
             "structured_outputs": {"choice": ["yes", "no"]}}
    with HealthProbes(url) as probes, concurrent.futures.ThreadPoolExecutor(2) as pool:
        # The same grammar twice: one compile, which both wait for.
        whole = pool.submit(httpx.post, f"{url}{CMPL}", json=slow, timeout=120)
        streamed = pool.submit(stream_events, url, slow)
        wait_for(lambda: scrape_metrics(url)[DEFERRED] == 2, "both slow requests waiting for their grammar")
        answer = httpx.post(f"{url}{CMPL}", json=quick, timeout=60)
        assert not whole.done(), "the quick grammar waited for the slow one"
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] in ("yes", "no")
        error = assert_error_shape(whole.result(), 400)
        status, events = streamed.result()
    assert error["param"] == "guided_json" and "--structured-outputs-compile-timeout" in error["message"]
    assert status == 200  # a stream has started when the error comes: it is the stream's error event
    assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == error["message"]
    assert events[-2]["error"]["param"] == "guided_json"
    probes.check()
    # The server goes on serving grammars.
    assert httpx.post(f"{url}{CMPL}", json=quick, timeout=60).status_code == 200
    wait_until_idle(url)


def test_the_compiled_grammar_cache_is_bounded_by_its_flag(bounded_server):
    body = {"model": TINY_MODEL_NAME, "prompt": "x", "max_tokens": 2, "guided_regex": "[ab]+"}
    assert httpx.post(f"{bounded_server.url}{CMPL}", json=body, timeout=60).status_code == 200
    assert "compiled grammars cached up to 64 MiB" in bounded_server.log_path.read_text()


def test_grammar_manager_passes_the_cache_bound_to_xgrammar(default_model_path):
    """Distinct schemas of ~0.2 MB each compiled after each other: the cache stays within its 1 MiB."""
    import transformers

    from engine.core.structured_output import GrammarManager
    from engine.sampling_params import StructuredOutputsParams

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(default_model_path))
    manager = GrammarManager(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}), max_num_seqs=4,
                             cache_limit_mb=1)
    try:
        assert manager.compiler.cache_limit_bytes == 2**20
        for i in range(8):
            spec = StructuredOutputsParams(json=json.dumps({"enum": [f"w{i}_{j}" for j in range(2000)]}))
            grammar = manager.attach(f"r{i}", spec)
            wait_for(lambda: grammar.ready, f"grammar {i} compiled")  # noqa: B023 - waited for in this iteration
            assert 0 < manager.compiler.get_cache_size_bytes() <= 2**20
    finally:
        manager.shutdown()


# ------------------------------------------------------------------------------ waiting without spinning


def test_a_big_grammar_compiles_while_health_answers_and_the_core_sleeps(tiny_server):
    """The issue's probe, within the default bounds: a 20k-value enum (~0.2 MB), the only request, compiles
    for seconds. /health answers throughout, and the engine core's main thread does not spin meanwhile (it
    used to poll and send a message on every turn of its loop, starving the API server)."""
    url = tiny_server.url
    pid = engine_core_pid(tiny_server)
    values = [f"w_{i}" for i in range(20_000)]
    body = {"model": TINY_MODEL_NAME, "prompt": "Pick:", "max_tokens": 16, "guided_json": {"enum": values}}
    with HealthProbes(url) as probes, concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, f"{url}{CMPL}", json=body, timeout=600)
        wait_for(lambda: scrape_metrics(url)[DEFERRED] == 1, "the request waiting for its grammar")
        cpu_before = main_thread_cpu_s(pid)
        wait_for(lambda: scrape_metrics(url)[DEFERRED] == 0, "the grammar compiled", timeout_s=600)
        cpu_waiting = main_thread_cpu_s(pid) - cpu_before  # and the first step of a 2-layer model after it
        response = reply.result()
    assert response.status_code == 200, response.text
    assert json.loads(response.json()["choices"][0]["text"]) in values
    probes.check()
    # Asleep while it waited: a few wake-ups (a spinning loop kept a core busy).
    assert cpu_waiting < 0.3, f"the engine core's main thread used {cpu_waiting:.2f} s of CPU while it waited"
    wait_until_idle(url)
