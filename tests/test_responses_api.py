"""OpenAI's Responses API through the real ``openai`` SDK (and the OpenAI Agents SDK) against a real server: the
default model's session server, so this file starts none of its own."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from server.errors import bad_request
from server.protocol import ChatCompletionChunk, ChatStreamChoice, DeltaFunctionCall, DeltaMessage, DeltaToolCall
from server.protocol.responses import ResponsesRequest
from server.response_store import ResponseStore
from server.response_view import ResponseView, responses_sse
from server.responses_chat import input_items, responses_locations, to_chat_request

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import REPO_ROOT, wait_until_idle  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

FRANCE = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a French city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon"]}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def model_of(client) -> str:
    return client.models.list().data[0].id


# ----------------------------------------------------------------------------- without a server


def test_items_become_the_chat_conversation_they_amount_to():
    earlier = input_items(ResponsesRequest.model_validate({"input": "Hi"}))
    request = ResponsesRequest.model_validate({"instructions": "Be brief.", "tools": [WEATHER], "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
        "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 5,
        "text": {"format": {"type": "json_object"}}})
    translation = to_chat_request(request, earlier, stream=False)
    chat = translation.body
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Use tools."},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    assert translation.origins == ["instructions", "previous_response_id", "input.0", "input.1", "input.4"]
    assert chat.tool_choice.function.name == "get_weather" and chat.max_completion_tokens == 5
    assert chat.response_format.type == "json_object" and chat.tools[0].function.name == "get_weather"
    error = bad_request("messages.4.content: too long", param="messages.4.content")
    assert responses_locations(error, translation.origins).message == "input.4.content: too long"


def test_the_store_is_bounded_by_count_size_and_age():
    now = [0.0]
    store = ResponseStore(max_responses=2, max_chars=100, ttl_s=10, clock=lambda: now[0])
    for name in "abc":
        store.put(name, "{}", [], [], 10)
    assert store.get("a") is None and store.get("b") is not None  # "a" was the least recently used
    store.put("d", "{}", [], [], 10)
    assert store.get("c") is None and store.get("b") is not None  # reading "b" kept it
    store.put("big", "{}", [], [], 95)
    assert len(store) == 1 and store.get("big") is not None
    store.check_invariants()
    now[0] = 11.0
    assert store.get("big") is None and len(store) == 0 and not store.delete("big")
    store.check_invariants()


def test_reasoning_and_calls_stream_as_items():
    """The events for a reasoning model's thinking, its answer and a call, as the chat path's chunks give them."""
    def chunk(finish=None, **delta):
        return ChatCompletionChunk(id="resp-1", model="m", choices=[ChatStreamChoice(
            index=0, delta=DeltaMessage(**delta), finish_reason=finish)])

    async def chunks():
        for piece in ("Hm", "m."):
            yield chunk(reasoning=piece)
        yield chunk(content="Checking.")
        yield chunk(tool_calls=[DeltaToolCall(index=0, id="call_1", type="function",
                                              function=DeltaFunctionCall(name="f", arguments=""))])
        yield chunk(tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments="{}"))],
                    finish="tool_calls")

    usage = SimpleNamespace(prompt_tokens=4, completion_tokens=6, cached_tokens=0)
    chat = SimpleNamespace(id="resp-1", chunks=chunks, generation=SimpleNamespace(usage=lambda: usage))

    async def in_tokenizer_thread(fn, tokenizer, text, *args):
        return text.split("m")  # "Hmm." -> 3 "tokens"

    ctx = SimpleNamespace(model=SimpleNamespace(name="m"), tokenizer=None, in_tokenizer_thread=in_tokenizer_thread)
    view = ResponseView(ctx, ResponsesRequest(input="hi"), chat)

    async def run():
        return [event async for event in responses_sse(view.events())]

    events = [json.loads(event.split("\n")[1].removeprefix("data: ")) for event in asyncio.run(run())]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    names = [e["type"].removeprefix("response.") for e in events]
    assert names == ["created", "in_progress", "output_item.added", "content_part.added", "reasoning_text.delta",
                     "reasoning_text.delta", "reasoning_text.done", "content_part.done", "output_item.done",
                     "output_item.added", "content_part.added", "output_text.delta", "output_text.done",
                     "content_part.done", "output_item.done", "output_item.added", "function_call_arguments.delta",
                     "function_call_arguments.done", "output_item.done", "completed"]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Hmm."}]
    assert final["output"][2]["arguments"] == "{}" and final["output"][2]["call_id"] == "call_1"
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3} and final["status"] == "completed"


# ----------------------------------------------------------------------------- against the server


def test_create_and_stream_answer_as_the_chat_route_does(client, default_server):
    model = model_of(client)
    response = client.responses.create(model=model, input=FRANCE, temperature=0, max_output_tokens=16)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": FRANCE}],
                                          temperature=0, max_tokens=16)
    assert response.output_text == chat.choices[0].message.content == "The capital of France is Paris."
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert (response.temperature, response.max_output_tokens, response.store) == (0, 16, True)

    with client.responses.stream(model=model, input=FRANCE, temperature=0, max_output_tokens=16) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == response.output_text
    assert final.status == "completed" and final.usage.output_tokens == response.usage.output_tokens
    wait_until_idle(default_server.url)


def test_the_events_on_the_wire(default_server):
    body = {"input": FRANCE, "instructions": "Answer briefly.", "max_output_tokens": 3, "stream": True, "store": False}
    response = httpx.post(f"{default_server.url}/v1/responses", json=body, timeout=60)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [(event.split("\n")[0].removeprefix("event: "), json.loads(event.split("\n")[1].removeprefix("data: ")))
              for event in response.text.strip().split("\n\n")]
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)
    cut = events[-1][1]["response"]
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete" and cut["usage"]["output_tokens"] == 3 and cut["instructions"]
    assert httpx.get(f"{default_server.url}/v1/responses/{cut['id']}").status_code == 404  # store false: not kept
    wait_until_idle(default_server.url)


def test_a_function_call_and_its_output_round_trip(client, default_server):
    model = model_of(client)
    ask = "What is the weather in Paris?"
    forced = client.responses.create(model=model, input=ask, tools=[WEATHER], max_output_tokens=24,
                                     tool_choice={"type": "function", "name": "get_weather"})
    (call,) = forced.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(model=model, input=ask, tools=[WEATHER], max_output_tokens=24,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        pieces = [event.delta for event in stream if event.type == "response.function_call_arguments.delta"]
        streamed = stream.get_final_response()
    (piece,) = streamed.output
    assert piece.type == "function_call" and "".join(pieces) == piece.arguments
    jsonschema.validate(json.loads(piece.arguments), WEATHER["parameters"])

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
    chained = client.responses.create(model=model, previous_response_id=forced.id, input=[result], tools=[WEATHER],
                                      temperature=0, max_output_tokens=4)
    items = [{"role": "user", "content": ask}, {"type": "function_call", "call_id": call.call_id,
                                                 "name": call.name, "arguments": call.arguments}, result]
    resent = client.responses.create(model=model, input=items, tools=[WEATHER], temperature=0, max_output_tokens=4)
    assert chained.output_text == resent.output_text and chained.output_text
    assert chained.usage.input_tokens == resent.usage.input_tokens
    assert chained.previous_response_id == forced.id
    wait_until_idle(default_server.url)


def test_text_format_json_schema(client, default_server):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]}},
              "required": ["capital"], "additionalProperties": False}
    response = client.responses.create(model=model_of(client), input=FRANCE, max_output_tokens=24, text={
        "format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
    wait_until_idle(default_server.url)


def test_the_readme_example(default_server):
    """The README's example, as written but for the port: a response, then one that continues it."""
    (script,) = [block for block in re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
                 if "client.responses.create(" in block]
    script = script.replace("http://localhost:8000", default_server.url)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    answer, _, again = proc.stdout.partition("\n")
    assert answer == "The capital of France is Paris." and again.strip()
    wait_until_idle(default_server.url)


def test_get_and_delete_a_stored_response(client, default_server):
    response = client.responses.create(model=model_of(client), input=FRANCE, max_output_tokens=2,
                                       metadata={"run": "1"})
    got = client.responses.retrieve(response.id)
    assert got.id == response.id and got.output_text == response.output_text and got.metadata == {"run": "1"}
    doc = httpx.get(f"{default_server.url}/openapi.json", timeout=10).json()
    stored = httpx.get(f"{default_server.url}/v1/responses/{response.id}", timeout=10).json()
    deleted = httpx.delete(f"{default_server.url}/v1/responses/{response.id}", timeout=10)
    assert deleted.json() == {"id": response.id, "object": "response", "deleted": True}
    for body, name in ((stored, "ResponseObject"), (deleted.json(), "DeletedResponse")):  # the document is true
        jsonschema.validate(body, {"$ref": f"#/components/schemas/{name}", "components": doc["components"]})
    post = doc["paths"]["/v1/responses"]["post"]
    assert set(post["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert {"400", "404"} <= set(post["responses"]) and "404" in doc["paths"]["/v1/responses/{response_id}"]["get"][
        "responses"]
    for call in (lambda: client.responses.retrieve(response.id), lambda: client.responses.delete(response.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_errors_in_openais_shape(client, default_server):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model=model_of(client), input="hi", previous_response_id="resp_nope")
    assert unknown.value.body["param"] == "previous_response_id"
    refusals = [({"tools": [{"type": "web_search"}]}, "web_search"), ({"background": True}, "background"),
                ({"reasoning": {"effort": "low"}}, "reasoning"), ({"truncation": "auto"}, "truncation"),
                ({"include": ["reasoning.encrypted_content"]}, "include"), ({"prompt": {"id": "p"}}, "prompt"),
                ({"frequency_penalty": 1.0}, "frequency_penalty"),
                ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference' items"),
                ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
                ({"text": {"verbosity": "low"}}, "text.verbosity"), ({"conversation": "c"}, "conversation"),
                ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0")]
    for extra, named in refusals:
        response = httpx.post(f"{default_server.url}/v1/responses", json={"input": "hi", **extra}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and named in error["message"], (extra, error)


def test_an_agent_calls_its_tool(client, default_server):
    """The OpenAI Agents SDK (its default model, OpenAIResponsesModel): the forced first turn calls the tool, the
    SDK runs it and sends the call and its output back as input items, and the model answers."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a French city now."""
        calls.append(city)
        return "18 degrees and sunny"

    model = agents.OpenAIResponsesModel(model=model_of(client), openai_client=openai.AsyncOpenAI(
        base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0))
    agent = agents.Agent(name="weather", instructions="You answer briefly.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=12,
                                                             temperature=0))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert isinstance(result.final_output, str) and result.final_output
    wait_until_idle(default_server.url)
