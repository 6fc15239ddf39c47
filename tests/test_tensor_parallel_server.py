"""``minivllm serve --tensor-parallel-size 2`` on the CPU (gloo): the same answers as one rank, two "nodes"
on one machine, and a rank killed mid-generation ending the engine cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    REPO_ROOT,
    TINY_MODEL_NAME,
    engine_core_pid,
    free_port,
    process_alive,
    rank_pids,
    start_server,
    tiny_server_args,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# One torch thread a rank: with a thread per core each, two ranks spin against each other at every collective.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def answers(url: str) -> tuple[str, str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    text = client.completions.create(model=TINY_MODEL_NAME, prompt="The capital of France is", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    chat = client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    return text, chat


def test_two_nodes_on_one_machine(tmp_path, tiny_server, tiny_model_path):
    """Node 1 runs `minivllm worker`, node 0 the server; they meet at --master-port over loopback."""
    port = str(free_port())
    parallel = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    model = tiny_server_args(tiny_model_path)
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "server.cli", "worker", *model, *parallel, "--node-rank", "1"],
                                 cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ONE_THREAD})
    try:
        server = start_server(tmp_path, "node0", model + parallel + ["--node-rank", "0"], env=ONE_THREAD)
        try:
            assert answers(server.url) == answers(tiny_server.url)
        finally:
            assert server.stop() == 0
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_serve_at_tp2_answers_as_tp1_and_a_rank_killed_mid_generation_ends_it(tmp_path, tiny_server, tiny_model_path):
    """The SDK gets TP=1's text; then rank 1 is killed while a stream runs: the stream fails, /health says
    503 within seconds, and neither the engine core nor any rank is left running."""
    server = start_server(tmp_path, "tp2", tiny_server_args(tiny_model_path) + ["--tensor-parallel-size", "2"],
                          env=ONE_THREAD)
    try:
        assert answers(server.url) == answers(tiny_server.url)
        [worker] = rank_pids(server)
        core = engine_core_pid(server)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model=TINY_MODEL_NAME, prompt="Once upon a time", max_tokens=3000,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # generating
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(Exception):  # the stream ends in an error event (the SDK raises) or a cut connection
            for _ in stream:
                pass
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() - killed < 10, "the server still says it is healthy"
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        while process_alive(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_alive(core) and not process_alive(worker)
        response = httpx.post(f"{server.url}/v1/completions", json={"model": TINY_MODEL_NAME, "prompt": "Hi"})
        assert response.status_code == 503
    finally:
        server.stop()
