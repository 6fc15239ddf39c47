"""Grammar-constrained decoding on xgrammar: compiled off the step path, masks filled per step.

    add_request ──> GrammarManager.attach: compile in a worker thread (cached by spec)
    schedule    ──> a request waits until its grammar is compiled; then it gets a matcher
    each step   ──> fill_bitmask(the step's sampled requests): one int32 word per 32 tokens
                    per constrained row, filled at once (xgrammar's batch matcher, multithreaded)
                    into pinned memory; the sampler applies it to those rows on the device
    update      ──> RequestGrammar.advance(token) for the step's tokens first; the next step's
                    masks are filled on a thread while the scheduler does its bookkeeping (a
                    grammar that has ended or refused its token ends the request) and the caller
                    handles the outputs; that step's sampling is queued when the engine next steps

With steps planned ahead, a step is launched before the previous step's tokens are known;
its forward pass runs while the host waits, and only its sampling waits for the masks,
which are filled once those tokens are accepted (``LLMEngine`` orders this).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re
import time

import torch
import xgrammar as xgr

from engine.sampling_params import SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger("minivllm")


def check_structured_outputs(spec: StructuredOutputsParams, param: str = "structured_outputs") -> None:
    """Raise SamplingParamsError (naming ``param``) when the grammar cannot be built: a bad schema,
    regex or EBNF. No tokenizer is needed, so the API server checks before the engine sees it."""
    try:
        _grammar(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise SamplingParamsError(f"{param}: this grammar cannot be compiled: {_reason(exc)}", param) from None


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
        return xgr.Grammar.from_json_schema(spec.json, strict_mode=spec.strict, max_whitespace_cnt=_MAX_JSON_WHITESPACE)
    if spec.json_object:
        return xgr.Grammar.builtin_json_grammar()
    if spec.regex is not None:
        return xgr.Grammar.from_regex(spec.regex)
    if spec.choice is not None:
        alternatives = " | ".join(json.dumps(c) for c in spec.choice)  # EBNF string literals use JSON escapes
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    return xgr.Grammar.from_ebnf(spec.grammar)


class RequestGrammar:
    """One request's grammar: compiled (or compiling), then a matcher that follows its tokens."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future
        self.matcher: xgr.GrammarMatcher | None = None
        self.error: str | None = None
        self.ended = False  # it refused a token or took its last: the request ends, no mask any more

    @property
    def ready(self) -> bool:
        """Compiled (or failed): the request may be scheduled."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._future.done():
            return False
        try:
            # No rollback history: tokens are never taken back (speculative decoding would).
            self.matcher = xgr.GrammarMatcher(self._future.result(), max_rollback_tokens=0)
        except Exception as exc:  # noqa: BLE001 - reported on the request, the engine goes on
            self.error = _reason(exc) or repr(exc)
        return True

    def advance(self, token_id: int) -> None:
        """Take one sampled token (before the scheduler's bookkeeping, which reads ``ended``)."""
        accepted = self.matcher is not None and self.matcher.accept_token(token_id)
        self.ended = not accepted or self.matcher.is_terminated()


class GrammarManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], max_num_seqs: int):
        start = time.perf_counter()
        # The grammars see the tokenizer's tokens only. The ids a model's embedding is padded with
        # (Qwen3: 151,936 rows for 151,669 tokens) are not tokens: told the model's size, xgrammar would
        # take each of them for a special token and every accept would pay for them (7x slower with
        # 100k of them). Their bits are zero: the sampler pads the masks to the model's vocabulary.
        vocab_size = min(vocab_size, len(tokenizer))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minivllm-grammar")
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
        logger.info("structured outputs: xgrammar %s ready in %.2f s", getattr(xgr, "__version__", "?"),
                    time.perf_counter() - start)

    def attach(self, spec: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(self._pool.submit(self._compile, spec))

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        if spec.reasoning is not None or spec.structural_tag is not None:
            compiled = self.compiler.compile_grammar(_grammar(spec))
        elif spec.json is not None:
            compiled = self.compiler.compile_json_schema(spec.json, strict_mode=spec.strict,
                                                         max_whitespace_cnt=_MAX_JSON_WHITESPACE)
        elif spec.json_object:
            compiled = self.compiler.compile_builtin_json_grammar()
        else:
            compiled = self.compiler.compile_grammar(_grammar(spec))
        self.compile_seconds.append(time.perf_counter() - start)
        return compiled

    def fill_bitmask(self, grammars: list[RequestGrammar | None]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens of one step's sampled rows, in their order: a [rows, vocab/32] int32 bitmask
        (host memory) of which only the constrained rows (the list returned beside it) are filled and
        meant; None when no row has a grammar."""
        job = self._fill_job(grammars)
        return None if job is None else job()

    def advance(self, grammars: list[RequestGrammar], token_ids: list[int]) -> None:
        """One step's tokens into their grammars (``RequestGrammar.advance``), timed for benchmarks."""
        start = time.perf_counter()
        for grammar, token_id in zip(grammars, token_ids):
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
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=True)
