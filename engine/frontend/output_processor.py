"""From engine outputs to what a caller reads: one output processor for ``LLM`` and the server.

    add_request(id, prompts, params) ──> one engine request per choice: "{id}-{index}",
                                          index = prompt_index * n + sample_index
                                          (the choice keeps its request and its engine request's id)
    process(step's EngineOutputs) ──> per choice: detokenize, stop strings, logprobs
                                  ──> ChoiceDelta to the request's sink; ids to abort

A stop string is found here, not in the engine, so the choice it ends must be aborted in
the engine by the caller (``process`` returns those ids). Outputs of requests that are
no longer known (aborted, or stopped by a stop string while a step was in flight) are
dropped. The processor never waits: the server calls it once per engine step for every
request in the step, and the sinks merge deltas until their reader catches up.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.frontend.request_metrics import ChoiceClock, MetricsRecorder, RequestTimings, StepMetrics
from engine.outputs import EngineOutput, FinishReason, Logprobs
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice produced since its last delta; ``finish_reason`` is set on its last one."""

    index: int
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop_token_ids entry that ended it
    # On the choice's first delta with tokens, when asked for: one entry per prompt token after the first.
    prompt_logprobs: list[Logprobs] | None = None
    pooled: list[float] | None = None  # a pooling request's output, on its last delta

    def merge(self, later: ChoiceDelta) -> None:
        """Append a later delta of the same choice (for a reader that fell behind)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.pooled = later.pooled if later.pooled is not None else self.pooled
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.logprobs.extend(later.logprobs)
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason


class OutputSink(Protocol):
    """Where a request's deltas go: the server's stream, or the offline result being built."""

    def put(self, delta: ChoiceDelta) -> None: ...


@dataclass(frozen=True)
class ChildRequest:
    """One engine request of a choice."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0  # which of the request's prompts it is for (its images go with it)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class _Choice:
    request: RequestState  # the caller's request: its parent
    index: int
    prompt_index: int
    child_id: str  # the id of its engine request (a beam search's later choices have none of their own)
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    clock: ChoiceClock
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finished: bool = False


@dataclass
class RequestState:
    """One caller request: its prompts, its choices, and the sink its deltas go to."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    sink: OutputSink
    arrival_s: float
    choices: list[_Choice] = field(default_factory=list)
    num_unfinished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def usage(self) -> Usage:
        """Prompt tokens count once per prompt; cached tokens are those every sample of a prompt found cached."""
        n = self.params.n
        cached = sum(min(c.num_cached_tokens for c in self.choices[p * n:(p + 1) * n]) for p in range(len(self.prompts)))
        return Usage(prompt_tokens=sum(len(p) for p in self.prompts),
                     completion_tokens=sum(c.num_output_tokens for c in self.choices), cached_tokens=cached)

    def timings(self) -> RequestTimings | None:
        """vLLM's per-request timings, for a request of one choice (None for several: they would not be
        one stream's)."""
        if len(self.choices) != 1:
            return None
        choice = self.choices[0]
        return RequestTimings.of(choice.clock, choice.num_output_tokens)


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


class OutputProcessor:
    def __init__(self, tokenizer, metrics: MetricsRecorder | None = None):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.requests: dict[str, RequestState] = {}
        self._choices: dict[str, _Choice] = {}  # engine request id -> its choice

    def __len__(self) -> int:
        return len(self.requests)

    def add_request(self, request_id: str, prompts: Sequence[list[int]], params: SamplingParams, sink: OutputSink,
                    arrival_s: float | None = None) -> tuple[RequestState, list[ChildRequest]]:
        """Register a request; returns its state and the engine requests to add, one per choice.

        Seeded samples get ``seed + sample_index`` so they differ from each other yet reproduce.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        state = RequestState(request_id, [list(p) for p in prompts], params, sink,
                             time.monotonic() if arrival_s is None else arrival_s)
        children = []
        for prompt_index, prompt in enumerate(state.prompts):
            for sample_index in range(params.n):
                index = prompt_index * params.n + sample_index
                seed = None if params.seed is None else params.seed + sample_index
                child_params = dataclasses.replace(params, n=1, seed=seed)
                choice = _Choice(state, index, prompt_index, child_request_id(request_id, index), child_params,
                                 self._detokenizer(prompt, child_params), ChoiceClock(state.arrival_s))
                state.choices.append(choice)
                if params.use_beam_search:  # one engine request per prompt; its n best beams are the choices
                    if sample_index == 0:
                        children.append(ChildRequest(choice.child_id, prompt, params, prompt_index))
                        self._choices[choice.child_id] = choice
                    continue
                children.append(ChildRequest(choice.child_id, prompt, child_params, prompt_index))
                self._choices[choice.child_id] = choice
        state.num_unfinished = len(state.choices)
        self.requests[request_id] = state
        return state, children

    def process(self, outputs: Sequence[EngineOutput]) -> list[str]:
        """Turn one step's outputs into deltas; returns the engine requests that a stop string ended."""
        now = time.monotonic()
        step = StepMetrics() if self.metrics is not None else None
        to_abort = []
        choices = self._choices
        for out in outputs:
            choice = choices.get(out.request_id)
            if choice is None:
                continue  # aborted, or ended by a stop string while this step ran
            if out.beams is not None:
                self._beam_choices(choice, out, now, step)
                continue
            _record_tokens(step, choice, out, now)
            choice.num_output_tokens += len(out.new_token_ids)
            choice.num_cached_tokens = out.num_cached_tokens
            choice.num_preemptions = out.num_preemptions
            delta = self._delta(choice, out)
            if delta.finish_reason is not None:
                self._finish(choice, delta.finish_reason, now, step)
                if not out.finished:
                    to_abort.append(out.request_id)
            choice.request.sink.put(delta)
        if step is not None:
            self.metrics.record(step)
        return to_abort

    def request_of(self, child_id: str) -> str | None:
        """The id of the caller's request that an engine request serves; None once its choice has finished (or
        for an id never given out)."""
        choice = self._choices.get(child_id)
        return None if choice is None else choice.request.request_id

    def _beam_choices(self, first: _Choice, out: EngineOutput, now: float, step: StepMetrics | None) -> None:
        """A finished beam search: its beams, best first, are the choices of its prompt."""
        state = first.request
        for i, beam in enumerate(out.beams):
            choice = state.choices[first.index + i]
            beam_out = EngineOutput(out.request_id, beam.token_ids, finished=True, finish_reason=beam.finish_reason,
                                    stop_token_id=beam.stop_token_id, num_prompt_tokens=out.num_prompt_tokens,
                                    num_cached_tokens=out.num_cached_tokens, queue_time_s=out.queue_time_s,
                                    num_preemptions=out.num_preemptions)
            _record_tokens(step, choice, beam_out, now)
            choice.num_output_tokens += len(beam.token_ids)
            choice.num_cached_tokens = out.num_cached_tokens
            choice.num_preemptions = out.num_preemptions
            delta = self._delta(choice, beam_out)
            self._finish(choice, delta.finish_reason, now, step)
            state.sink.put(delta)
        for choice in state.choices[first.index + len(out.beams):first.index + state.params.n]:
            if not choice.finished:  # fewer beams than asked for (a vocabulary smaller than the width)
                self._finish(choice, out.finish_reason, now, step)
                state.sink.put(ChoiceDelta(choice.index, choice.prompt_index, "", [], [], out.finish_reason))

    def abort(self, request_id: str) -> list[str]:
        """End a request's unfinished choices with "abort"; returns their engine request ids to abort."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        now = time.monotonic()
        step = StepMetrics() if self.metrics is not None else None
        aborted = []
        for choice in state.choices:
            if choice.finished:
                continue
            text = choice.detokenizer.next_delta(finished=True) if choice.detokenizer is not None else ""
            self._finish(choice, FinishReason.ABORT, now, step)
            state.sink.put(ChoiceDelta(choice.index, choice.prompt_index, text, [], [], FinishReason.ABORT))
            aborted.append(choice.child_id)
        if step is not None:
            self.metrics.record(step)
        return aborted

    def clear(self) -> None:
        """Forget every request (the engine is gone)."""
        self.requests.clear()
        self._choices.clear()

    # ------------------------------------------------------------------ helpers

    def _detokenizer(self, prompt: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens, params.stop,
                                      params.include_stop_str_in_output)

    def _delta(self, choice: _Choice, out: EngineOutput) -> ChoiceDelta:
        params = choice.params
        token_ids = out.new_token_ids
        finish_reason = out.finish_reason if out.finished else None
        stop_reason = None
        if finish_reason == FinishReason.STOP and out.stop_token_id in params.stop_token_ids:
            stop_reason = out.stop_token_id
        text = ""
        detokenizer = choice.detokenizer
        if detokenizer is not None:
            text_ids = token_ids
            if finish_reason == FinishReason.STOP and out.stop_token_id is not None \
                    and not params.include_stop_str_in_output:
                text_ids = token_ids[:-1]  # the stop token (EOS or a stop_token_ids entry) is not part of the text
            match = detokenizer.add_tokens(text_ids)
            if match is not None:
                finish_reason, stop_reason = FinishReason.STOP, match.stop_string
            text = detokenizer.next_delta(finished=finish_reason is not None)
        # The output's lists are this delta's from now on: the engine made them for this output alone.
        return ChoiceDelta(choice.index, choice.prompt_index, text, token_ids, out.new_logprobs, finish_reason,
                           stop_reason, out.prompt_logprobs, out.pooled)

    def _finish(self, choice: _Choice, reason: FinishReason, now: float, step: StepMetrics | None) -> None:
        choice.finished = True
        self._choices.pop(choice.child_id, None)  # a beam search's later choices have no engine request of their own
        state = choice.request
        state.num_unfinished -= 1
        if state.num_unfinished == 0:
            del self.requests[state.request_id]
        if step is not None:
            prompt = state.prompts[choice.prompt_index]
            step.finished.append(choice.clock.finished(reason, now, len(prompt), choice.num_output_tokens,
                                                       choice.params.max_tokens, choice.num_preemptions))
            n = state.params.n
            siblings = state.choices[choice.prompt_index * n:(choice.prompt_index + 1) * n]
            if all(c.finished for c in siblings):  # vLLM's per-prompt figures: n, and its longest choice
                step.params_n.append(n)
                step.max_generation_tokens.append(max(c.num_output_tokens for c in siblings))


def _record_tokens(step: StepMetrics | None, choice: _Choice, out: EngineOutput, now: float) -> None:
    """A choice's clock from its output (always: a response may report its timings), and the step's figures
    (when metrics are recorded)."""
    clock = choice.clock
    if clock.scheduled_s is None and out.queue_time_s is not None:
        clock.scheduled_s = clock.arrival_s + out.queue_time_s
        if step is not None:
            step.queue_times_s.append(out.queue_time_s)
    num_new = len(out.new_token_ids)
    if num_new == 0 and out.pooled is None:  # (a pooling request's output comes without tokens: its prompt counts)
        return
    if step is not None:
        step.num_generation_tokens += num_new
        if clock.first_token_s is None:
            step.ttfts_s.append(now - clock.arrival_s)
            step.num_prompt_tokens += out.num_prompt_tokens
            step.num_computed_prompt_tokens += out.num_prompt_tokens - out.num_cached_tokens
        else:
            step.inter_token_s.append((now - clock.last_token_s) / num_new)
    if clock.first_token_s is None:
        clock.first_token_s = now
    clock.last_token_s = now
