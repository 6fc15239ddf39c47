"""Tool calls and reasoning through a real server and the official ``openai`` SDK.

A tiny random-weight model with a Qwen-style chat template (Hermes calls, <think> blocks) and the
default model: whatever the weights write, forced calls validate against their tool's schema,
streamed calls reassemble to the non-streamed ones, and thinking is split off the answer.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    DEFAULT_MODEL_NAME,
    assert_error_shape,
    build_tiny_model,
    start_server,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

MODEL = "tiny-qwen-style"
CHAT = "/v1/chat/completions"
# Bounded values, so a random-weight model closes every call well within max_tokens. (No maxLength
# on strings: xgrammar lets raw control characters into length-bounded strings, and named-function
# arguments are passed on as written.)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def qwen_style_model(tmp_path_factory, default_model_path):
    from pathlib import Path
    return build_tiny_model(tmp_path_factory.mktemp(MODEL), Path(default_model_path), qwen_style=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory, qwen_style_model):
    server = start_server(tmp_path_factory.mktemp("servers"), "tools",
                          ["--model", str(qwen_style_model), "--served-model-name", MODEL,
                           "--num-kvcache-blocks", "1024", "--max-model-len", "4096", "--reasoning-parser", "qwen3"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def token_id(server, text: str) -> int:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def assert_valid_calls(message, names=tuple(SCHEMAS)):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def reassemble(chunks) -> tuple[str, str, list[dict], list[str | None]]:
    """A stream's reasoning, content, tool calls (by index) and finish reasons."""
    reasoning, content, calls, finishes = "", "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                if piece.index not in calls:  # a call's first piece has its id, type and name
                    assert piece.id and piece.type == "function" and piece.function.name, piece
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None, piece
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    return reasoning, content, [calls[i] for i in sorted(calls)], finishes


# ----------------------------------------------------------------------------- forced calls


def test_required_calls_are_tools_with_valid_arguments(client):
    # One call each: random weights would write arrays of parallel calls of any length (the default
    # model's test below lets them be parallel).
    for seed in range(6):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=1.0, seed=seed,
                                               max_tokens=400, extra_body=NO_THINKING)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert_valid_calls(choice.message)
        assert len(choice.message.tool_calls) == 1


def test_named_function_gets_arguments_for_its_schema(client):
    for seed in range(4):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                               tool_choice={"type": "function", "function": {"name": "add"}},
                                               max_tokens=400, extra_body=NO_THINKING)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"  # a forced function ends with "stop", as OpenAI and vLLM say
        assert [c.function.name for c in choice.message.tool_calls] == ["add"]
        assert_valid_calls(choice.message, names=("add",))


def test_default_model_required_and_named_calls(default_server):
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=ASK, tools=TOOLS,
                                               tool_choice=choice, temperature=0, max_tokens=200)
        assert reply.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
        assert_valid_calls(reply.choices[0].message)
        if choice != "required":
            assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"


# Under "auto" the model writes calls in its own format. A random-weight model does not, so the
# output is forced with a regex (structured outputs apply under "auto" too): the parser reads it.
FORCED_CALL = ('Let me check\\.\n<tool_call>\n\\{"name": "get_weather", "arguments": '
               '\\{"city": "Paris", "unit": "celsius"\\}\\}\n</tool_call>\n<tool_call>\n'
               '\\{"name": "add", "arguments": \\{"a": 2, "b": 3\\}\\}\n</tool_call>')


def test_auto_reads_calls_in_the_models_format(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                           extra_body={"structured_outputs": {"regex": FORCED_CALL}, **NO_THINKING})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 2, "b": 3})]


def test_auto_without_a_call_is_content(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=20,
                                           extra_body={"structured_outputs": {"regex": "It is sunny\\."},
                                                       **NO_THINKING})
    choice = reply.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("It is sunny.", None, "stop")


def test_strict_tool_under_auto_is_constrained(client, server):
    # Pushing the call marker makes the random model open a call at once; strict keeps it valid,
    # and without parallel calls the output ends after it.
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    marker = token_id(server, "<tool_call>")
    for seed in range(4):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[strict], temperature=1.0,
                                               seed=seed, max_tokens=300, parallel_tool_calls=False,
                                               logit_bias={str(marker): 100}, extra_body=NO_THINKING)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        assert_valid_calls(choice.message, names=("get_weather",))


@pytest.mark.parametrize("how", ["required", "named", "auto"])
def test_streamed_calls_reassemble_to_the_same_calls(client, how):
    extra = dict(NO_THINKING)
    kwargs = {"tools": TOOLS, "temperature": 1.0, "seed": 7, "max_tokens": 400}
    if how == "required":
        kwargs.update(tool_choice="required", parallel_tool_calls=False)
    elif how == "named":
        kwargs["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    else:
        extra["structured_outputs"] = {"regex": FORCED_CALL}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra, **kwargs).choices[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True, extra_body=extra, **kwargs))
    _, content, calls, finishes = reassemble(chunks)
    assert finishes == ["stop" if how == "named" else "tool_calls"] == [whole.finish_reason]
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # The SDK's own stream helper puts the same calls together.
    with client.chat.completions.stream(model=MODEL, messages=ASK, extra_body=extra, **kwargs) as stream:
        final = stream.get_final_completion().choices[0].message
    assert [(c.function.name, c.function.arguments) for c in final.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls]


# ----------------------------------------------------------------------------- references, cut-off and compact calls


# Parameters with references: pydantic's "$defs", the older "definitions", and a pointer into the parameters
# themselves. Nested in the "required" array as they are, every one of them would point at the array.
REFS = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object",
    "properties": {"when": {"$ref": "#/$defs/Time"}, "repeat": {"$ref": "#/definitions/Days"},
                   "snooze": {"$ref": "#/properties/when"}},
    "required": ["when", "repeat", "snooze"], "additionalProperties": False,
    "$defs": {"Time": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                                         "half": {"type": "boolean"}},
                       "required": ["hour", "half"], "additionalProperties": False}},
    "definitions": {"Days": {"enum": ["never", "weekdays", "daily"]}}}}}
# Another tool with a definition of the same name: hoisted side by side, neither may shadow the other.
CLASH = {"type": "function", "function": {"name": "ring", "parameters": {
    "type": "object", "properties": {"how": {"$ref": "#/$defs/Time"}}, "required": ["how"],
    "additionalProperties": False, "$defs": {"Time": {"enum": ["now", "later"]}}}}}
REF_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (REFS, CLASH)}


@pytest.mark.parametrize("how", ["required", "named"])
def test_parameters_with_references_are_forced_calls(client, how):
    choice = "required" if how == "required" else {"type": "function", "function": {"name": "set_alarm"}}
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[REFS, CLASH], tool_choice=choice,
                                               parallel_tool_calls=False, temperature=1.0, seed=seed,
                                               max_tokens=400, extra_body=NO_THINKING)
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == ("tool_calls" if how == "required" else "stop")
        assert len(calls) == 1 and (how == "required" or calls[0].function.name == "set_alarm")
        jsonschema.validate(json.loads(calls[0].function.arguments), REF_SCHEMAS[calls[0].function.name])


@pytest.mark.parametrize("how", ["required", "named"])
def test_one_token_is_no_call(client, how):
    """vLLM's test_max_tokens_with_tool_choice_required: cut before any call is written, there is none."""
    choice = "required" if how == "required" else {"type": "function", "function": {"name": "set_alarm"}}
    kwargs = {"model": MODEL, "messages": ASK, "tools": [REFS, CLASH], "tool_choice": choice, "temperature": 0,
              "max_completion_tokens": 1, "extra_body": NO_THINKING}
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert (choice.finish_reason, choice.message.tool_calls, choice.message.content) == ("length", None, None)
    _, content, calls, finishes = reassemble(client.chat.completions.create(stream=True, **kwargs))
    assert (finishes, calls, content) == (["length"], [], "")


def generated_tokens(client, **kwargs) -> tuple[list[str], object]:
    """The tokens of a greedy reply (as text) and its choice."""
    reply = client.chat.completions.create(temperature=0, logprobs=True, extra_body=NO_THINKING, **kwargs).choices[0]
    return [entry.token for entry in reply.logprobs.content], reply


@pytest.mark.parametrize("how", ["required", "named"])
def test_a_call_cut_by_max_tokens_streams_its_name_and_arguments_so_far(client, how):
    choice = "required" if how == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
    tokens, whole = generated_tokens(client, max_tokens=400, **kwargs)
    full = whole.message.tool_calls[0].function
    # Cut where the arguments have just begun: the first argument's key is complete.
    opening = '"parameters": ' if how == "required" else ""
    text, start = "", -1
    for num_tokens, token in enumerate(tokens, start=1):
        text += token
        start = text.find(opening)
        if start >= 0 and ":" in text[start + len(opening):]:
            break
    cut = text[start + len(opening):]
    assert len(cut) < len(full.arguments) and full.arguments.startswith(cut), (cut, full)
    cut_kwargs = dict(kwargs, max_tokens=num_tokens)
    _, reply = generated_tokens(client, **cut_kwargs)
    assert reply.finish_reason == "length"
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == [(full.name, cut)]
    stream = client.chat.completions.create(temperature=0, stream=True, extra_body=NO_THINKING, **cut_kwargs)
    chunks = list(stream)
    _, content, calls, finishes = reassemble(chunks)
    assert (content, finishes) == ("", ["length"])
    assert [(c["name"], c["arguments"]) for c in calls] == [(full.name, cut)]
    # The name came before the end: in a chunk of its own, not with the finish reason.
    named = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls
             and c.choices[0].delta.tool_calls[0].function.name]
    assert named and named[0].choices[0].finish_reason is None


def test_forced_calls_are_written_compactly(default_server):
    """No tokens go to layout: the text is the calls with ", " and ": " between items and no other whitespace
    (the model used to spend a third of a call's tokens on newlines and indentation)."""
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=200, logprobs=True)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    written = "".join(entry.token for entry in choice.logprobs.content[:-1])  # the last one ends the text
    assert written == json.dumps([{"name": call.name, "parameters": json.loads(call.arguments)}], ensure_ascii=False)


# vLLM's own tool-call cases (tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py)
# against the default model: a tool whose parameters refer to their "$defs", with required and a named tool.
VLLM_STYLE_TOOLS = [
    {"type": "function", "function": {"name": "get_current_weather", "parameters": {
        "type": "object", "strict": True,
        "properties": {"city": {"type": "string", "default": "Vienna"}, "country": {"type": "string"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                       "options": {"$ref": "#/$defs/WeatherOptions"}},
        "required": ["country", "unit"],
        "$defs": {"WeatherOptions": {"type": "object", "additionalProperties": False, "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            "include_forecast": {"type": "boolean", "default": False}}}}}}},
    {"type": "function", "function": {"name": "get_forecast", "parameters": {
        "type": "object", "properties": {"country": {"type": "string"}, "days": {"type": "integer"},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["country", "days", "unit"]}}},
]
VLLM_STYLE_ASK = [{"role": "user", "content": "What is the weather in Berlin now, and the forecast for the next 5 "
                                              "days, in fahrenheit?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_current_weather"}}],
                         ids=["required", "named"])
def test_vllm_style_tools_with_defs(default_server, choice):
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=VLLM_STYLE_ASK, tools=VLLM_STYLE_TOOLS,
                                           tool_choice=choice, temperature=0, max_tokens=300)
    assert reply.choices[0].message.tool_calls, reply
    cut = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=VLLM_STYLE_ASK, tools=VLLM_STYLE_TOOLS,
                                         tool_choice=choice, temperature=0, max_completion_tokens=1).choices[0]
    assert (cut.finish_reason, cut.message.tool_calls) == ("length", None)


# ----------------------------------------------------------------------------- conversations


HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
]


def test_tool_turns_render_as_the_template_writes_them(server, client):
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": HISTORY, "tools": TOOLS, **NO_THINKING}).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in text
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert '"name": "add"' in text  # the tools are in the system prompt
    reply = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=5,
                                           extra_body=NO_THINKING)
    assert reply.usage.prompt_tokens == len(ids)


def test_tool_choice_none_leaves_the_tools_out(server, client):
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1,
                                                extra_body=NO_THINKING)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1,
                                          extra_body=NO_THINKING)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, extra_body=NO_THINKING)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens


BAD_TOOL_REQUESTS = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, None),
    ({"tools": [{"type": "retrieval"}]}, None),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}]}, "messages.0.tool_calls"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages.1.tool_calls"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("extra,param", BAD_TOOL_REQUESTS)
def test_bad_tool_requests_are_400s(server, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 5, **extra}
    error = assert_error_shape(httpx.post(f"{server.url}{CHAT}", json=body, timeout=30), 400)
    if param is not None:
        assert error["param"] == param
    wait_until_idle(server.url)


# ----------------------------------------------------------------------------- reasoning


def test_thinking_goes_to_reasoning_content(client, server):
    # The template opens the block in the prompt (as DeepSeek-R1's does); pushing the end marker
    # makes the random model close it after a few tokens.
    end = token_id(server, "</think>")
    kwargs = {"model": MODEL, "messages": ASK, "temperature": 1.0, "max_tokens": 60, "logit_bias": {str(end): 9},
              "extra_body": {"chat_template_kwargs": {"open_thinking": True}}}
    thought = 0
    for seed in range(4):
        whole = client.chat.completions.create(seed=seed, **kwargs).choices[0].message
        assert whole.reasoning_content is not None and "</think>" not in whole.reasoning_content
        thought += bool(whole.reasoning_content)
        reasoning, content, calls, _ = reassemble(client.chat.completions.create(seed=seed, stream=True, **kwargs))
        assert (reasoning, content or None) == (whole.reasoning_content, whole.content)
    assert thought  # some seed wrote thinking before the marker


def test_no_reasoning_when_thinking_is_off(client):
    message = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, extra_body={
        "structured_outputs": {"regex": "Paris is sunny\\."}, **NO_THINKING}).choices[0].message
    assert (message.reasoning_content, message.content) == (None, "Paris is sunny.")


def test_structured_output_and_tool_calls_apply_after_the_thinking(client, server):
    end = token_id(server, "</think>")
    open_block = {"chat_template_kwargs": {"open_thinking": True}}
    schema = SCHEMAS["add"]
    for seed in range(3):
        message = client.chat.completions.create(
            model=MODEL, messages=ASK, temperature=1.0, seed=seed, max_tokens=300, logit_bias={str(end): 9},
            response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": schema, "strict": True}},
            extra_body=open_block).choices[0].message
        assert message.reasoning_content is not None
        jsonschema.validate(json.loads(message.content), schema)
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=1.0, seed=seed,
                                               max_tokens=400, logit_bias={str(end): 9},
                                               extra_body=open_block).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.reasoning_content is not None
        assert_valid_calls(reply.message)
