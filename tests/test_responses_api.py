"""OpenAI's Responses API through the real ``openai`` SDK (and the OpenAI Agents SDK) against a real server: the
default model's session server, so this file starts none of its own."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import wait_until_idle  # noqa: E402

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

    cut = client.responses.create(model=model, input=FRANCE, instructions="Answer briefly.", temperature=0,
                                  max_output_tokens=3, store=False)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.usage.output_tokens == 3 and cut.instructions
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(cut.id)  # store=False: nothing kept
    wait_until_idle(default_server.url)


def test_the_events_on_the_wire(default_server):
    body = {"input": FRANCE, "max_output_tokens": 3, "stream": True}
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
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
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
                                      temperature=0, max_output_tokens=8)
    items = [{"role": "user", "content": ask}, {"type": "function_call", "call_id": call.call_id,
                                                 "name": call.name, "arguments": call.arguments}, result]
    resent = client.responses.create(model=model, input=items, tools=[WEATHER], temperature=0, max_output_tokens=8)
    assert chained.output_text == resent.output_text and chained.output_text
    assert chained.usage.input_tokens == resent.usage.input_tokens
    assert chained.previous_response_id == forced.id
    wait_until_idle(default_server.url)


def test_text_format_json_schema(client, default_server):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    response = client.responses.create(model=model_of(client), input=FRANCE, max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"
    wait_until_idle(default_server.url)


def test_get_and_delete_a_stored_response(client, default_server):
    response = client.responses.create(model=model_of(client), input=FRANCE, max_output_tokens=2,
                                       metadata={"run": "1"})
    got = client.responses.retrieve(response.id)
    assert got.id == response.id and got.output_text == response.output_text and got.metadata == {"run": "1"}
    deleted = httpx.delete(f"{default_server.url}/v1/responses/{response.id}", timeout=10)
    assert deleted.json() == {"id": response.id, "object": "response", "deleted": True}
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
                ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
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
                         model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=24,
                                                             temperature=0))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert isinstance(result.final_output, str) and result.final_output
    wait_until_idle(default_server.url)
