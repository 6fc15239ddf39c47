"""Anthropic's Messages API through the real ``anthropic`` SDK (and LangChain's ChatAnthropic) against a real server.

One server: the default model with ``--reasoning-parser qwen3`` and an API key. Its chat template is the model's,
except that it opens a thinking block in the prompt when ``enable_thinking`` is true (as DeepSeek-R1's does) and
closes an empty one when it is false (as Qwen3's does), so a request that asks for thinking gets thinking blocks
from a model never trained to think, and one that does not gets none.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
import schemathesis

from server.anthropic_chat import anthropic_locations, to_chat_request
from server.errors import bad_request
from server.protocol.anthropic import CountTokensRequest, MessagesRequest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import REPO_ROOT, scrape_metrics, start_server, wait_until_idle  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

MODEL = "SmolLM2-135M-Instruct"  # the README's example runs as written
API_KEY = "messages-key-81f0"
GREEDY = {"temperature": 0}  # the SDK's create() has no temperature argument any more: it goes in the body
SYSTEM = "You answer briefly."
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a French city now.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    model = tmp_path_factory.mktemp(MODEL)
    for path in Path(default_model_path).iterdir():  # the default model's files, but its template is this one's
        if path.suffix != ".gguf" and path.name != "chat_template.jinja":
            (model / path.name).symlink_to(path)
    template = (Path(default_model_path) / "chat_template.jinja").read_text()
    opener = "{{ '<|im_start|>assistant\n' }}"
    assert opener in template
    (model / "chat_template.jinja").write_text(template.replace(opener, opener + (
        "{% if enable_thinking is defined %}{{ '<think>\n' if enable_thinking else '<think>\n\n</think>\n\n' }}"
        "{% endif %}")))
    server = start_server(tmp_path_factory.mktemp("servers"), "anthropic",
                          ["--model", str(model), "--served-model-name", MODEL, "--num-kvcache-blocks", "256",
                           "--max-model-len", "1024", "--reasoning-parser", "qwen3", "--api-key", API_KEY])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# ----------------------------------------------------------------------------- the request, translated


def test_a_conversation_becomes_the_chat_request_it_amounts_to():
    request = MessagesRequest.model_validate({
        "model": MODEL, "max_tokens": 9, "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "kind"}],
        "stop_sequences": ["END"], "top_k": 5, "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Look", "cache_control": {"type": "ephemeral"}},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "iVBORw0K"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                          "content": [{"type": "text", "text": "timeout"}]},
                                         {"type": "text", "text": "And now?"}]},
            {"role": "assistant", "content": "It is"}]})
    chat = to_chat_request(request, "qwen3").body
    plain = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert plain[0] == {"role": "system", "content": "Be\nkind"}
    assert plain[1]["content"][1]["image_url"]["url"] == "data:image/png;base64,iVBORw0K"
    assert plain[2] == {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert plain[3] == {"role": "tool", "content": "Error: timeout", "tool_call_id": "toolu_1"}
    assert plain[4]["role"] == "user" and plain[5] == {"role": "assistant", "content": "It is"}
    assert chat.continue_final_message and not chat.add_generation_prompt  # prefill: the answer continues it
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert (chat.max_tokens, chat.stop, chat.top_k) == (9, ["END"], 5)
    assert chat.chat_template_kwargs == {"enable_thinking": False}  # thinking left out: not asked for
    named = CountTokensRequest.model_validate({"model": MODEL, "messages": ASK, "tools": [WEATHER],
                                               "tool_choice": {"type": "tool", "name": "get_weather"},
                                               "thinking": {"type": "adaptive"}})
    chat = to_chat_request(named, "qwen3").body
    assert chat.tool_choice.function.name == "get_weather" and chat.max_tokens is None
    assert chat.chat_template_kwargs == {"enable_thinking": True}


def test_errors_name_the_anthropic_requests_locations():
    """The chat path names its messages and parts; a system prompt and tool results shift them."""
    request = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 2, "system": "Be kind", "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"},
                                     {"type": "text", "text": "Look"},
                                     {"type": "image", "source": {"type": "url", "url": "https://host/cat.png"}}]}]})
    translation = to_chat_request(request, None)
    assert [m.role for m in translation.body.messages] == ["system", "tool", "user"]
    error = bad_request("messages.2.content.1.image_url: not fetched", param="messages.2.content.1.image_url")
    assert anthropic_locations(error, translation.origins).message == "messages.0.content.2.source: not fetched"


# ----------------------------------------------------------------------------- answers


def test_create_and_stream_answer_as_the_chat_route_does(client, server):
    before = scrape_metrics(server.url)
    kwargs = {"model": MODEL, "max_tokens": 8, "system": SYSTEM, "messages": ASK, "extra_body": GREEDY}
    message = client.messages.create(**kwargs)
    assert message.id.startswith("msg_") and message.model == MODEL and message.role == "assistant"
    assert [block.type for block in message.content] == ["text"]
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, messages=[{"role": "system", "content": SYSTEM}, *ASK],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert text_of(message) == chat.choices[0].message.content
    assert (message.stop_reason, chat.choices[0].finish_reason) == ("max_tokens", "length")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == message.usage.input_tokens
    with client.messages.stream(**kwargs) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(deltas) == text_of(final) == text_of(message)
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        message.stop_reason, message.usage.input_tokens, message.usage.output_tokens)
    after = wait_until_idle(server.url)
    finished = 'minivllm:request_success_total{finished_reason="length"}'
    assert after[finished] == before.get(finished, 0) + 3  # the two messages and the chat completion, on /metrics


def test_the_events_on_the_wire(server):
    body = {"model": MODEL, "max_tokens": 3, "messages": ASK, "stream": True}
    response = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [(event.split("\n")[0].removeprefix("event: "), json.loads(event.split("\n")[1].removeprefix("data: ")))
              for event in response.text.strip().split("\n\n")]
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and all(name == data["type"] for name, data in events)
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and delta["usage"] == {
        "output_tokens": 3}
    wait_until_idle(server.url)


def test_stop_sequences_and_max_tokens(client, server):
    long = client.messages.create(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    text = text_of(long)
    assert long.stop_reason == "max_tokens" and long.stop_sequence is None and long.usage.output_tokens == 12
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3])
    cut = client.messages.create(model=MODEL, max_tokens=12, messages=ASK, stop_sequences=[stop], extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert text_of(cut) == text[:text.index(stop)]
    wait_until_idle(server.url)


def test_a_tool_use_and_its_result_round_trip(client, server):
    forced = client.messages.create(model=MODEL, max_tokens=40, messages=ASK, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.stop_reason == "tool_use"
    (call,) = [block for block in forced.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    (piece,) = [block for block in streamed.content if block.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and piece.name == "get_weather"
    jsonschema.validate(piece.input, WEATHER["input_schema"])
    # The call goes back with its result; the model answers the whole conversation.
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees and sunny"}
    turns = [*ASK, {"role": "assistant", "content": forced.content}, {"role": "user", "content": [result]}]
    answer = client.messages.create(model=MODEL, max_tokens=8, messages=turns, tools=[WEATHER], extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    counted = client.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER])
    assert counted.input_tokens == answer.usage.input_tokens
    failed = [*turns[:2], {"role": "user", "content": [{**result, "is_error": True}]}]
    assert client.messages.count_tokens(model=MODEL, messages=failed, tools=[WEATHER]).input_tokens > \
        counted.input_tokens  # an error result reads as one ("Error: ..."), not as a plain result
    wait_until_idle(server.url)


def test_thinking_blocks_whole_and_streamed(client, server):
    kwargs = {"model": MODEL, "max_tokens": 8, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 4},
              "extra_body": GREEDY}
    whole = client.messages.create(**kwargs)
    assert whole.content[0].type == "thinking" and whole.content[0].thinking
    with client.messages.stream(**kwargs) as stream:
        thoughts = [event.thinking for event in stream if event.type == "thinking"]
        final = stream.get_final_message()
    assert "".join(thoughts) == final.content[0].thinking == whole.content[0].thinking
    assert [block.type for block in final.content] == [block.type for block in whole.content]
    off = client.messages.create(model=MODEL, max_tokens=2, messages=ASK, thinking={"type": "disabled"})
    assert [block.type for block in off.content] == ["text"]
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(model=MODEL, max_tokens=4, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 4})
    wait_until_idle(server.url)


# ----------------------------------------------------------------------------- errors


def test_errors_in_anthropics_shape(client, server):
    # messages.create() requires max_tokens before sending: the SDK's own post() sends the body without it.
    with pytest.raises(anthropic.BadRequestError) as missing:
        client.post("/v1/messages", body={"model": MODEL, "messages": ASK}, cast_to=anthropic.types.Message)
    assert missing.value.status_code == 400 and missing.value.body["type"] == "error"
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.body["error"]["message"]
    wrong = anthropic.Anthropic(base_url=server.url, api_key="not-the-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert denied.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=ASK)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    refusals = [({"container": "c"}, "container"), ({"mcp_servers": []}, "mcp_servers"),
                ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
                ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
                ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
                    "type": "base64", "media_type": "image/png", "data": "iVBORw0K"}}]}]}, "does not accept images"),
                ({"top_k": 2, "frequency_penalty": 1.0}, "frequency_penalty")]
    for extra, named in refusals:
        body = {"model": MODEL, "max_tokens": 2, "messages": ASK, **extra}
        response = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error" and named in response.text
    wait_until_idle(server.url)


def test_the_document_describes_the_answers(server):
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    auth = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    cases = [("/v1/messages", {"model": MODEL, "max_tokens": 3, "messages": ASK}, 200),
             ("/v1/messages", {"model": MODEL, "max_tokens": 3, "messages": ASK, "stream": True}, 200),
             ("/v1/messages", {"model": "nope", "max_tokens": 3, "messages": ASK}, 404),
             ("/v1/messages/count_tokens", {"model": MODEL, "messages": ASK}, 200),
             ("/v1/messages/count_tokens", {"model": MODEL, "messages": ASK, "max_tokens": 3}, 400)]
    for path, body, status in cases:
        case = api[path]["POST"].Case(body=body, media_type="application/json")
        assert case.call_and_validate(base_url=server.url, headers=auth).status_code == status
    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert doc["paths"]["/v1/messages"]["post"]["security"] == [{"APIKey": []}, {"AnthropicAPIKey": []}]
    assert json.dumps(doc["paths"]["/v1/messages"]["post"]["responses"]["400"]).count("AnthropicErrorResponse")
    wait_until_idle(server.url)


def test_langchain_chat_anthropic(server):
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    llm = langchain_anthropic.ChatAnthropic(base_url=server.url, api_key=API_KEY, model=MODEL, max_tokens=6,
                                            temperature=0, max_retries=0, timeout=60)
    answer = llm.invoke("Hello")
    assert isinstance(answer.content, str) and answer.usage_metadata["output_tokens"] <= 6
    assert answer.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    wait_until_idle(server.url)


def test_the_readme_example(server):
    (script,) = [block for block in re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
                 if "anthropic.Anthropic(" in block]
    script = script.replace("http://localhost:8000", server.url).replace('api_key="unused"', f'api_key="{API_KEY}"')
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # This server's template closes an empty thinking block before the answer, so the model starts with a newline.
    answer, _, streamed = proc.stdout.lstrip("\n").partition("\n")
    assert answer == "The capital of France is Paris." and streamed.strip()
    wait_until_idle(server.url)
