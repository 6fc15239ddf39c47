"""What a chat request's ``tools`` and ``tool_choice`` ask for, and how calls come back.

    "none"            tools left out of the template; the text is the content
    "auto" (default)  tools in the template; calls are parsed out of the model's own format
                      (``--tool-call-parser``), the rest is content
    "required"        the output is constrained to a JSON array of calls, each one of the tools with
                      arguments that match its parameters (one call unless parallel_tool_calls)
    a named function  the output is constrained to that function's parameters: it is the arguments

With "auto", a tool marked ``strict`` constrains the calls too, in the model's own format (an
xgrammar structural tag: free text, and after the call marker a call whose arguments match the
schema); the hermes and llama3_json formats have one. Forced arguments take the parameters the function declares and no others (unless its schema says
``additionalProperties``), as a function's signature does. The constraints ride on the grammar engine
(structured outputs), so constrained calls always parse, and they start after a reasoning model's
thinking. A choice that called tools ends with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import xgrammar as xgr

from engine.sampling_params import StructuredOutputsParams
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, FunctionCall, ToolCall
from server.tool_parsers import ParsedCall, ToolCallStream, ToolParser, call_from, complete_items, new_call_id

_ANY_OBJECT = {"type": "object"}
# The parsers whose call format xgrammar has a structural tag for (strict tools under "auto").
_STRUCTURAL_TAG_MODELS = {"hermes": "qwen_3", "llama3_json": "llama"}
# ToolPlan.grammar's thinking states (server/reasoning.py) as xgrammar's structural tags name them.
_TAG_REASONING = {"open": "enabled", "optional": "auto", None: "disabled"}


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
            return StructuredOutputsParams(structural_tag=tag.model_dump_json())
        if self.mode == "named":
            schema = by_name[self.named].get("parameters") or _ANY_OBJECT
            return StructuredOutputsParams(json=json.dumps(schema), strict=True)
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": name},
                                                       "parameters": fn.get("parameters") or _ANY_OBJECT},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for name, fn in by_name.items()]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=json.dumps(schema), strict=True)
        return None

    @property
    def skip_special_tokens(self) -> bool | None:
        """False when the parser's markers are special tokens (they must stay in the text)."""
        return False if self.mode == "auto" and self.parser.needs_special_tokens else None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished choice's content and tool calls."""
        if self.mode == "named":
            return None, [_tool_call(self.named, text)]
        if self.mode == "required":
            return None, [_tool_call(c.name, c.arguments_json) for c in _required_calls(text)]
        if self.mode == "auto":
            content, calls = self.parser.extract(text)
            return content, [_tool_call(c.name, c.arguments_json) for c in calls]
        return text, []

    def stream(self) -> ChoiceToolStream | None:
        return None if self.mode == "none" else ChoiceToolStream(self)


def _tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments))


def _required_calls(text: str, finished: bool = True) -> list[ParsedCall]:
    """The calls of a "required" output (a JSON array of {"name", "parameters"}): all of them once it
    is finished, the complete ones while it is being written."""
    calls = [call_from(obj, keys=("parameters",)) for obj in complete_items(text, finished)]
    return [c for c in calls if c is not None]


@dataclass
class ToolDelta:
    """What one streamed delta says: content, and tool-call pieces (index, id, name, arguments)."""

    content: str = ""
    calls: list[tuple[int, str | None, str | None, str]] = field(default_factory=list)


class ChoiceToolStream:
    """One streamed choice: turns its text deltas into content and OpenAI's tool-call deltas (a call's
    id and name first, then its arguments). The arguments sent add up to the non-streamed ones."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.num_calls = 0
        self._auto = ToolCallStream(plan.parser) if plan.mode == "auto" else None

    def feed(self, delta: str, finished: bool) -> ToolDelta:
        out = ToolDelta()
        mode = self.plan.mode
        if mode == "named":
            if self.num_calls == 0 and (delta or finished):
                out.calls.append((0, new_call_id(), self.plan.named, ""))
                self.num_calls = 1
            if delta:
                out.calls.append((0, None, None, delta))
            return out
        if mode == "required":
            self.text += delta
            calls = _required_calls(self.text, finished)
        else:
            out.content, new = self._auto.feed(delta, finished)
            calls = [None] * self.num_calls + new
        for call in calls[self.num_calls:]:
            out.calls.append((self.num_calls, new_call_id(), call.name, ""))
            out.calls.append((self.num_calls, None, None, call.arguments_json))
            self.num_calls += 1
        return out
