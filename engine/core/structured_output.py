"""Grammar-constrained decoding on xgrammar: checked by the API server, compiled off the step path, masks per step.

    API server  ──> check_structured_outputs, once per request and off the event loop: size and
                    nesting bounds first, then the grammar is built (not compiled): a bad one is a 400
    add_request ──> GrammarManager.attach: compiled on a thread of its own (engine/core/grammar_compiles.py;
                    several at once, cached by spec up to a memory bound) within a time bound
    schedule    ──> a request waits until its grammar is compiled; then it gets a matcher. A compile
                    that fails or passes its time bound ends its request with an error (StepPipeline)
    each step   ──> fill_bitmask(the step's sampled requests): one int32 word per 32 tokens
                    per constrained row, filled at once (xgrammar's batch matcher, multithreaded)
                    into pinned memory; the sampler applies it to those rows on the device
    update      ──> RequestGrammar.advance(token) for the step's tokens first; the next step's
                    masks are filled on a thread while the scheduler does its bookkeeping (a
                    grammar that has ended or refused its token ends the request) and the caller
                    handles the outputs; that step's sampling is queued when the engine next steps

With steps planned ahead, a step is launched before the previous step's tokens are known;
its forward pass runs while the host waits, and only its sampling waits for the masks,
which are filled once those tokens are accepted (``engine/core/step_pipeline.py`` orders this).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import re
import select
import time
import weakref

import torch
import xgrammar as xgr

from engine.core.grammar_compiles import CompileJob, CompileQueue
from engine.sampling_params import SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger("minivllm")

# Objects and arrays nested in a JSON schema (vLLM's bound: building a grammar costs steeply more with each
# level; OpenAI allows 10). A structural tag wraps its schemas in a few levels of its own.
MAX_JSON_NESTING = 64
_STRUCTURAL_TAG_NESTING = 16


def check_structured_outputs(spec: StructuredOutputsParams, max_bytes: int | None = None) -> None:
    """Raise SamplingParamsError (naming ``spec.param``) when the grammar is larger than ``max_bytes``, nested
    deeper than ``MAX_JSON_NESTING``, or cannot be built: a bad schema, regex or EBNF. No tokenizer is
    needed, so the API server checks before the engine sees it. Building takes up to a few tenths of a
    second within these bounds: call it off an event loop."""
    param = spec.param
    size = spec_num_bytes(spec)
    if max_bytes is not None and size > max_bytes:
        raise SamplingParamsError(f"{param}: the grammar is {size} bytes, more than this server compiles "
                                  f"({max_bytes} bytes, --structured-outputs-max-bytes)", param)
    for text, limit in ((spec.json, MAX_JSON_NESTING),
                        (spec.structural_tag, MAX_JSON_NESTING + _STRUCTURAL_TAG_NESTING)):
        if text is not None and _nests_deeper(text, limit):
            raise SamplingParamsError(f"{param}: the JSON schema is nested too deeply: objects and arrays may nest "
                                      f"at most {MAX_JSON_NESTING} levels", param)
    try:
        _grammar(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise SamplingParamsError(f"{param}: this grammar cannot be compiled: {_reason(exc)}", param) from None


def spec_num_bytes(spec: StructuredOutputsParams) -> int:
    """The size of what defines the grammar (UTF-8 bytes of its schema, regex, EBNF, tag or choices)."""
    texts = [t for t in (spec.json, spec.regex, spec.grammar, spec.structural_tag) if t is not None]
    texts += spec.choice or []
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) + 3 * len(spec.choice or [])


def _nests_deeper(text: str, limit: int) -> bool:
    """Whether a JSON document nests objects and arrays more than ``limit`` levels (malformed JSON is left to
    the grammar's own error)."""
    try:
        root = json.loads(text)
    except RecursionError:
        return True
    except ValueError:
        return False
    level = [root] if isinstance(root, (dict, list)) else []
    for _ in range(limit):
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its time stamp and C++ source location."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())


_TIMINGS_KEPT = 100_000

# Whitespace between JSON tokens is free, but not endless: a run of at most this many characters
# (deep indentation fits; a model cannot stall in whitespace forever).
_MAX_JSON_WHITESPACE = 32


# The thinking block a reasoning model may write before the constrained part (the constraint starts
# after it): "open" continues a block the prompt opened, "optional" allows a whole block or none.
# Qwen3 and DeepSeek-R1 write two newlines after the block; the grammar writes them too.
_THINK_BLOCK = {"type": "sequence", "elements": [
    {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": "</think>"},
    {"type": "const_string", "value": "\n\n"}]}
_THINKING = {
    "open": _THINK_BLOCK,
    "optional": {"type": "optional", "content": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<think>"}, _THINK_BLOCK]}},
}


def _grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    body = _body_grammar(spec)
    if spec.reasoning is None or spec.structural_tag is not None:
        return body
    thinking = xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag",
                                                           "format": _THINKING[spec.reasoning]}))
    return xgr.Grammar.concat(thinking, body)


def _body_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    if spec.structural_tag is not None:
        return xgr.Grammar.from_structural_tag(spec.structural_tag)
    if spec.json is not None:
        return xgr.Grammar.from_json_schema(spec.json, **_json_options(spec))
    if spec.json_object:
        return xgr.Grammar.builtin_json_grammar()
    if spec.regex is not None:
        return xgr.Grammar.from_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(c) for c in spec.choice)  # EBNF string literals use JSON escapes
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    return xgr.Grammar.from_ebnf(spec.grammar)


def _json_options(spec: StructuredOutputsParams) -> dict:
    if spec.any_whitespace:
        return {"strict_mode": spec.strict, "max_whitespace_cnt": _MAX_JSON_WHITESPACE}
    return {"strict_mode": spec.strict, "any_whitespace": False}  # xgrammar's separators: ", " and ": "


def _spec_key(spec: StructuredOutputsParams) -> tuple:
    """What makes two specs the same grammar (not the field they came in)."""
    return (spec.json, spec.json_object, spec.regex, tuple(spec.choice) if spec.choice is not None else None,
            spec.grammar, spec.structural_tag, spec.strict, spec.reasoning, spec.any_whitespace)


class RequestGrammar:
    """One request's grammar: compiling (or queued behind other compiles), then a matcher that follows its
    tokens; or why it has none (``error``: the compile failed, or took longer than ``timeout_s``)."""

    def __init__(self, job: CompileJob, compiles: CompileQueue, timeout_s: float, param: str):
        self._job: CompileJob | None = job
        self._compiles = compiles
        self.timeout_s = timeout_s
        self.param = param
        self.attached_s = time.monotonic()
        self.matcher: xgr.GrammarMatcher | None = None
        self.error: str | None = None
        self.ended = False  # it refused a token or took its last: the request ends, no mask any more

    @property
    def ready(self) -> bool:
        """Compiled, with a matcher: the request may be scheduled."""
        if self.matcher is None and self.error is None and self._job is not None and self._job.done:
            job = self._job
            self._let_go()
            if job.error is not None:
                self.error = f"{self.param}: this grammar cannot be compiled: {_reason(job.error) or repr(job.error)}"
            else:
                self.matcher = xgr.GrammarMatcher(job.result)
        return self.matcher is not None

    @property
    def deadline_s(self) -> float | None:
        """When its compile passes its time bound (``time.monotonic()``); None while queued or once settled.
        The bound counts from when the compile started or the request came, whichever is later."""
        job = self._job
        if job is None or job.started_s is None or job.done:
            return None
        return max(job.started_s, self.attached_s) + self.timeout_s

    def settle(self, now: float) -> bool:
        """True once the request can be scheduled or must fail (``error``): a compile past its deadline
        fails it (the compile goes on, given up, unless other requests wait for it)."""
        if self.ready or self.error is not None:
            return True
        deadline = self.deadline_s
        if deadline is None or now < deadline:
            return False
        self.error = (f"{self.param}: compiling the grammar took longer than {self.timeout_s:g} s "
                      f"(--structured-outputs-compile-timeout); simplify it, or ask again once the server has "
                      f"compiled it (it keeps compiled grammars)")
        self._let_go()
        return True

    def release(self) -> None:
        """The request has ended: it no longer waits for its compile."""
        self._let_go()

    def _let_go(self) -> None:
        if self._job is not None:
            self._compiles.release(self._job)
            self._job = None

    def advance(self, token_id: int) -> None:
        """Take one sampled token (before the scheduler's bookkeeping, which reads ``ended``)."""
        accepted = self.matcher is not None and self.matcher.accept_token(token_id)
        self.ended = not accepted or self.matcher.is_terminated()

    def allowed_prefix(self, proposals: list[int]) -> list[int]:
        """The proposed tokens the grammar takes, from the first up to the first it refuses (speculative decoding:
        the rest could not be accepted); the matcher is left as it was."""
        if self.matcher is None or self.ended:
            return []
        taken = 0
        for token_id in proposals:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            taken += 1
        if taken:
            self.matcher.rollback(taken)
        return proposals[:taken]


class GrammarManager:
    """The engine's grammars: one compiler (its cache bounded by ``cache_limit_mb``; 0: no cache), compiles
    on threads (``max_compiles`` at once) that each get ``compile_timeout_s``, and the per-step masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], max_num_seqs: int,
                 cache_limit_mb: int = 512, compile_timeout_s: float = 60.0, max_compiles: int | None = None):
        start = time.perf_counter()
        # The grammars see the tokenizer's tokens only. The ids a model's embedding is padded with
        # (Qwen3: 151,936 rows for 151,669 tokens) are not tokens: told the model's size, xgrammar would
        # take each of them for a special token and every accept would pay for them (7x slower with
        # 100k of them). Their bits are zero: the sampler pads the masks to the model's vocabulary.
        vocab_size = min(vocab_size, len(tokenizer))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids) or None)
        # Each distinct schema's compiled grammar takes megabytes (its token masks): the cache is bounded
        # (least recently used ones go first), as vLLM's VLLM_XGRAMMAR_CACHE_MB bounds its.
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=cache_limit_mb > 0,
                                            cache_limit_bytes=cache_limit_mb * 2**20 if cache_limit_mb > 0 else -1)
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        # The engine core sleeps on this pipe (and its inputs) while every request waits for a grammar.
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_read, False)
        os.set_blocking(self._wakeup_write, False)
        self._closed = False
        self._close_pipe = weakref.finalize(self, _close_fds, self._wakeup_read, self._wakeup_write)
        if max_compiles is None:
            max_compiles = max(2, min(8, ((os.cpu_count() or 2) + 1) // 2))  # as vLLM sizes its compile pool
        self._compiles = CompileQueue(max_compiles, self._wake)
        self._pending: dict[str, RequestGrammar] = {}  # request id -> its grammar, until ready or failed
        self._fill_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minivllm-masks")
        self._batch = xgr.BatchGrammarMatcher()
        # Two pinned buffers in turn: one step's mask may still be copying while the next is filled.
        self._bitmasks = [xgr.allocate_token_bitmask(max_num_seqs, vocab_size) for _ in range(2)]
        if torch.cuda.is_available():
            self._bitmasks = [b.pin_memory() for b in self._bitmasks]
        self._turn = 0
        # For benchmarks, the latest ones only (a server runs for days): per compile (cache hits
        # included), per step with masks (host time to fill them), per step with grammars (to advance them).
        self.compile_seconds: collections.deque[float] = collections.deque(maxlen=_TIMINGS_KEPT)
        self.fill_seconds: collections.deque[float] = collections.deque(maxlen=_TIMINGS_KEPT)
        self.accept_seconds: collections.deque[float] = collections.deque(maxlen=_TIMINGS_KEPT)
        logger.info("structured outputs: xgrammar %s ready in %.2f s (compiled grammars cached up to %s; "
                    "%d compiles at once, each within %g s)", _xgrammar_version(), time.perf_counter() - start,
                    f"{cache_limit_mb} MiB" if cache_limit_mb > 0 else "nothing", max_compiles, compile_timeout_s)

    def attach(self, request_id: str, spec: StructuredOutputsParams) -> RequestGrammar:
        """A request's grammar, compiling (a spec already compiling is joined, not compiled twice)."""
        job = self._compiles.acquire(_spec_key(spec), lambda: self._compile(spec))
        grammar = self._pending[request_id] = RequestGrammar(job, self._compiles, self.compile_timeout_s, spec.param)
        return grammar

    @property
    def num_pending(self) -> int:
        """Requests whose grammar is not compiled yet (or has failed and is not settled yet)."""
        return len(self._pending)

    def settle(self) -> list[tuple[str, str, str]]:
        """(request id, why, the request field) of each request whose compile failed or passed its time
        bound; requests whose grammar is ready stop being pending."""
        if not self._pending:
            return []
        now, failed = time.monotonic(), []
        for request_id, grammar in list(self._pending.items()):
            if grammar.settle(now):
                del self._pending[request_id]
                if grammar.error is not None:
                    failed.append((request_id, grammar.error, grammar.param))
        return failed

    def forget(self, request_ids) -> None:
        """Requests that ended (aborted) stop waiting for their compiles."""
        if self._pending:
            for request_id in request_ids:
                grammar = self._pending.pop(request_id, None)
                if grammar is not None:
                    grammar.release()

    def seconds_to_deadline(self) -> float | None:
        """How long until the first running compile passes its time bound (None: none is running)."""
        deadlines = [d for d in (g.deadline_s for g in self._pending.values()) if d is not None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    @property
    def wakeup_fd(self) -> int:
        """Readable once a compile has ended since the last ``clear_wakeup``."""
        return self._wakeup_read

    def clear_wakeup(self) -> None:
        try:
            while os.read(self._wakeup_read, 4096):
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout_s: float | None) -> None:
        """Block until a compile ends or ``timeout_s`` passes (None: at most a second)."""
        select.select([self._wakeup_read], [], [], 1.0 if timeout_s is None else max(0.0, timeout_s))
        self.clear_wakeup()

    def _wake(self) -> None:
        if self._closed:
            return
        try:
            os.write(self._wakeup_write, b"x")
        except (BlockingIOError, OSError):
            pass  # full (the reader is behind: it will wake anyway) or closed (shut down)

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        if spec.reasoning is not None or spec.structural_tag is not None:
            compiled = self.compiler.compile_grammar(_grammar(spec))
        elif spec.json is not None:
            compiled = self.compiler.compile_json_schema(spec.json, **_json_options(spec))
        elif spec.json_object:
            compiled = self.compiler.compile_builtin_json_grammar()
        else:
            compiled = self.compiler.compile_grammar(_grammar(spec))
        self.compile_seconds.append(time.perf_counter() - start)
        return compiled
    def fill_bitmask(self, grammars: list[RequestGrammar | None],
                     proposals: list[list[int]] | None = None) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens of one step's sampled rows, in their order: a [rows, vocab/32] int32 bitmask
        (host memory) of which only the constrained rows (the list returned beside it) are filled and
        meant; None when no row has a grammar. ``proposals``: a speculative step's proposed tokens per sampled
        row, whose logits rows are each row's 1 + k positions: position j's mask is the grammar's after the row's
        first j proposals (which it takes: ``allowed_prefix``)."""
        if proposals is not None:
            return self._fill_verification(grammars, proposals)
        job = self._fill_job(grammars)
        return None if job is None else job()

    def _fill_verification(self, grammars: list[RequestGrammar | None],
                           proposals: list[list[int]]) -> tuple[torch.Tensor, list[int]] | None:
        start = time.perf_counter()
        num_rows = sum(1 + len(p) for p in proposals)
        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        rows, first = [], 0
        for grammar, tokens in zip(grammars, proposals):
            if grammar is not None and grammar.matcher is not None and not grammar.ended:
                matcher = grammar.matcher
                for j in range(len(tokens) + 1):
                    matcher.fill_next_token_bitmask(bitmask, first + j)
                    rows.append(first + j)
                    if j < len(tokens) and not matcher.accept_token(tokens[j]):
                        raise RuntimeError(f"a proposal the grammar refuses was verified: {tokens}")
                if tokens:
                    matcher.rollback(len(tokens))
            first += 1 + len(tokens)
        self.fill_seconds.append(time.perf_counter() - start)
        return (bitmask, rows) if rows else None

    def advance(self, grammars: list[RequestGrammar | None], token_ids: list[int],
                accepted: list[list[int]] | None = None) -> None:
        """One step's tokens into their grammars (``RequestGrammar.advance``; None: a request without one), timed
        for benchmarks; ``accepted``: a speculative step's accepted proposals per row, which come first."""
        start = time.perf_counter()
        for i, (grammar, token_id) in enumerate(zip(grammars, token_ids)):
            if grammar is not None:
                for proposal in accepted[i] if accepted is not None else ():
                    grammar.advance(proposal)
                grammar.advance(token_id)
        self.accept_seconds.append(time.perf_counter() - start)

    def fill_bitmask_async(self, grammars: list[RequestGrammar | None]) -> concurrent.futures.Future | None:
        """``fill_bitmask`` on the fill thread (xgrammar lets go of the GIL while it fills), so the
        caller's bookkeeping runs meanwhile; None when no row has a grammar. The grammars must not
        take tokens until the future is done."""
        job = self._fill_job(grammars)
        return None if job is None else self._fill_pool.submit(job)

    def _fill_job(self, grammars: list[RequestGrammar | None]):
        rows = [i for i, g in enumerate(grammars) if g is not None and g.matcher is not None and not g.ended]
        if not rows:
            return None
        self._turn ^= 1
        bitmask = self._bitmasks[self._turn][: len(grammars)]
        matchers = [grammars[i].matcher for i in rows]

        def fill():
            start = time.perf_counter()
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
            self.fill_seconds.append(time.perf_counter() - start)
            return bitmask, rows
        return fill

    def shutdown(self) -> None:
        self._closed = True
        self._compiles.close()
        self._fill_pool.shutdown(wait=True)
        self._close_pipe()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def _xgrammar_version() -> str:
    try:
        from importlib.metadata import version

        return version("xgrammar")
    except Exception:  # noqa: BLE001 - only for the log line
        return "?"
