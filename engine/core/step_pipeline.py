"""The steps in flight: when a step is launched, finished, and when the next one is launched ahead of it.

The engine's ``step()`` takes a launched step, finishes it (the one host sync), does the scheduler's
bookkeeping and hands the step back here. What may run ahead of the host is decided here alone::

    overlap_steps      after the bookkeeping, the next step is launched before step() returns: the device
                       computes while the caller handles the outputs
    async_scheduling   before the sync, the next step is planned and launched: the tokens this step samples are
                       fed to it on the device. Not while a running request needs its exact output so far to
                       sample (``Scheduler.can_schedule_ahead``). With speculative decoding, not after a step
                       that verifies proposals (how many it accepts moves the next positions), nor while the
                       next step would give proposals (``wants_proposals``: they follow the tokens in flight); so
                       a batch that speculates is planned step by step, and one above ``disable_by_batch_size``,
                       or whose requests have all paused their proposals, is planned ahead
    grammar masks      a step with constrained requests queues its forward pass at once and its sampling once
                       their masks are filled: at once for a step launched on its own; for a step planned ahead,
                       whose masks need this step's tokens, on a thread during the bookkeeping, its sampling
                       queued when the engine next steps (before anything else reaches the device)

While every request waits for its grammar to compile and nothing is in flight, no step can run
(``waiting_for_grammars``): the engine waits for a compile instead, and requests whose compile failed or
took too long are ended (``settle_grammars``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.scheduler import Scheduler
from engine.outputs import EngineOutput, ModelRunnerOutput, RunnerTiming, SchedulerOutput
from engine.worker.model_runner import ModelRunner, StepHandle

if TYPE_CHECKING:
    from engine.core.structured_output import GrammarManager, RequestGrammar
    from engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger("minivllm")


@dataclass(frozen=True)
class StepTiming:
    """Where one step's time went: Python work on the host, and the device's own time."""

    num_reqs: int
    num_tokens: int
    graph: bool  # replayed a captured graph
    host_s: float  # scheduling, input building and kernel launches: the device waits for these
    device_s: float  # forward pass and sampling on the device (CUDA events)
    wall_s: float


@dataclass(slots=True)
class InflightStep:
    """A launched step: the scheduler's plan and the runner's handle of it."""

    sched: SchedulerOutput
    handle: StepHandle
    planned_s: float  # time.perf_counter() when its planning started
    # Its grammar masks, filling on a thread (None: no row has a grammar to fill); set while its sampling waits.
    masks: Future | None = None
    synced_s: float = 0.0  # time.perf_counter() after its sync


class StepPipeline:
    """Owns the step launched ahead (at most one) and the grammars' part in launching steps."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, overlap_steps: bool, async_scheduling: bool,
                 new_grammars: Callable[[], GrammarManager], wants_proposals: Callable[[], bool] | None = None):
        self._scheduler = scheduler
        self._runner = runner
        self.overlap_steps = overlap_steps
        self.async_scheduling = async_scheduling
        self._new_grammars = new_grammars  # called with the first constrained request
        self._wants_proposals = wants_proposals  # speculative decoding: whether the next step would take proposals
        self.grammars: GrammarManager | None = None
        self._constrained: set[str] = set()  # unfinished requests with a grammar
        self._ahead: InflightStep | None = None  # launched already, the next step to finish
        self.num_steps_planned_ahead = 0  # steps launched before the previous step's tokens were known
        self.last_num_scheduled_tokens = 0  # of the step finished last
        self.step_timings: list[StepTiming] = []  # when the runner measures steps
        self._last_sync_s: float | None = None

    # ----------------------------------------------------------------- steps

    def take(self) -> InflightStep | None:
        """The step to finish now: the one launched ahead, or one launched here; None when none can run. With
        async scheduling the step after it is planned and launched before this returns."""
        step, self._ahead = self._ahead, None
        if step is None:
            if not self._scheduler.has_unfinished_requests():
                return None
            step = self._launch()
        elif step.handle.awaits_sampling:  # its masks were left filling (``finish``): its sampling goes first
            self._runner.launch_sampling(step.handle, step.masks.result() if step.masks is not None else None)
        if self.async_scheduling and self._scheduler.can_schedule_ahead() and self._may_plan_past(step):
            # The device goes from this step straight to the next while the host waits and does the bookkeeping.
            self._ahead = self._launch_step(in_flight=step.handle)
            self.num_steps_planned_ahead += 1
        return step

    def _may_plan_past(self, step: InflightStep) -> bool:
        """Speculative decoding: a step may be planned before ``step``'s tokens are known only where neither
        ``step`` verifies proposals nor the next step would take any."""
        if self._wants_proposals is None:
            return True
        return not step.sched.spec_token_ids and not self._wants_proposals()

    def finish(self, step: InflightStep) -> ModelRunnerOutput:
        """Wait for the step and return its tokens. The grammars take them first: the masks of the step launched
        ahead need them, and fill on a thread during the bookkeeping and the caller's handling of the outputs."""
        out = self._runner.finish(step.handle)
        step.synced_s = time.perf_counter()
        if out.timing is not None:
            self._record_timing(step, out.timing)
        if self._constrained:
            accepted = ([out.accepted_token_ids.get(rid, []) for rid in out.request_ids] if out.accepted_token_ids
                        else None)
            self.grammars.advance(self._scheduler.grammars_of(out.request_ids), out.sampled_token_ids, accepted)
            ahead = self._ahead
            if ahead is not None and ahead.handle.awaits_sampling:
                ahead.masks = self.grammars.fill_bitmask_async(
                    self._scheduler.grammars_of(ahead.handle.sampled_request_ids))
        return out

    def done(self, step: InflightStep, outputs: list[EngineOutput]) -> None:
        """The step's bookkeeping is over (``outputs``); with overlapped steps the next one is launched now."""
        self.last_num_scheduled_tokens = step.sched.total_num_scheduled_tokens
        if self._constrained:
            self._constrained.difference_update(out.request_id for out in outputs if out.finished)
        if self._ahead is None and self.overlap_steps and self._scheduler.has_unfinished_requests():
            self._ahead = self._launch()

    def _launch(self) -> InflightStep:
        """Plan and launch a step with no step in flight, its sampling included: a constrained one waits here
        for its masks."""
        step = self._launch_step()
        if step.handle.awaits_sampling:
            ids = step.handle.sampled_request_ids
            proposals = ([step.sched.spec_token_ids.get(rid, []) for rid in ids]
                         if step.handle.inputs.spec_counts is not None else None)  # verified: masks per position
            masks = self.grammars.fill_bitmask(self._scheduler.grammars_of(ids), proposals)
            self._runner.launch_sampling(step.handle, masks)
        return step

    def _launch_step(self, in_flight: StepHandle | None = None) -> InflightStep:
        """Plan a step and launch it; a step with constrained requests leaves its sampling to the caller."""
        start = time.perf_counter()
        sched = self._scheduler.schedule()
        constrained = bool(self._constrained) and not self._constrained.isdisjoint(sched.num_scheduled_tokens)
        return InflightStep(sched, self._runner.launch(sched, in_flight, sample=not constrained), start)

    def _record_timing(self, step: InflightStep, timing: RunnerTiming) -> None:
        wall = step.synced_s - (self._last_sync_s if self._last_sync_s is not None else step.planned_s)
        self._last_sync_s = step.synced_s
        self.step_timings.append(StepTiming(
            num_reqs=timing.num_reqs, num_tokens=step.sched.total_num_scheduled_tokens, graph=timing.graph,
            host_s=timing.launched_s - step.planned_s, device_s=timing.device_s, wall_s=wall))

    def measure_steps(self, enabled: bool) -> None:
        """Record a StepTiming for every step from now on (or stop), the earlier ones forgotten."""
        self._runner.measure_steps = enabled
        self.step_timings.clear()
        self._last_sync_s = None

    # -------------------------------------------------------------- grammars

    def attach_grammar(self, request_id: str, spec: StructuredOutputsParams) -> RequestGrammar:
        """A new request's grammar, compiling; the steps that sample the request wait for its masks."""
        if self.grammars is None:
            self.grammars = self._new_grammars()
        grammar = self.grammars.attach(request_id, spec)
        self._constrained.add(request_id)
        return grammar

    def forget(self, request_ids: list[str]) -> None:
        """Requests that were aborted: no mask is filled for them, nor do they wait for their compiles."""
        if self._constrained:
            self._constrained.difference_update(request_ids)
        if self.grammars is not None:
            self.grammars.forget(request_ids)

    def settle_grammars(self) -> list[tuple[str, str, str]]:
        """(request id, why, the request field) of each request whose grammar failed to compile or passed its
        time bound: the engine ends them."""
        failures = self.grammars.settle() if self.grammars is not None else []
        for request_id, why, _ in failures:
            logger.warning("request %s: %s", request_id, why)
        return failures

    def waiting_for_grammars(self) -> bool:
        """True when nothing can be scheduled until a grammar compiles: no step runs or waits to, and every
        waiting request waits for its grammar (the engine core then sleeps instead of stepping)."""
        if self.grammars is None or not self.grammars.num_pending or self._ahead is not None:
            return False
        return not self._scheduler.has_ready_requests()

    def wait_for_grammars(self) -> None:
        """Block until a compile ends or the first compile's time bound passes."""
        self.grammars.wait(self.grammars.seconds_to_deadline())

    def shutdown(self) -> None:
        if self.grammars is not None:
            self.grammars.shutdown()
