"""A conversation rendered by a chat template as transformers renders it, within bounds.

``render_conversation`` gives the text ``tokenizer.apply_chat_template(..., tokenize=False)`` gives:
the same variables (the messages, tools, ``add_generation_prompt``, the tokenizer's special tokens and
the request's extra variables), the same Jinja options, globals (``raise_exception``,
``strftime_now``, ``dict``, ``namespace``), ``tojson`` filter and ``{% generation %}`` tag, and the
same handling of ``continue_final_message``; but it renders in server/template_sandbox.py's
``BoundedSandbox``, so a render has a deadline and a bound on what it makes.

``TemplateRunner`` runs renders off the event loop, each in a thread of its own (the tokenizer's
thread is never held by a template), and answers a render that outlives its deadline with an
error without waiting for it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.utils import Namespace

from server.template_sandbox import (
    RENDER_BUDGET,
    BoundedSandbox,
    RenderBudget,
    TemplateLimitError,
    TemplateLimits,
    TemplateOutputTooLong,
    TemplateTimeout,
)

logger = logging.getLogger("minivllm.server")

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for the end of a message to continue
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # names templates read a message's reasoning by


def render_conversation(template: str, messages: list[dict], tools: list[dict] | None = None,
                        add_generation_prompt: bool = False, continue_final_message: bool = False,
                        variables: dict | None = None, limits: TemplateLimits = TemplateLimits()) -> str:
    """The conversation rendered by ``template``: transformers' text for the same inputs (``variables``: the
    tokenizer's special tokens and the request's ``chat_template_kwargs``). Raises ``TemplateLimitError`` past a
    bound, and whatever the template raises (``raise_exception``, a syntax error, a type error) otherwise."""
    budget = RENDER_BUDGET.get()
    if budget is None:  # not under TemplateRunner: this render's own budget
        token = RENDER_BUDGET.set(RenderBudget(limits))
        try:
            return render_conversation(template, messages, tools, add_generation_prompt, continue_final_message,
                                       variables, limits)
        finally:
            RENDER_BUDGET.reset(token)
    limits = budget.limits
    if len(template) > limits.max_template_chars:
        raise TemplateLimitError(f"the chat template has {len(template):,} characters; at most "
                                 f"{limits.max_template_chars:,} are accepted")
    compiled = _compile(template)
    chat = _alias_reasoning([{k: v for k, v in m.items() if v is not None} for m in messages])
    final = None
    if continue_final_message:
        final = _tag_final_message(chat, template)
    text = _generate(compiled, budget, messages=chat, tools=tools, documents=None,
                     add_generation_prompt=add_generation_prompt, **(variables or {}))
    if final is not None:
        text = _cut_at_tag(text, final)
    return text


def _generate(compiled: jinja2.Template, budget: RenderBudget, **variables) -> str:
    pieces, size = [], 0
    for piece in compiled.generate(**variables):
        size += len(piece)
        if size > budget.limits.max_chars:
            raise TemplateOutputTooLong(f"an output of more than {budget.limits.max_chars:,} characters")
        pieces.append(piece)
    return "".join(pieces)


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    """A message's reasoning under each name templates read it by (as transformers passes it)."""
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def _tag_final_message(chat: list[dict], template: str) -> str:
    """Mark where the last message's text ends, so the render can be cut there (the message left open)."""
    last = chat[-1]
    content = last.get("content")
    if content is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in template:
        raise ValueError('continue_final_message is set to "content" but this is not an accepted field in the '
                         'chat_template')
    if isinstance(content, (list, tuple)):
        parts = [dict(p) for p in content]
        for part in reversed(parts):
            if "text" in part:
                final, part["text"] = part["text"], part["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message is set but we could not find any text to continue in the final "
                             "message!")
        chat[-1] = {**last, "content": parts}
        return final
    chat[-1] = {**last, "content": content + _CONTINUE_TAG}
    return content


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template")
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


# ----------------------------------------------------------------------- transformers' globals


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the type itself (no attribute tricks through it)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """Jinja's ``namespace``, refusing attributes that start with ``_``."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's Namespace signature, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes on a "
                                                  f"namespace, but got {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's part; the text is the
    block's own)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

    def _block(self, caller):
        return caller()


@functools.cache
def _environment() -> BoundedSandbox:
    return BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
                          filters={"tojson": _tojson},
                          globals={"raise_exception": _raise_exception, "strftime_now": _strftime_now,
                                   "dict": _TemplateDict(), "namespace": _TemplateNamespace})


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


# --------------------------------------------------------------------------------- runner


class TemplateRunner:
    """Runs renders (functions that call ``render_conversation``) in threads of their own, at most
    ``max_concurrent`` at once, each with its ``TemplateLimits``."""

    def __init__(self, max_concurrent: int = 4, grace_s: float = 1.0):
        self._slots = asyncio.Semaphore(max_concurrent)
        self.grace_s = grace_s  # how long past its deadline a render is waited for before it is answered

    async def run(self, limits: TemplateLimits, fn, *args):
        """``fn(*args)`` under a budget of ``limits``. A caller that is cancelled (its client left) cancels the
        render; a render still running ``grace_s`` past its deadline raises ``TemplateTimeout`` here, and its thread
        is left to stop at its next check (a daemon thread: it never holds up the process's exit)."""
        async with self._slots:
            loop = asyncio.get_running_loop()
            budget = RenderBudget(limits)
            done = loop.create_future()
            done.add_done_callback(_retrieved)  # an abandoned render's error is nobody's to log
            thread = threading.Thread(target=_render_thread, args=(loop, done, budget, fn, args),
                                      name="minivllm-template", daemon=True)
            thread.start()
            try:
                return await asyncio.wait_for(asyncio.shield(done), limits.timeout_s + self.grace_s)
            except asyncio.TimeoutError:
                budget.cancelled = True
                logger.warning("a chat template render did not stop at its deadline; its thread is left behind")
                raise TemplateTimeout(f"the chat template took longer than {limits.timeout_s:g} s to render") from None
            except asyncio.CancelledError:
                budget.cancelled = True
                raise


def _render_thread(loop: asyncio.AbstractEventLoop, done: asyncio.Future, budget: RenderBudget, fn, args) -> None:
    RENDER_BUDGET.set(budget)
    try:
        outcome = (True, fn(*args))
    except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
        outcome = (False, exc)
    try:
        loop.call_soon_threadsafe(_settle, done, outcome)
    except RuntimeError:
        pass  # the loop is closed: the server is gone and nobody waits


def _retrieved(done: asyncio.Future) -> None:
    if not done.cancelled():
        done.exception()


def _settle(done: asyncio.Future, outcome: tuple[bool, object]) -> None:
    if done.done():
        return
    ok, value = outcome
    if ok:
        done.set_result(value)
    else:
        done.set_exception(value)
