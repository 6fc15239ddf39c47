"""The SSE wire format, read raw with httpx: chunk shape, finish reasons, the usage chunk, ``[DONE]``."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import TINY_MODEL_NAME  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")


def read_events(url: str, path: str, body: dict) -> list[str]:
    """The raw ``data:`` payloads of one stream, checking the framing on the way."""
    with httpx.stream("POST", url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert all(event.startswith("data: ") and "\n" not in event for event in events[:-1])
    return [event[len("data: "):] for event in events[:-1]]


def check_finish_reasons_come_last(chunks: list[dict], num_choices: int) -> dict[int, list[dict]]:
    by_index: dict[int, list[dict]] = {}
    for chunk in chunks:
        assert len(chunk["choices"]) == 1
        choice = chunk["choices"][0]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == list(range(num_choices))
    for choices in by_index.values():
        assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1]["finish_reason"] in ("stop", "length")
    return by_index


def test_completion_stream_format(tiny_server):
    body = {"model": TINY_MODEL_NAME, "prompt": ["Hello", "A much longer second prompt"], "n": 2,
            "max_tokens": 12, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = read_events(tiny_server.url, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for chunk in chunks:
        assert chunk["object"] == "text_completion" and chunk["model"] == TINY_MODEL_NAME
        assert isinstance(chunk["created"], int)
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 4 * 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "prompt_tokens_details" not in usage  # only with --enable-prompt-tokens-details, as vLLM
    by_index = check_finish_reasons_come_last(chunks, 4)
    assert all(choices[-1]["finish_reason"] == "length" for choices in by_index.values())


def test_chat_stream_format(tiny_server):
    body = {"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 6,
            "stream": True}
    events = read_events(tiny_server.url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert all(c.get("usage") is None for c in chunks)  # no usage chunk unless asked
    by_index = check_finish_reasons_come_last(chunks, 2)
    for choices in by_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert all(set(c["delta"]) <= {"content"} for c in choices[1:])


def test_non_stream_equals_stream_with_n_and_seed(tiny_server):
    body = {"model": TINY_MODEL_NAME, "prompt": "Once", "n": 3, "max_tokens": 10, "seed": 5, "temperature": 1.0}
    whole = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=120).json()
    events = read_events(tiny_server.url, "/v1/completions", {**body, "stream": True})
    streamed = {}
    for event in events[:-1]:
        choice = json.loads(event)["choices"][0]
        streamed[choice["index"]] = streamed.get(choice["index"], "") + choice["text"]
    assert [streamed[i] for i in range(3)] == [c["text"] for c in whole["choices"]]


def test_error_before_streaming_is_plain_json(tiny_server):
    body = {"model": TINY_MODEL_NAME, "prompt": "x", "top_p": 0, "stream": True}
    response = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "top_p"
