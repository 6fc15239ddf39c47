"""Tool-call parsers on outputs written the way each model family writes them: whole, cut into
stream deltas at every place, malformed and cut off."""

from __future__ import annotations

import json

import pytest

from server.tool_parsers import ToolCallStream, get_parser, parser_for_template

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"timezone": "Europe/Paris"}

# (parser, output, expected content, expected calls as (name, arguments))
RECORDED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
               '{"timezone": "Europe/Paris"}}\n</tool_call>',
     "Let me look that up.\n", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("hermes", 'Paris is sunny today.', "Paris is sunny today.", []),
    # arguments written as a JSON string (some fine-tunes do)
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "{\\"timezone\\": \\"Europe/Paris\\"}"}\n</tool_call>',
     None, [("get_time", TIME)]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", WEATHER)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
     None, [("get_weather", WEATHER), ("get_time", TIME)]),
    ("llama3_json", 'It is 18 degrees in Paris.', "It is 18 degrees in Paris.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
     None, [("get_weather", WEATHER), ("get_time", TIME)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
     None, [("get_weather", WEATHER)]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]'
                '{"timezone": "Europe/Paris"}',
     "Sure.", [("get_weather", WEATHER), ("get_time", TIME)]),
]

MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"ci'),  # cut off by max_tokens
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("llama3_json", '{"temperature": 18}'),  # a JSON answer, not a call
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"'),
]


def calls_of(parsed) -> list[tuple[str, object]]:
    return [(c.name, c.arguments) for c in parsed]


@pytest.mark.parametrize("name,text,content,calls", RECORDED)
def test_whole_outputs_parse(name, text, content, calls):
    got_content, got_calls = get_parser(name).extract(text)
    assert got_content == content
    assert calls_of(got_calls) == calls
    for call in got_calls:
        assert json.loads(call.arguments_json) == call.arguments


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_or_cut_off_calls_stay_content(name, text):
    content, calls = get_parser(name).extract(text)
    assert calls == []
    assert content == text


def stream(name: str, pieces: list[str]) -> tuple[str, list, list[int]]:
    """Feed the pieces; the content sent, the calls sent, and after which piece each call came."""
    reader = ToolCallStream(get_parser(name))
    content, calls, when = "", [], []
    for i, piece in enumerate(pieces):
        text, new = reader.feed(piece, finished=i == len(pieces) - 1)
        content += text
        calls += new
        when += [i] * len(new)
    return content, calls, when


@pytest.mark.parametrize("name,text", [(n, t) for n, t, _, _ in RECORDED] + MALFORMED)
def test_streamed_at_every_cut_equals_whole(name, text):
    whole_content, whole_calls = get_parser(name).extract(text)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], [text[:cut]] + list(text[cut:])):
            content, calls, _ = stream(name, pieces)
            assert content == (whole_content or ""), (cut, pieces)
            assert calls_of(calls) == calls_of(whole_calls), (cut, pieces)


def test_a_call_is_sent_as_soon_as_it_is_complete():
    text = RECORDED[1][1]
    first_end = text.index("</tool_call>") + len("</tool_call>")
    pieces = [text[:first_end], "\n", text[first_end + 1:-5], text[-5:]]
    _, calls, when = stream("hermes", pieces)
    assert calls_of(calls) == [("get_weather", WEATHER), ("get_time", TIME)]
    assert when == [0, 2]  # the first before the second was written, the second once its JSON was whole


def test_content_that_might_start_a_marker_is_held_back_then_released():
    content, calls, _ = stream("hermes", ["The answer is <tool", "tip> and more"])
    assert content == "The answer is <tooltip> and more" and calls == []
    reader = ToolCallStream(get_parser("hermes"))
    assert reader.feed("The answer is <tool", finished=False) == ("The answer is ", [])


@pytest.mark.parametrize("marker,parser", [("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                                           ("<tool_call>", "hermes"), ("", "hermes")])
def test_parser_chosen_from_the_chat_template(marker, parser):
    template = "{% for m in messages %}{{ m.content }}{% endfor %}" + marker
    assert parser_for_template(template) == parser
