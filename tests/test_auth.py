"""``--api-key`` protects every API route, whatever prefix, proxy or socket a request comes through.

Two real servers: one on TCP with ``--root-path /llm`` (reached with the prefix, without it, and
through a reverse proxy that strips it), one on a Unix socket without a prefix.
"""

from __future__ import annotations

import socket
import threading

import httpx
import openai
import pytest
import uvicorn

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    TINY_MODEL_NAME,
    assert_error_shape,
    free_port,
    start_server,
    tiny_server_args,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

API_KEY = "auth-test-key-5c1e"
PREFIX = "/llm"
HELLO = [{"role": "user", "content": "Hello"}]

# Every protected route, with a request it answers 200 to when the key is right.
PROTECTED = [
    ("POST", "/v1/completions", {"model": TINY_MODEL_NAME, "prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": TINY_MODEL_NAME, "messages": HELLO, "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{TINY_MODEL_NAME}", None),
    ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/tokenizer_info", None),
    ("POST", "/invocations", {"model": TINY_MODEL_NAME, "prompt": "x", "max_tokens": 1}),
]
PROTECTED_IDS = [f"{method} {path}" for method, path, _ in PROTECTED]
KEYS = {"no-key": {}, "wrong-key": {"Authorization": "Bearer not-the-key"},
        "right-key": {"Authorization": f"Bearer {API_KEY}"}}
OPEN = ["/health", "/metrics", "/dashboard", "/version", "/load"]


class StrippingProxy:
    """A reverse proxy in this process that serves the server under PREFIX and strips it before
    forwarding, as nginx's ``location /llm/ { proxy_pass http://server/; }`` does."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.url = f"http://127.0.0.1:{free_port()}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]), log_level="warning",
                                access_log=False, interface="asgi3")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> StrippingProxy:
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "the proxy did not start"
            self.thread.join(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if not path.startswith(PREFIX + "/"):
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"not under the prefix"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        query = scope["query_string"].decode()
        url = self.upstream + path[len(PREFIX):] + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"host", b"connection")]
        async with httpx.AsyncClient(timeout=60) as client:
            async with client.stream(scope["method"], url, headers=headers, content=body) as response:
                hop_by_hop = (b"transfer-encoding", b"connection")
                kept = [(k, v) for k, v in response.headers.raw if k.lower() not in hop_by_hop]
                await send({"type": "http.response.start", "status": response.status_code, "headers": kept})
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})


@pytest.fixture(scope="module")
def prefixed(tmp_path_factory, tiny_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "auth-prefixed",
                          tiny_server_args(tiny_model_path) + ["--api-key", API_KEY, "--root-path", PREFIX])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def on_socket(tmp_path_factory, tiny_model_path):
    tmp = tmp_path_factory.mktemp("servers")
    path = tmp / "s.sock"
    with socket.socket(socket.AF_UNIX) as stale:  # left behind by a server that crashed: replaced
        stale.bind(str(path))
    server = start_server(tmp, "auth-uds", tiny_server_args(tiny_model_path) + ["--api-key", API_KEY,
                                                                                "--uds", str(path)])
    yield server
    server.stop()
    assert not path.exists()  # removed on the way out


@pytest.fixture(scope="module")
def proxy(prefixed):
    with StrippingProxy(prefixed.url) as running:
        yield running


def check_route(client: httpx.Client, base: str, method: str, path: str, body: dict | None, key: str) -> None:
    response = client.request(method, base + path, json=body, headers=KEYS[key])
    if key == "right-key":
        assert response.status_code == 200, response.text
        return
    error = assert_error_shape(response, 401)
    assert error["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"
    assert TINY_MODEL_NAME not in response.text


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("method, path, body", PROTECTED, ids=PROTECTED_IDS)
@pytest.mark.parametrize("way", ["with-prefix", "without-prefix", "stripping-proxy"])
def test_protected_routes_under_a_root_path(prefixed, proxy, way, method, path, body, key):
    base = {"with-prefix": prefixed.url + PREFIX, "without-prefix": prefixed.url,
            "stripping-proxy": proxy.url + PREFIX}[way]
    with httpx.Client(timeout=60) as client:
        check_route(client, base, method, path, body, key)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("method, path, body", PROTECTED, ids=PROTECTED_IDS)
def test_protected_routes_on_a_unix_socket(on_socket, method, path, body, key):
    with on_socket.client(timeout=60) as client:
        check_route(client, "", method, path, body, key)


@pytest.mark.parametrize("base", ["", PREFIX])
def test_the_sdk_with_and_without_the_prefix(prefixed, base):
    """vLLM's test_root_path: the client's base URL may name the prefix or not; the key decides."""
    url = f"{prefixed.url}{base}/v1"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="abc", max_retries=0).chat.completions.create(
            model=TINY_MODEL_NAME, messages=HELLO, max_tokens=1)
    client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=TINY_MODEL_NAME, messages=HELLO, max_tokens=2)
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens <= 2


def test_open_routes_stay_open(prefixed, proxy, on_socket):
    with httpx.Client(timeout=30) as client:
        for base in (prefixed.url, prefixed.url + PREFIX, proxy.url + PREFIX):
            for path in OPEN:
                assert client.get(base + path).status_code == 200, base + path
    with on_socket.client(timeout=30) as client:
        for path in OPEN:
            assert client.get(path).status_code == 200, path


@pytest.mark.parametrize("base", ["", PREFIX])
def test_unknown_routes_and_methods_reveal_nothing_without_the_key(prefixed, base):
    auth = KEYS["right-key"]
    with httpx.Client(base_url=prefixed.url + base, timeout=30) as client:
        # A model the server does not serve: the route is protected, so no key learns nothing about it.
        assert_error_shape(client.get("/v1/models/another-model"), 401)
        assert_error_shape(client.get("/v1/models/another-model", headers=auth), 404)
        # A protected route with the wrong method: 401 first, 405 only with the key.
        assert_error_shape(client.get("/v1/completions"), 401)
        assert_error_shape(client.get("/v1/completions", headers=auth), 405)
        # No such route: a 404 that names only the path asked for.
        missing = client.post("/v1/audio/transcriptions", json={"input": "x"})
        assert "/v1/audio/transcriptions" in assert_error_shape(missing, 404)["message"]
        assert TINY_MODEL_NAME not in missing.text
        assert "/llm/llm" not in missing.text


def test_the_openapi_document_marks_the_protected_routes(prefixed):
    doc = httpx.get(f"{prefixed.url}{PREFIX}/openapi.json", timeout=30).json()
    assert {"url": PREFIX} in doc["servers"]
    assert doc["components"]["securitySchemes"]["APIKey"] == {"type": "http", "scheme": "bearer"}
    for method, path, _ in PROTECTED:
        documented = path.replace(TINY_MODEL_NAME, "{model_id}")
        assert doc["paths"][documented][method.lower()]["security"] == [{"APIKey": []}], path
    for path in OPEN:
        assert "security" not in doc["paths"][path]["get"], path


def test_a_streamed_completion_through_the_proxy(proxy):
    """The proxy is a real one: a stream arrives through it event by event, ending with [DONE]."""
    client = openai.OpenAI(base_url=f"{proxy.url}{PREFIX}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    chunks = list(client.completions.create(model=TINY_MODEL_NAME, prompt="x", max_tokens=3, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("request_line, status", [("POST /v1/audio/transcriptions", 404),
                                                  ("POST /llm/no/such/route", 404),
                                                  ("PUT /v1/completions", 405), ("DELETE /llm/tokenize", 405)])
def test_unknown_routes_and_methods_are_answered_without_reading_the_body(prefixed, request_line, status):
    """A body announced and never sent: the 404 or 405 comes at once. A server that buffered the body
    first would wait for it (and answer 408 after --request-body-timeout, 60 s, past this test's wait)."""
    head = (f"{request_line} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", prefixed.port), timeout=30) as conn:
        conn.sendall(head.encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = conn.recv(65536)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(f"HTTP/1.1 {status} ".encode()), reply


def test_the_model_card_names_no_local_path(prefixed, tiny_model_path):
    auth = KEYS["right-key"]
    listed = httpx.get(f"{prefixed.url}/v1/models", headers=auth, timeout=30)
    one = httpx.get(f"{prefixed.url}/v1/models/{TINY_MODEL_NAME}", headers=auth, timeout=30)
    for response, card in ((listed, listed.json()["data"][0]), (one, one.json())):
        assert str(tiny_model_path) not in response.text and tiny_model_path.name not in response.text
        assert card["id"] == card["root"] == TINY_MODEL_NAME
        assert card["object"] == "model" and card["max_model_len"] == 4096
        assert card["input_modalities"] == ["text"]
