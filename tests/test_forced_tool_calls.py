"""Forced tool calls ("required" and a named function) without a server: their grammar, and how their
text becomes calls, whole or cut off at any point, streamed or not."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from server.tool_parsers import get_parser
from server.tools import ChoiceToolStream, ToolPlan

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"]}
NESTED = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {
    "type": "object", "properties": {"c": {"type": "string"}}}}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": NESTED}}]
REQUIRED_TEXT = ('[{"name": "get_weather", "parameters": {"city": "Pa]ris{\\"", "unit": "c"}}, '
                 '{"name": "add", "parameters": {"a": 1, "b": [{"c": "}]"}]}}]')
CALLS = [("get_weather", '{"city": "Pa]ris{\\"", "unit": "c"}'), ("add", '{"a": 1, "b": [{"c": "}]"}]}')]


def plan(mode: str, tools=TOOLS, named: str | None = None) -> ToolPlan:
    return ToolPlan(mode, tools, named, get_parser("hermes"))


def calls_of(tool_calls) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in tool_calls]


def streamed(plan_: ToolPlan, text: str, finish_reason: str, piece_size: int = 1) -> list[tuple[str, str]]:
    """The calls a stream of ``text`` in pieces of ``piece_size`` characters adds up to."""
    stream, calls = ChoiceToolStream(plan_), {}
    pieces = [text[i:i + piece_size] for i in range(0, len(text), piece_size)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        for index, call_id, name, arguments in stream.feed(piece, finish_reason if last else None).calls:
            if call_id is not None:
                assert index == len(calls) and name and arguments == ""
                calls[index] = [name, ""]
            else:
                assert name is None
                calls[index][1] += arguments
    return [tuple(calls[i]) for i in sorted(calls)]


def test_required_calls_keep_their_arguments_as_written():
    content, calls = plan("required").extract(REQUIRED_TEXT, "stop")
    assert content is None and calls_of(calls) == CALLS
    for size in (1, 3, 1000):
        assert streamed(plan("required"), REQUIRED_TEXT, "stop", size) == CALLS


def test_a_cut_required_call_shows_once_its_name_is_complete_and_its_parameters_began():
    start = REQUIRED_TEXT.index('"parameters": ') + len('"parameters": ')
    for cut in range(len(REQUIRED_TEXT)):
        text = REQUIRED_TEXT[:cut]
        whole = calls_of(plan("required").extract(text, "length")[1])
        assert streamed(plan("required"), text, "length") == whole, text
        if cut <= start:
            assert whole == [], text  # "[", '[{"name": "get_weather"', ... no call yet
        else:
            name, arguments = whole[-1]
            full = dict(CALLS)[name]
            assert full.startswith(arguments) and arguments, text


@pytest.mark.parametrize("text, shown", [
    ("{", False), ('{"', False), ('{"ci', False), ('{"city"', False), ('{"city":', True),
    ('{"city": "Pa', True), ("{}", True), ("", False),
])
def test_a_cut_named_call_shows_once_its_first_key_is_complete(text, shown):
    whole = calls_of(plan("named", named="get_weather").extract(text, "length")[1])
    assert whole == ([("get_weather", text)] if shown else [])
    assert streamed(plan("named", named="get_weather"), text, "length") == whole


def test_finish_reasons_are_vllms():
    assert plan("required").finish_reason("stop", True) == "tool_calls"
    assert plan("named", named="add").finish_reason("stop", True) == "stop"
    assert plan("required").finish_reason("length", True) == "length"
    assert plan("required").finish_reason("stop", False) == "stop"


REFS = {"type": "object", "properties": {
    "when": {"$ref": "#/$defs/Time"}, "days": {"$ref": "#/definitions/Days"}, "again": {"$ref": "#/properties/when"},
    "note": {"type": "string", "default": {"$ref": "#/not/a/reference"}}},
    "required": ["when", "days", "again", "note"], "additionalProperties": False,
    "$defs": {"Time": {"type": "object", "properties": {"h": {"enum": [1, 2]}}, "required": ["h"],
                       "additionalProperties": False}},
    "definitions": {"Days": {"enum": ["mon", "tue"]}}}
CLASH = {"type": "object", "properties": {"t": {"$ref": "#/$defs/Time"}}, "required": ["t"],
         "additionalProperties": False, "$defs": {"Time": {"enum": ["now"]}}}


def test_required_with_references_hoists_each_tools_definitions():
    tools = [{"type": "function", "function": {"name": "alarm", "parameters": REFS}},
             {"type": "function", "function": {"name": "ring", "parameters": CLASH}},
             {"type": "function", "function": {"name": "plain", "parameters": WEATHER}}]
    spec = plan("required", tools).grammar(parallel=True)
    schema = json.loads(spec.json)
    assert spec.any_whitespace is False and spec.strict and spec.param == "tools"
    assert set(schema["$defs"]) == {"tool_0", "tool_1"}  # the plain tool stays where it is
    assert schema["$defs"]["tool_0"]["properties"]["note"]["default"] == {"$ref": "#/not/a/reference"}
    good = [{"name": "alarm", "parameters": {"when": {"h": 1}, "days": "mon", "again": {"h": 2}, "note": "x"}},
            {"name": "ring", "parameters": {"t": "now"}}]
    jsonschema.validate(good, schema)
    for bad in ({"name": "ring", "parameters": {"t": {"h": 1}}},
                {"name": "alarm", "parameters": {**good[0]["parameters"], "days": "now"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)
    xgr.Grammar.from_json_schema(spec.json, any_whitespace=False)  # xgrammar resolves every reference


def test_a_single_call_has_at_most_one_item():
    schema = json.loads(plan("required").grammar(parallel=False).json)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
