"""The Jinja sandbox chat templates render in: transformers' own, with a bound on what a render costs.

A chat template is code: the model's own runs with variables a client chooses
(``chat_template_kwargs``), and with ``--trust-request-chat-template`` a client may send a template
of its own. transformers renders templates in Jinja's ``ImmutableSandboxedEnvironment``, which keeps
a template from reaching Python's internals but not from looping for hours or building a string of
gigabytes. ``BoundedSandbox`` is that environment, and it also bounds what one render may cost:

- time: every loop iteration and every call checks the render's deadline (``TemplateLimits.timeout_s``);
- size: every string a template makes (by ``*``, ``+``, ``%``, ``~``, a filter or a method) and its
  output hold at most ``max_chars`` characters, every list ``max_items`` items; the operations that
  could make a larger one (repetition, padding, ``replace``, ``join``, format widths...) are checked
  before they run, from their operands;
- work: the characters and items made by filters, method calls and output add up, and a render may
  make at most ``max_work`` of them (a loop that makes large strings and drops them still ends);
- numbers: integers made by ``*`` and ``**`` hold at most ``max_int_bits`` bits.

Any of these ends the render with ``TemplateLimitError``; the server answers a 400 naming the bound.
The bounds are read from the render's ``RenderBudget`` (a context variable, set for each render by
server/chat_templates.py). Loops, output and ``~`` are checked by rewriting the parsed template
(``_Guards``) so that they pass through guard filters; calls and operators by the sandbox's own hooks.
"""

from __future__ import annotations

import contextvars
import functools
import re
import string
import time
from collections.abc import Mapping
from dataclasses import dataclass

import jinja2
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import pass_context
from jinja2.visitor import NodeTransformer


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may cost."""

    max_chars: int = 32 * 2**20  # any string made, and the output
    max_items: int = 100_000  # any list, tuple or dict made (Jinja's own bound on range())
    timeout_s: float = 5.0
    max_template_chars: int = 256 * 1024  # a template's source
    max_int_bits: int = 8192
    max_work_factor: int = 64  # the characters and items made in all: this many times max_chars

    @property
    def max_work(self) -> int:
        return self.max_work_factor * self.max_chars


class TemplateLimitError(jinja2.TemplateError):
    """A render went past one of its bounds (the message names it)."""


class TemplateTimeout(TemplateLimitError):
    pass


class TemplateOutputTooLong(TemplateLimitError):
    """The render's output went past ``max_chars``."""


# ----------------------------------------------------------------------------------- budget


class RenderBudget:
    """One render's deadline and work so far; the sandbox's hooks read it from ``RENDER_BUDGET``."""

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.timeout_s
        self.work = 0
        self.cancelled = False

    def tick(self) -> None:
        if self.cancelled:
            raise TemplateLimitError("the render was cancelled (the client went away)")
        if time.monotonic() > self.deadline:
            raise TemplateTimeout(f"the chat template took longer than {self.limits.timeout_s:g} s to render")

    def check_size(self, size: int, what: str, items: bool = False) -> None:
        limit = self.limits.max_items if items else self.limits.max_chars
        if size > limit:
            unit = "items" if items else "characters"
            raise TemplateLimitError(f"the chat template would make {what} of {size:,} {unit}; a render may make at "
                                     f"most {limit:,}")

    def charge(self, value) -> None:
        """Check a value just made, and count it against the render's work."""
        if isinstance(value, (str, bytes)):
            self.check_size(len(value), "a string")
        elif isinstance(value, (list, tuple, dict)):
            self.check_size(len(value), "a collection", items=True)
        else:
            return
        self.work += len(value)
        if self.work > self.limits.max_work:
            raise TemplateLimitError(f"the chat template made more than {self.limits.max_work:,} characters and "
                                     "items in all")


RENDER_BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("minivllm_template_budget", default=None)


def _budget() -> RenderBudget:
    budget = RENDER_BUDGET.get()
    if budget is None:
        raise RuntimeError("chat templates render only through render_conversation")
    return budget


def _text_size(value, limit: int) -> int:
    """About how many characters ``str(value)`` has, counted up to ``limit`` (containers walked, not joined)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, Mapping):
        value = [item for pair in value.items() for item in pair]
    elif not isinstance(value, (list, tuple, set, frozenset)):
        return 32  # numbers, None, undefined values, namespaces' reprs are short
    total = 2
    stack = [iter(value)]
    while stack and total <= limit:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, (str, bytes)):
            total += len(item) + 4
        elif isinstance(item, (list, tuple, set, frozenset, Mapping)) and len(stack) < 64:
            stack.append(iter(item.items() if isinstance(item, Mapping) else item))
        else:
            total += 32
    return total


_END = object()
# printf-style conversions: their width and precision, which may pad a short value to any length
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[diouxXeEfFgGcrsa%]")
# str.format specs: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[+\- ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?")


def _check_percent_format(fmt: str, args, budget: RenderBudget) -> None:
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for number in (width, precision):
            if number == "*":
                raise TemplateLimitError("'*' widths in % formatting are not allowed in chat templates")
            if number:
                budget.check_size(int(number), "a formatted field")
    budget.check_size(len(fmt) + _text_size(args, budget.limits.max_chars), "a formatted string")


def _check_str_format(fmt: str, args, kwargs, budget: RenderBudget) -> None:
    for _literal, field, spec, _conversion in string.Formatter().parse(fmt):
        if field is None or not spec:
            continue
        if "{" in spec:
            raise TemplateLimitError("nested format specs are not allowed in chat templates")
        match = _FORMAT_SPEC.match(spec)
        for number in match.groups() if match else ():
            if number:
                budget.check_size(int(number), "a formatted field")
    size = len(fmt) + _text_size(list(args), budget.limits.max_chars) + _text_size(kwargs, budget.limits.max_chars)
    budget.check_size(size, "a formatted string")


def _check_method(obj, args, kwargs, budget: RenderBudget) -> None:
    """Before a str/bytes method that can make a string longer than its input runs."""
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner = getattr(target, "__self__", None)
    if not isinstance(owner, (str, bytes)):
        return
    name = getattr(target, "__name__", "")
    if name in ("format", "format_map") and isinstance(owner, str):
        mapping = kwargs if name == "format" else (args[0] if args else {})
        _check_str_format(owner, args if name == "format" else (), mapping, budget)
    elif name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        budget.check_size(args[0], "a padded string")
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            budget.check_size(len(owner) + owner.count(b"\t" if isinstance(owner, bytes) else "\t") * tabsize,
                              "an expanded string")
    elif name == "replace" and len(args) >= 2:
        _check_replace(owner, args[0], args[1], args[2] if len(args) > 2 else -1, budget)
    elif name == "join" and args:
        _check_join(args[0], owner, budget)


def _check_replace(text, old, new, count, budget: RenderBudget) -> None:
    if not (isinstance(text, (str, bytes)) and type(old) is type(new) and isinstance(old, type(text))):
        return
    found = len(text) + 1 if not old else text.count(old)
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    budget.check_size(len(text) + found * (len(new) - len(old)), "a replaced string")


def _check_join(items, separator, budget: RenderBudget) -> None:
    if not isinstance(items, (list, tuple)):
        return  # a generator: its items are made (and checked) as the join reads them
    sep = len(separator) if isinstance(separator, (str, bytes)) else 0
    size = sum(_text_size(item, budget.limits.max_chars) for item in items) + sep * max(len(items) - 1, 0)
    budget.check_size(size, "a joined string")


# ---------------------------------------------------------------------------------- filters

# Filters that read their value as a whole (a list, a mapping): their input's text size is not theirs.
_CONTAINER_FILTERS = frozenset({
    "attr", "batch", "count", "d", "default", "dictsort", "first", "groupby", "items", "join", "last", "length",
    "list", "map", "max", "min", "random", "reject", "rejectattr", "reverse", "select", "selectattr", "slice",
    "sort", "sum", "unique"})


def _bounded_filter(name: str, func):
    """A filter that checks its budget before it runs and its result after."""
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # the context or environment comes first

    @functools.wraps(func)
    def bounded(*args, **kwargs):
        budget = _budget()
        budget.tick()
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        _check_filter(name, value, rest, kwargs, budget)
        result = func(*args, **kwargs)
        budget.charge(result)
        return result

    return bounded


def _arg(rest, kwargs, index: int, name: str, default=None):
    return rest[index] if len(rest) > index else kwargs.get(name, default)


def _check_filter(name: str, value, rest, kwargs, budget: RenderBudget) -> None:
    limits = budget.limits
    if name not in _CONTAINER_FILTERS:
        budget.check_size(_text_size(value, limits.max_chars), f"the text of |{name}'s input")
    if name == "center":
        width = _arg(rest, kwargs, 0, "width", 80)
        if isinstance(width, int):
            budget.check_size(width, "a centred string")
    elif name == "indent":
        width = _arg(rest, kwargs, 0, "width", 4)
        pad = width if isinstance(width, int) else len(str(width))
        text = str(value) if isinstance(value, str) else ""
        budget.check_size(len(text) + pad * (text.count("\n") + 1), "an indented string")
    elif name == "replace":
        _check_replace(value, _arg(rest, kwargs, 0, "old"), _arg(rest, kwargs, 1, "new"),
                       _arg(rest, kwargs, 2, "count", -1), budget)
    elif name == "join":
        _check_join(value, _arg(rest, kwargs, 0, "d", ""), budget)
    elif name == "format" and isinstance(value, str):
        _check_percent_format(value, list(rest) + list(kwargs.values()), budget)
    elif name == "wordwrap" and isinstance(value, str):
        wrap = _arg(rest, kwargs, 2, "wrapstring") or "\n"
        width = _arg(rest, kwargs, 0, "width", 79)
        lines = len(value) // max(width, 1) + sum(value.count(c) for c in " \n-") + 1 if isinstance(width, int) else 1
        budget.check_size(len(value) + lines * len(str(wrap)), "a wrapped string")
    elif name in ("batch", "slice"):
        size = _arg(rest, kwargs, 0, "linecount" if name == "batch" else "slices", 1)
        if isinstance(size, int):
            budget.check_size(size, f"|{name}'s groups", items=True)
    elif name == "sum":
        start = _arg(rest, kwargs, 1, "start", 0)
        if isinstance(start, (list, tuple)) and isinstance(value, (list, tuple)):
            total = len(start) + sum(len(v) for v in value if isinstance(v, (list, tuple)))
            budget.check_size(total, "a summed list", items=True)
    elif name == "tojson":
        for arg in (_arg(rest, kwargs, 1, "indent"), *(_arg(rest, kwargs, 2, "separators") or ())):
            if arg is not None and (len(arg) if isinstance(arg, str) else arg if isinstance(arg, int) else 0) > 64:
                raise TemplateLimitError("tojson's indent and separators are limited to 64 characters")


@pass_context
def _loop_guard(context, iterable):
    """Every loop iterates through this: one deadline check per iteration."""
    budget = _budget()
    for item in iterable:
        budget.tick()
        yield item


@pass_context
def _output_guard(context, value):
    """Every piece of output (also inside ``{% set %}`` blocks and macros) is counted before it is written."""
    budget = _budget()
    if isinstance(value, str):
        if len(value) > budget.limits.max_chars:
            raise TemplateOutputTooLong(f"an output of {len(value):,} characters")
        budget.charge(value)
    else:
        budget.check_size(_text_size(value, budget.limits.max_chars), "an output value")
    return value


@pass_context
def _size_guard(context, value):
    """Each operand of ``~``: its text is checked before the operands are joined."""
    budget = _budget()
    budget.check_size(_text_size(value, budget.limits.max_chars), "an operand of ~")
    return value


_LOOP_GUARD, _OUTPUT_GUARD, _SIZE_GUARD = "minivllm_loop_guard", "minivllm_output_guard", "minivllm_size_guard"


class _Guards(NodeTransformer):
    """Rewrites a parsed template so that loops, output and ``~`` pass through the guards above."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = _filter(node.iter, _LOOP_GUARD)
        return node

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        node = self.generic_visit(node)
        node.nodes = [_filter(child, _OUTPUT_GUARD) for child in node.nodes]
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Concat:
        node = self.generic_visit(node)
        node.nodes = [_filter(child, _SIZE_GUARD) for child in node.nodes]
        return node


def _filter(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


# ------------------------------------------------------------------------------ environment


def _check_binop(operator: str, left, right, budget: RenderBudget) -> None:
    """Before ``*``, ``+``, ``**`` or ``%`` runs: the size of what it would make."""
    if operator == "*":
        seq, times = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
            budget.check_size(len(seq) * max(times, 0), "a repeated value", items=isinstance(seq, (list, tuple)))
        elif isinstance(left, int) and isinstance(right, int):
            _check_bits(left.bit_length() + right.bit_length(), budget)
    elif operator == "+":
        for kinds, items in (((str, bytes), False), ((list, tuple), True)):
            if isinstance(left, kinds) and isinstance(right, kinds):
                budget.check_size(len(left) + len(right), "a concatenated value", items=items)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _check_bits(left.bit_length() * right, budget)
    elif operator == "%" and isinstance(left, (str, bytes)):
        _check_percent_format(left if isinstance(left, str) else left.decode("latin-1"), right, budget)


def _check_bits(num_bits: int, budget: RenderBudget) -> None:
    if num_bits > budget.limits.max_int_bits:
        raise TemplateLimitError(f"the chat template would make an integer of about {num_bits:,} bits; a render may "
                                 f"make at most {budget.limits.max_int_bits:,}")


def _check_lipsum(obj, args, kwargs) -> None:
    if obj is jinja2.utils.generate_lorem_ipsum:
        n, most = _arg(args, kwargs, 0, "n", 5), _arg(args, kwargs, 3, "max", 100)
        if not (isinstance(n, int) and isinstance(most, int) and n <= 100 and most <= 1000):
            raise TemplateLimitError("lipsum() is limited to 100 paragraphs of at most 1000 words in chat templates")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox for chat templates, with every loop, call, operator, filter and output
    checked against the render's ``RenderBudget`` (the module docstring says what is bounded)."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, filters: dict | None = None, globals: dict | None = None, **options):
        super().__init__(**options)
        self.filters.update(filters or {})
        self.filters = {name: _bounded_filter(name, func) for name, func in self.filters.items()}
        self.filters.update({_LOOP_GUARD: _loop_guard, _OUTPUT_GUARD: _output_guard, _SIZE_GUARD: _size_guard})
        self.globals.update(globals or {})

    def _parse(self, source, name, filename):
        return _Guards().visit(super()._parse(source, name, filename))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's own signature
        budget = _budget()
        budget.tick()
        _check_method(__obj, args, kwargs, budget)
        _check_lipsum(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        budget.charge(result)
        return result

    def call_binop(self, context, operator, left, right):
        budget = _budget()
        budget.tick()
        _check_binop(operator, left, right, budget)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, (str, bytes)):
            budget.check_size(len(result), "a string")
        return result
