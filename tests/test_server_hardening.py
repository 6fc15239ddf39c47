"""Hostile and careless clients against a real server: nothing may freeze, flood or outlive its answer."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    TINY_MAX_MODEL_LEN,
    TINY_MODEL_NAME,
    assert_error_shape,
    scrape_metrics,
    start_server,
    tiny_server_args,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

API_KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
LIMITS = ["--max-request-body-mb", "1", "--max-choices-per-request", "16", "--max-tokens-limit", "64",
          "--request-header-timeout", "1", "--request-body-timeout", "1", "--timeout-keep-alive", "1",
          "--api-key", API_KEY]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "guarded", tiny_server_args(tiny_model_path) + LIMITS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60, headers=AUTH) as client:
        yield client


def post_raw(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """JSON with every non-ASCII character escaped, so a lone surrogate travels as ``\\ud800``."""
    return http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def health_answers_while(url: str, work) -> tuple[int, object]:
    """Run ``work()`` in a thread, probing /health meanwhile; how many probes were answered (200) while the work
    was still running, and the work's result."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", work()))
    thread.start()
    answered = 0
    with httpx.Client(timeout=30) as client:
        while thread.is_alive():
            assert client.get(f"{url}/health").status_code == 200
            answered += thread.is_alive()  # answered before the work was done
    thread.join()
    return answered, result.get("value")


# ---------------------------------------------------------------- 1. nothing half-started


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_choice_is_a_400_and_starts_nothing(tiny_server, stream):
    before = scrape_metrics(tiny_server.url)
    body = {"model": TINY_MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
            "seed": 2**63 - 1, "n": 3, "stream": stream}  # the third sample's seed, 2**63 + 1, overflows
    response = httpx.post(f"{tiny_server.url}{CMPL}", json=body, timeout=30)
    assert assert_error_shape(response, 400)["param"] == "seed"
    after = scrape_metrics(tiny_server.url)
    assert after["minivllm:num_requests_running"] == 0 and after["minivllm:num_requests_waiting"] == 0
    assert after["minivllm:generation_tokens_total"] == before["minivllm:generation_tokens_total"]


# --------------------------------------------------------------------- 2. big bodies


def test_a_body_over_the_limit_is_413_declared_or_chunked(http):
    big = {"model": TINY_MODEL_NAME, "prompt": "x" * (2 << 20)}
    assert assert_error_shape(http.post(CMPL, json=big), 413)["code"] == "request_too_large"

    def chunks():
        for _ in range(40):
            yield b" " * 65536  # 2.5 MB of whitespace, no Content-Length
    chunked = http.post(CMPL, content=chunks(), headers={"Content-Type": "application/json"})
    assert_error_shape(chunked, 413)


def test_tokenizing_a_big_prompt_does_not_block_health(guarded, http, tiny_model_path):
    """A prompt within the characters the context could hold, but far more tokens than it holds: it is tokenized
    (then refused by its token count), and /health keeps answering while the tokenizer works."""
    import transformers

    from server.text_bound import max_chars_per_token

    max_chars = TINY_MAX_MODEL_LEN * max_chars_per_token(transformers.AutoTokenizer.from_pretrained(tiny_model_path))
    sentence = "The sea is calm tonight, the tide is full. "
    prompt = sentence * (max_chars // len(sentence))
    answered, response = health_answers_while(
        guarded.url, lambda: http.post(CMPL, json={"model": TINY_MODEL_NAME, "prompt": prompt, "max_tokens": 1}))
    error = assert_error_shape(response, 400)
    assert error["code"] == "context_length_exceeded" and "prompt has" in error["message"]  # counted in tokens
    # Tokenizing it takes hundreds of times longer than a probe's round trip: probes answered meanwhile show that
    # the tokenizer did not hold the event loop.
    assert answered >= 3


# ------------------------------------------------------------------------ 3. fan-out


def test_fan_out_is_capped(http):
    body = {"model": TINY_MODEL_NAME, "prompt": ["a", "b", "c"], "n": 6, "max_tokens": 1}
    error = assert_error_shape(http.post(CMPL, json=body), 400)
    assert error["param"] == "n" and "18 choices" in error["message"]
    assert http.post(CMPL, json={**body, "n": 5}).status_code == 200
    # A chat's choices are counted before its conversation is rendered or tokenized (this one could not be).
    chat = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "\ud800"}], "n": 17, "max_tokens": 1}
    error = assert_error_shape(post_raw(http, CHAT, chat), 400)
    assert error["param"] == "n" and "17 choices" in error["message"]


# ---------------------------------------------------------------------- 4. surrogates


@pytest.mark.parametrize("path, body, param", [
    (CMPL, {"prompt": "a\ud800b"}, "prompt"),
    (CMPL, {"prompt": ["fine", "\udfff"]}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
])
def test_a_lone_surrogate_is_a_400(http, path, body, param):
    error = assert_error_shape(post_raw(http, path, {"model": TINY_MODEL_NAME, **body}), 400)
    assert error["param"] == param and "Unicode" in error["message"]


# ---------------------------------------------------------------------- 5. timeouts


def test_idle_and_slow_header_connections_are_closed(guarded):
    host, port = "127.0.0.1", guarded.port
    idle = socket.create_connection((host, port))
    slow = socket.create_connection((host, port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    start = time.monotonic()
    for sock in (idle, slow):
        sock.settimeout(5)
        assert sock.recv(1024) == b""  # closed by the server, without an answer
        sock.close()
    assert time.monotonic() - start < 3  # --request-header-timeout 1


def read_until_closed(sock: socket.socket) -> str:
    """Everything the server sends before it closes the connection (headers and body may come apart)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:  # kept open after answering: the answer is what came
        if not data:
            raise
    sock.close()
    return data.decode()


def test_a_body_that_never_arrives_is_a_408(guarded):
    sock = socket.create_connection(("127.0.0.1", guarded.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
    sock.settimeout(5)
    reply = read_until_closed(sock)
    assert reply.startswith("HTTP/1.1 408")
    assert json.loads(reply.split("\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_unparseable_requests_get_the_openai_error_shape(guarded):
    sock = socket.create_connection(("127.0.0.1", guarded.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
    sock.settimeout(5)
    reply = read_until_closed(sock)
    assert reply.startswith("HTTP/1.1 400")
    error = json.loads(reply.split("\r\n\r\n", 1)[1])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


# ------------------------------------------------------------------ 6. waiting queue


def test_waiting_queue_limit_holds_under_spaced_arrivals(tmp_path, tiny_model_path):
    args = tiny_server_args(tiny_model_path) + ["--max-num-seqs", "1", "--max-waiting-requests", "2"]
    server = start_server(tmp_path, "queue", args)
    try:
        async def scenario():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                body = {"model": TINY_MODEL_NAME, "max_tokens": 4000, "ignore_eos": True, "stream": True}
                streams, statuses = [], []
                for i in range(6):
                    response = await client.send(client.build_request("POST", CMPL, json={**body, "prompt": f"{i}"}),
                                                 stream=True)
                    statuses.append(response.status_code)
                    streams.append(response)
                    await asyncio.sleep(0.15)
                for response in streams:
                    await response.aclose()
                return statuses

        assert asyncio.run(scenario()) == [200, 200, 200, 503, 503, 503]  # one runs, two wait
        wait_until_idle(server.url)
    finally:
        server.stop()


# ---------------------------------------------------------------- 7. max_tokens ceiling


def test_max_tokens_ceiling_is_the_default_and_the_limit(http):
    body = {"model": TINY_MODEL_NAME, "prompt": "hello", "ignore_eos": True}
    usage = http.post(CMPL, json=body).json()["usage"]
    assert usage["completion_tokens"] == 16  # completions default to 16 tokens, as in OpenAI's API
    chat = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    assert http.post(CHAT, json=chat).json()["usage"]["completion_tokens"] == 64  # chat: up to the ceiling
    assert assert_error_shape(http.post(CMPL, json={**body, "max_tokens": 65}), 400)["param"] == "max_tokens"
    chat = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 65}
    assert assert_error_shape(http.post(CHAT, json=chat), 400)["param"] == "max_completion_tokens"


# -------------------------------------------------------------------- 8. stop strings


def test_stop_strings_are_bounded(http):
    body = {"model": TINY_MODEL_NAME, "prompt": "hello", "max_tokens": 2}
    assert assert_error_shape(http.post(CMPL, json={**body, "stop": [f"s{i}" for i in range(65)]}), 400)["param"] \
        == "stop"
    assert assert_error_shape(http.post(CMPL, json={**body, "stop": ["x" * 9000, "y" * 9000]}), 400)["param"] \
        == "stop"
    assert http.post(CMPL, json={**body, "stop": [f"s{i}" for i in range(64)]}).status_code == 200


# ----------------------------------------------------------------------- 9. smaller


def test_head_health_and_allow_header(http):
    assert http.head("/health").status_code == 200
    wrong = http.get(CMPL)
    assert_error_shape(wrong, 405)
    assert "POST" in wrong.headers["allow"]


def test_two_authorization_headers_are_refused(guarded):
    headers = [("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer other")]
    response = httpx.post(f"{guarded.url}{CMPL}", json={"prompt": "x", "max_tokens": 1}, headers=headers)
    assert assert_error_shape(response, 401)["code"] == "invalid_api_key"


@pytest.mark.parametrize("message, param, words", [
    ({"role": "", "content": "hi"}, "messages.0.role", "must not be empty"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages.0.content", "needs a 'text' string"),
])
def test_chat_roles_and_parts_are_checked(http, message, param, words):
    body = {"model": TINY_MODEL_NAME, "messages": [message], "max_tokens": 1}
    error = assert_error_shape(http.post(CHAT, json=body), 400)
    assert error["param"] == param and words in error["message"]


def test_developer_messages_render_as_system(http):
    def rendered(role: str) -> list[int]:
        body = {"model": TINY_MODEL_NAME, "messages": [{"role": role, "content": "Be brief."},
                                                        {"role": "user", "content": "hi"}]}
        return http.post("/tokenize", json=body).json()["tokens"]

    assert rendered("developer") == rendered("system")
