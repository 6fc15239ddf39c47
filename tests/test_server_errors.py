"""Bad input, table-driven: every error has its status and OpenAI's error shape, and none leaks a KV block."""

from __future__ import annotations

import httpx
import openai
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    TINY_MAX_MODEL_LEN,
    TINY_MODEL_NAME,
    assert_error_shape,
    start_server,
    tiny_server_args,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]
TOO_LONG = list(range(1, TINY_MAX_MODEL_LEN + 11))

# (id, method, path, JSON body or raw bytes, status, param expected in the error (None: don't check))
BAD_REQUESTS = [
    ("malformed-json", "POST", CMPL, b'{"prompt": "x",', 400, None),
    ("body-not-an-object", "POST", CMPL, b"[1, 2, 3]", 400, None),
    ("missing-prompt", "POST", CMPL, {"max_tokens": 3}, 400, "prompt"),
    ("missing-messages", "POST", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("prompt-wrong-type", "POST", CMPL, {"prompt": 5}, 400, "prompt"),
    ("prompt-mixed-list", "POST", CMPL, {"prompt": ["a", 1]}, 400, "prompt"),
    ("temperature-wrong-type", "POST", CMPL, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("max-tokens-wrong-type", "POST", CMPL, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("stream-wrong-type", "POST", CMPL, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("messages-wrong-type", "POST", CHAT, {"messages": "hello"}, 400, "messages"),
    ("temperature-negative", "POST", CMPL, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top-p-zero", "POST", CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n-zero", "POST", CMPL, {"prompt": "x", "n": 0}, 400, "n"),
    ("n-huge", "POST", CMPL, {"prompt": "x", "n": 100000}, 400, "n"),
    ("logprobs-21", "POST", CMPL, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("top-logprobs-21", "POST", CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("top-logprobs-without-logprobs", "POST", CHAT, {"messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs"),
    ("max-tokens-zero", "POST", CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max-completion-tokens-zero", "POST", CHAT, {"messages": HELLO, "max_completion_tokens": 0}, 400,
     "max_tokens"),
    ("min-tokens-above-max", "POST", CMPL, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("presence-penalty-3", "POST", CMPL, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("seed-too-big", "POST", CMPL, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("top-k-too-big", "POST", CMPL, {"prompt": "x", "top_k": 2**40}, 400, "top_k"),
    ("empty-stop-string", "POST", CMPL, {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("token-id-out-of-vocab", "POST", CMPL, {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ("token-id-negative", "POST", CMPL, {"prompt": [[1, -5]]}, 400, "prompt"),
    ("prompt-too-long", "POST", CMPL, {"prompt": TOO_LONG}, 400, "prompt"),
    ("prompt-plus-max-tokens-too-long", "POST", CMPL, {"prompt": "x", "max_tokens": TINY_MAX_MODEL_LEN}, 400,
     "max_tokens"),
    ("empty-prompt", "POST", CMPL, {"prompt": ""}, 400, "prompt"),
    ("empty-prompt-list", "POST", CMPL, {"prompt": []}, 400, "prompt"),
    ("empty-messages", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("image-content-part", "POST", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages.0.content"),
    ("unknown-model", "POST", CMPL, {"model": "gpt-17", "prompt": "x"}, 404, "model"),
    ("unknown-model-chat", "POST", CHAT, {"model": "gpt-17", "messages": HELLO}, 404, "model"),
    ("unknown-model-stream", "POST", CMPL, {"model": "gpt-17", "prompt": "x", "stream": True}, 404, "model"),
    ("bad-param-stream", "POST", CMPL, {"prompt": "x", "temperature": -1, "stream": True}, 400, "temperature"),
    ("stream-options-without-stream", "POST", CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("stream-options-without-stream-chat", "POST", CHAT, {"messages": HELLO, "stream_options": {}}, 400,
     "stream_options"),
    ("unknown-route", "POST", "/v1/nothing-here", {"prompt": "x"}, 404, None),
    ("unknown-route-get", "GET", "/nothing", None, 404, None),
    ("wrong-method", "GET", CMPL, None, 405, None),
    ("tokenize-nothing", "POST", "/tokenize", {}, 400, "prompt"),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [10**7]}, 400, "tokens"),
]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        yield client


def send(http: httpx.Client, method: str, path: str, body, headers=None) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json", **(headers or {})}
        return http.request(method, path, content=body, headers=headers)
    return http.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("name,method,path,body,status,param", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
def test_bad_request(http, name, method, path, body, status, param):
    error = assert_error_shape(send(http, method, path, body), status)
    if param is not None:
        assert error["param"] == param, error


def test_prompt_too_long_names_its_length_and_the_limit(http):
    error = assert_error_shape(send(http, "POST", CMPL, {"prompt": TOO_LONG}), 400)
    assert str(len(TOO_LONG)) in error["message"] and str(TINY_MAX_MODEL_LEN) in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_unknown_model_code(http):
    error = assert_error_shape(send(http, "POST", CMPL, {"model": "gpt-17", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize("path, field, value", [
    (CMPL, "best_of", 2), (CMPL, "suffix", "the end"), (CMPL, "some_future_field", {"a": 1}),
    (CHAT, "audio", {"voice": "alloy"}), (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "modalities", ["text"]),
])
def test_unimplemented_and_unknown_fields_are_400s_naming_them(http, path, field, value):
    body = {"model": TINY_MODEL_NAME, "max_tokens": 2, field: value}
    body.update({"prompt": "x"} if path == CMPL else {"messages": HELLO})
    error = assert_error_shape(send(http, "POST", path, body), 400)
    assert error["param"] == field and field in error["message"]


def test_openai_metadata_fields_are_accepted_and_unused(http):
    body = {"model": TINY_MODEL_NAME, "prompt": "x", "max_tokens": 2, "user": "me", "metadata": {"job": "1"},
            "store": False, "service_tier": "auto"}
    response = send(http, "POST", CMPL, body)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "text_completion"


def test_no_block_leaks_after_the_table(http, tiny_server):
    """Every refused request of the table leaves the pool as it was."""
    for _, method, path, body, status, _ in BAD_REQUESTS:
        assert send(http, method, path, body).status_code == status
    metrics = wait_until_idle(tiny_server.url, timeout_s=10)
    assert metrics["minivllm:num_requests_running"] == 0
    assert metrics["minivllm:num_requests_waiting"] == 0
    assert metrics["minivllm:kv_cache_blocks_used"] == 0
    assert metrics["minivllm:kv_cache_usage_perc"] == 0
    response = send(http, "POST", CMPL, {"prompt": "still fine", "max_tokens": 3})
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------------ API key

API_KEY = "sk-test-4f7c2a"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, tiny_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "keyed",
                          tiny_server_args(tiny_model_path) + ["--api-key", API_KEY])
    yield server
    server.stop()


@pytest.mark.parametrize("headers", [None, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": "Basic " + API_KEY}], ids=["missing", "wrong", "no-scheme",
                                                                                  "basic"])
@pytest.mark.parametrize("method,path,body", [("POST", CMPL, {"prompt": "x", "max_tokens": 2}),
                                              ("POST", CHAT, {"messages": HELLO, "max_tokens": 2}),
                                              ("GET", "/v1/models", None),
                                              ("POST", "/tokenize", {"prompt": "x"}),
                                              ("POST", "/detokenize", {"tokens": [1]}),
                                              ("POST", CMPL, b"{not json")])
def test_api_key_required(keyed_server, headers, method, path, body):
    with httpx.Client(base_url=keyed_server.url, timeout=60) as http:
        error = assert_error_shape(send(http, method, path, body, headers=headers), 401)
    assert error["code"] == "invalid_api_key"


def test_api_key_accepted_and_open_routes(keyed_server):
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=TINY_MODEL_NAME, prompt="x", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="nope", max_retries=0).models.list()
    with httpx.Client(base_url=keyed_server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        assert http.get("/version").status_code == 200
        auth = {"Authorization": f"Bearer {API_KEY}"}
        assert http.post("/tokenize", json={"prompt": "hi"}, headers=auth).json()["count"] >= 1
