"""Tool calls out of generated text, in the formats the supported models write them.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Hermes, Qwen2.5, Qwen3
    llama3_json  {"name": ..., "parameters": {...}} (after <|python_tag|>; several joined by ";")
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  or  [TOOL_CALLS]name[ARGS]{...}

A parser finds where the calls start (the text before is the message's content) and the calls
that are complete so far, so a stream can send each call as soon as it is whole. Text that
looks like a call but does not parse stays content, as vLLM's parsers do. Partial JSON (the
name of a call still being written) is read with ``partial-json-parser``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow

# Lenient about raw control characters in strings: grammar-constrained output may hold them
# (xgrammar's rule for length-bounded strings lets them through).
_DECODER = json.JSONDecoder(strict=False)


def loads(text: str) -> Any:
    return _DECODER.decode(text)


def loads_partial(text: str) -> Any:
    """A JSON value still being written, completed as far as it goes (strings left out)."""
    return partial_json_parser.loads(text, Allow.ALL & ~Allow.STR, parser=loads)


def complete_items(text: str, finished: bool) -> list:
    """The complete items of a JSON array: all of them once it parses whole (``finished``), else
    all but the last of what has been written (also when a finished one was cut off)."""
    if finished:
        try:
            value = loads(text)
            return value if isinstance(value, list) else []
        except ValueError:
            pass  # cut off by max_tokens
    try:
        value = loads_partial(text) if text.strip() else []
    except Exception:  # noqa: BLE001 - not even the start of a JSON value
        return []
    return value[:-1] if isinstance(value, list) else []


def marker_prefix_length(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the beginning of ``marker`` (held back
    from a stream until the next delta says what they are)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ParsedCall:
    name: str
    arguments: Any  # the JSON value of the arguments (an object, usually)

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    name = ""
    marker = ""  # what starts the calls
    # Detokenize with special tokens kept: the marker is a special token of these models' tokenizers.
    needs_special_tokens = False

    def start(self, text: str) -> int | None:
        """Where the tool calls start, or None."""
        idx = text.find(self.marker)
        return None if idx < 0 else idx

    def hold_back(self, text: str) -> int:
        """How many trailing characters could be the beginning of the marker (not content yet)."""
        return marker_prefix_length(text, self.marker)

    def calls(self, section: str, finished: bool) -> list[ParsedCall] | None:
        """The complete calls in ``section`` (the text from the start on); None if it cannot be calls."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A finished output's content and calls; malformed calls leave the whole text as content."""
        idx = self.start(text)
        if idx is None:
            return text, []
        calls = self.calls(text[idx:], finished=True)
        if not calls:
            return text, []
        content = text[:idx]
        return (content if content.strip() else None), calls


def call_from(obj: Any, keys=("arguments", "parameters")) -> ParsedCall | None:
    """A call out of a decoded {"name", "arguments" (or "parameters")} object; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[k] for k in keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = loads(arguments)
        except ValueError:
            return None
    return ParsedCall(obj["name"], arguments)


def _decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``pos`` (after whitespace) and where it ends, or None if incomplete."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


class HermesToolParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    end_marker = "</tool_call>"

    def calls(self, section: str, finished: bool) -> list[ParsedCall] | None:
        found, pos = [], 0
        while True:
            idx = section.find(self.marker, pos)
            if idx < 0:
                break
            decoded = _decode_at(section, idx + len(self.marker))
            if decoded is None:
                break  # still being written (or malformed: then the finished output keeps it as content)
            call = call_from(decoded[0])
            if call is None:
                return None
            found.append(call)
            pos = decoded[1]
        return found


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    marker = "<|python_tag|>"
    needs_special_tokens = True

    def start(self, text: str) -> int | None:
        idx = text.find(self.marker)
        if idx >= 0:
            return idx
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else None

    def hold_back(self, text: str) -> int:
        return len(text) if not text.strip() else super().hold_back(text)  # a reply may open with "{"

    def calls(self, section: str, finished: bool) -> list[ParsedCall] | None:
        if section.startswith(self.marker):
            section = section[len(self.marker):]
        found, pos = [], 0
        while True:
            decoded = _decode_at(section, pos)
            if decoded is None:
                return found if found or not finished else None
            call = call_from(decoded[0])
            if call is None:
                return None
            found.append(call)
            pos = decoded[1]
            rest = section[pos:].lstrip()
            if not rest.startswith(";"):
                return found
            pos = section.index(";", pos) + 1


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    needs_special_tokens = True
    _args = "[ARGS]"

    def calls(self, section: str, finished: bool) -> list[ParsedCall] | None:
        body = section[len(self.marker):]
        if body.lstrip().startswith("["):  # [{"name": ..., "arguments": ...}, ...]
            decoded = _decode_at(body, 0)
            if decoded is None:  # still being written: its complete calls
                calls = [call_from(obj) for obj in complete_items(body.strip(), finished=False)]
                return [c for c in calls if c is not None]
            calls = [call_from(obj) for obj in decoded[0]] if isinstance(decoded[0], list) else [None]
            return None if any(c is None for c in calls) else calls
        found = []  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
        for part in body.split(self.marker):
            name, sep, rest = part.partition(self._args)
            decoded = _decode_at(rest, 0) if sep else None
            if decoded is None:
                break
            found.append(ParsedCall(name.strip(), decoded[0]))
        return found


PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def parser_for_template(chat_template: str | None) -> str:
    """The parser a chat template's own tool-call format asks for (hermes when it names none)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"


def get_parser(name: str) -> ToolParser:
    return PARSERS[name]()


class ToolCallStream:
    """One streamed choice under ``tool_choice: auto``: content until the calls start, then each call
    as soon as it is complete. Fed the whole text so far; returns what is new."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._calls_sent = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ParsedCall]]:
        self.text += delta
        text, parser = self.text, self.parser
        start = parser.start(text)
        if start is None:
            end = len(text) if finished else len(text) - parser.hold_back(text)
            return self._content_until(end), []
        content = self._content_until(start)
        calls = parser.calls(text[start:], finished) if not finished else parser.extract(text)[1]
        if finished and not calls:  # it was not calls after all: the rest is content
            return content + self._content_until(len(text)), []
        new = (calls or [])[self._calls_sent:]
        self._calls_sent += len(new)
        return content, new

    def _content_until(self, end: int) -> str:
        if end <= self._content_sent:
            return ""
        piece = self.text[self._content_sent:end]
        self._content_sent = end
        return piece
