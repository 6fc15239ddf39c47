"""What a chat request's ``tools`` and ``tool_choice`` ask for, and how calls come back.

    "none"            tools left out of the template; the text is the content
    "auto" (default)  tools in the template; calls are parsed out of the model's own format
                      (``--tool-call-parser``), the rest is content
    "required"        the output is constrained to a JSON array of calls, each one of the tools with
                      arguments that match its parameters (one call unless parallel_tool_calls)
    a named function  the output is constrained to that function's parameters: it is the arguments

With "auto", a tool marked ``strict`` constrains the calls too, in the model's own format (an
xgrammar structural tag: free text, and after the call marker a call whose arguments match the
schema); the hermes and llama3_json formats have one. Forced arguments take the parameters the function
declares and no others (unless its schema says ``additionalProperties``), as a function's signature does.
The constraints ride on the grammar engine (structured outputs), so constrained calls always parse, and
they start after a reasoning model's thinking. Forced calls are written compactly (``", "`` and ``": "``
between items, no other whitespace), so no tokens go to layout.

Forced calls stream as they are written, as vLLM streams them: a "required" call once its name is
complete and its parameters have begun, a named call once its first argument's key is complete (or it
is complete). A choice cut by max_tokens keeps the calls shown so far, the last one partial, with
``finish_reason: "length"``. A choice that called tools ends with ``finish_reason: "tool_calls"``, except
a named function's ("stop", as OpenAI reports a forced function).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import xgrammar as xgr

from engine.sampling_params import StructuredOutputsParams
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from server.tool_parsers import ToolCallStream, ToolParser, new_call_id

_ANY_OBJECT = {"type": "object"}
# The parsers whose call format xgrammar has a structural tag for (strict tools under "auto").
_STRUCTURAL_TAG_MODELS = {"hermes": "qwen_3", "llama3_json": "llama"}
# ToolPlan.grammar's thinking states (server/reasoning.py) as xgrammar's structural tags name them.
_TAG_REASONING = {"open": "enabled", "optional": "auto", None: "disabled"}
# Values in a schema that are data, not schemas: a "$ref" in them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict] = field(default_factory=list)  # as the chat template takes them
    named: str | None = None
    parser: ToolParser | None = None

    @classmethod
    def of(cls, body: ChatCompletionRequest, parser: ToolParser) -> ToolPlan:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = body.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if not isinstance(choice, str):
            names = [t["function"]["name"] for t in tools]
            if choice.function.name not in names:
                raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                  f"({', '.join(names) or 'none given'})", param="tool_choice")
            return cls("named", tools, choice.function.name, parser)
        if choice != "none" and not tools:
            raise bad_request(f"tool_choice {choice!r} needs tools", param="tool_choice")
        if body.parallel_tool_calls is not None and not tools:
            raise bad_request("parallel_tool_calls needs tools", param="parallel_tool_calls")
        return cls(choice, tools if choice != "none" else [], None, parser)

    @property
    def template_tools(self) -> list[dict] | None:
        return self.tools or None

    @property
    def strict(self) -> bool:
        return self.mode == "auto" and any(t["function"].get("strict") for t in self.tools)

    def grammar(self, parallel: bool, reasoning: str | None = None) -> StructuredOutputsParams | None:
        """The constraint "required", a named function or strict tools put on the output; ``reasoning``
        is where a thinking block is ("open", "optional" or None, as StructuredOutputsParams has it)."""
        by_name = {t["function"]["name"]: t["function"] for t in self.tools}
        if self.strict:
            model = _STRUCTURAL_TAG_MODELS.get(self.parser.name)
            if model is None:
                raise bad_request(f"strict tools under tool_choice 'auto' need a call format with a grammar "
                                  f"(--tool-call-parser {' or '.join(_STRUCTURAL_TAG_MODELS)}); this server reads "
                                  f"{self.parser.name}", param="tools")
            tools = [{"type": "function", "function": {"name": name, "parameters": (
                fn.get("parameters") or _ANY_OBJECT) if fn.get("strict") else _ANY_OBJECT}}
                for name, fn in by_name.items()]
            tag = xgr.get_builtin_structural_tag(model, tools=tools, tool_choice="auto",
                                                 reasoning=_TAG_REASONING[reasoning], parallel_tool_calls=parallel,
                                                 max_whitespace_cnt=32)
            return StructuredOutputsParams(structural_tag=tag.model_dump_json(), param="tools")
        if self.mode == "named":  # the parameters are the whole schema: their references resolve as they are
            return _compact_json(by_name[self.named].get("parameters") or _ANY_OBJECT)
        if self.mode == "required":
            defs: dict = {}
            calls = [{"type": "object", "properties": {"name": {"const": name},
                                                       "parameters": _nested(fn.get("parameters") or _ANY_OBJECT,
                                                                             f"tool_{i}", defs)},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for i, (name, fn) in enumerate(by_name.items())]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not parallel:
                schema["maxItems"] = 1
            if defs:
                schema["$defs"] = defs
            return _compact_json(schema)
        return None

    @property
    def skip_special_tokens(self) -> bool | None:
        """False when the parser's markers are special tokens (they must stay in the text)."""
        return False if self.mode == "auto" and self.parser.needs_special_tokens else None

    def extract(self, text: str, finish_reason: str | None = "stop") -> tuple[str | None, list[ToolCall]]:
        """A finished choice's content and tool calls (a forced call cut off is kept once shown, partial)."""
        if self.mode in ("named", "required"):
            stream = ChoiceToolStream(self)
            stream.feed(text, finish_reason or "stop")
            return None, [_tool_call(name, arguments) for name, arguments in stream.calls]
        if self.mode == "auto":
            content, calls = self.parser.extract(text)
            return content, [_tool_call(c.name, c.arguments_json) for c in calls]
        return text, []

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """vLLM's (and OpenAI's): "tool_calls" for a choice that called tools and ended on its own, except
        for a forced function ("stop"); a cut-off choice stays "length"."""
        return "tool_calls" if called and reason == "stop" and self.mode != "named" else reason

    def stream(self) -> ChoiceToolStream | None:
        return None if self.mode == "none" else ChoiceToolStream(self)


def _compact_json(schema: dict) -> StructuredOutputsParams:
    try:
        text = json.dumps(schema)
    except RecursionError:
        raise bad_request("a tool's parameters are nested too deeply", param="tools") from None
    return StructuredOutputsParams(json=text, strict=True, any_whitespace=False, param="tools")


def _nested(parameters: dict, key: str, defs: dict) -> dict:
    """A tool's parameters as one call's "parameters" in the "required" array. Parameters with references
    (``#/$defs/X``, ``#/definitions/X``, ``#`` itself) go to the array's ``$defs[key]`` whole, their own
    definitions with them, and every reference of theirs is rewritten to point there: nested as they
    are, they would point at the array."""
    try:
        if not _has_ref(parameters):
            return parameters
        defs[key] = _rebased(parameters, f"#/$defs/{key}")
    except RecursionError:
        raise bad_request("a tool's parameters are nested too deeply", param="tools") from None
    return {"$ref": f"#/$defs/{key}"}


def _has_ref(node) -> bool:
    if isinstance(node, dict):
        return any((k == "$ref" and isinstance(v, str)) or (k not in _DATA_KEYWORDS and _has_ref(v))
                   for k, v in node.items())
    return isinstance(node, list) and any(_has_ref(item) for item in node)


def _rebased(node, root: str):
    """A copy of a schema whose local references (``#...``) point under ``root`` instead."""
    if isinstance(node, dict):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else
                    v if k in _DATA_KEYWORDS else _rebased(v, root)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebased(item, root) for item in node]
    return node


def _tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


@dataclass
class ToolDelta:
    """What one streamed delta says: content, and tool-call pieces (index, id, name, arguments)."""

    content: str = ""
    calls: list[tuple[int, str | None, str | None, str]] = field(default_factory=list)


class ChoiceToolStream:
    """One streamed choice: turns its text deltas into content and OpenAI's tool-call pieces (a call's id and
    name first, then its arguments as they are written). The pieces add up to the non-streamed calls."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._auto = ToolCallStream(plan.parser) if plan.mode == "auto" else None
        self._forced = (_NamedCall(plan.named) if plan.mode == "named" else _RequiredCalls()
                        if plan.mode == "required" else None)
        self._sent: list[int] = []  # per forced call shown: how much of its arguments has been sent
        self.num_calls = 0

    @property
    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments so far) of the forced calls shown."""
        return [(name, arguments) for name, arguments, _ in self._forced.calls()][:self.num_calls]

    def feed(self, delta: str, finish_reason: str | None) -> ToolDelta:
        out = ToolDelta()
        if self._auto is not None:
            out.content, new = self._auto.feed(delta, finish_reason is not None)
            for call in new:
                out.calls += [(self.num_calls, new_call_id(), call.name, ""), (self.num_calls, None, None,
                                                                                call.arguments_json)]
                self.num_calls += 1
            return out
        self._forced.feed(delta, finish_reason)
        for index, (name, arguments, _) in enumerate(self._forced.calls()):
            if index == self.num_calls:
                out.calls.append((index, new_call_id(), name, ""))
                self._sent.append(0)
                self.num_calls += 1
            if len(arguments) > self._sent[index]:
                out.calls.append((index, None, None, arguments[self._sent[index]:]))
                self._sent[index] = len(arguments)
        return out


class _NamedCall:
    """A named function's output, which is its arguments: shown once the first argument's key is complete
    (a call cut off before it has nothing of the model's in it yet) or the arguments are complete."""

    def __init__(self, name: str):
        self.name = name
        self._lexer = _JsonLexer()
        self._shown = False

    def feed(self, delta: str, finish_reason: str | None) -> None:
        if self._shown:
            self._lexer.text += delta
            return
        self._shown = self._lexer.feed(delta, stop_at_first_key=True) or (
            finish_reason is not None and _is_json(self._lexer.text))

    def calls(self) -> list[tuple[str, str, bool]]:
        # Leading whitespace only is left out: what is sent of the arguments never changes afterwards.
        return [(self.name, self._lexer.text.lstrip(), True)] if self._shown else []


class _RequiredCalls:
    """A "required" output: a JSON array of {"name": ..., "parameters": ...} objects, read as it is written.
    A call is shown once its name is complete and its parameters have begun; its arguments are the
    parameters' text as written so far."""

    def __init__(self):
        self._lexer = _JsonLexer()

    def feed(self, delta: str, finish_reason: str | None) -> None:
        self._lexer.feed(delta)

    def calls(self) -> list[tuple[str, str, bool]]:
        out, text = [], self._lexer.text
        for call in self._lexer.calls:
            if call.name is None or call.args_start is None:
                break  # calls are written in order: none after this one is shown either
            end = call.args_end if call.args_end is not None else len(text)
            out.append((call.name, text[call.args_start:end], call.args_end is not None))
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


@dataclass
class _CallSpan:
    """One call of a "required" array: its name once complete, where its parameters' text starts and ends."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None


# What a call object expects next.
_KEY, _COLON, _VALUE, _IN_STRING, _IN_CONTAINER, _IN_SCALAR, _AFTER = range(7)


class _JsonLexer:
    """JSON text read as it is written, each character once: string and nesting state, the first key of a
    top-level object, and the calls of a "required" array (depth 1: the array, 2: a call object, 3 and
    more: inside a value). The text comes from a grammar, so it is well formed as far as it goes."""

    def __init__(self):
        self.text = ""
        self.calls: list[_CallSpan] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._string_start = 0
        self._value_start = 0
        self._key: str | None = None
        self._expect = _KEY

    def feed(self, delta: str, stop_at_first_key: bool = False) -> bool:
        """Read ``delta``; with ``stop_at_first_key``, True once a key of the top-level object is complete
        (then nothing more is read)."""
        start = len(self.text)
        self.text += delta
        text = self.text
        for i in range(start, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    self._string_ended(i + 1)
            elif ch == '"':
                self._in_string, self._string_start = True, i
                if self._depth == 2 and self._expect == _VALUE:
                    self._start_value(i, _IN_STRING)
            elif ch in "{[":
                if self._depth == 1 and ch == "{":
                    self.calls.append(_CallSpan())
                    self._expect, self._key = _KEY, None
                elif self._depth == 2 and self._expect == _VALUE:
                    self._start_value(i, _IN_CONTAINER)
                self._depth += 1
            elif ch in "}]":
                if self._depth == 2 and self._expect == _IN_SCALAR:
                    self._end_value(i)
                self._depth -= 1
                if self._depth == 2 and self._expect == _IN_CONTAINER:
                    self._end_value(i + 1)
            elif stop_at_first_key and ch == ":" and self._depth == 1:
                return True
            elif self._depth == 2 and self.calls:
                self._call_punctuation(ch, i)
        return False

    def _string_ended(self, end: int) -> None:
        if self._depth != 2 or not self.calls:
            return
        if self._expect == _KEY:
            self._key, self._expect = _string(self.text[self._string_start:end]), _COLON
        elif self._expect == _IN_STRING:
            self._end_value(end)

    def _call_punctuation(self, ch: str, i: int) -> None:
        if ch == ":":
            if self._expect == _COLON:
                self._expect = _VALUE
        elif ch == ",":
            if self._expect == _IN_SCALAR:
                self._end_value(i)
            self._expect, self._key = _KEY, None
        elif ch.isspace():
            if self._expect == _IN_SCALAR:
                self._end_value(i)
        elif self._expect == _VALUE:
            self._start_value(i, _IN_SCALAR)

    def _start_value(self, pos: int, kind: int) -> None:
        self._value_start, self._expect = pos, kind
        if self._key == "parameters":
            self.calls[-1].args_start = pos

    def _end_value(self, end: int) -> None:
        call = self.calls[-1]
        if self._key == "parameters":
            call.args_end = end
        elif self._key == "name" and self._expect == _IN_STRING:
            call.name = _string(self.text[self._value_start:end])
        self._expect = _AFTER


def _string(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
