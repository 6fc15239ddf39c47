"""The engine behind the server: one asyncio task owns the ``LLMEngine``.

    HTTP handler ──generate()──> _pending ──┐
                                            ├─ engine task: apply adds/aborts, step() in a worker thread,
    HTTP handler <── per-request queue <────┘   route each EngineOutput to its request's queue

All engine state is touched by the engine task and its one worker thread only, so the
engine needs no locks. Handlers talk to it through ``generate`` (an async iterator of
outputs) and ``abort``. A failed step kills the engine: every request in flight gets the
error, ``/health`` reports it, and new requests are refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine
from engine.outputs import EngineOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")


class EngineDeadError(RuntimeError):
    """The engine stopped after an error (or is shutting down) and takes no more requests."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full."""


@dataclass
class _NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[_NewRequest] = []
        self._aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-step")
        self.dead_error: BaseException | None = None
        self.draining = False
        self.last_stats: EngineStats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig, max_waiting_requests: int | None = None) -> "AsyncEngine":
        return cls(LLMEngine(config), max_waiting_requests)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="minivllm-engine")

    async def stop(self) -> None:
        """Stop the engine task; requests still in flight end with EngineDeadError."""
        if self.dead_error is None:
            self._fail_all(EngineDeadError("the engine was stopped"))
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._executor.shutdown(wait=True)

    @property
    def healthy(self) -> bool:
        return self.dead_error is None and self._task is not None and not self._task.done()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, wait up to ``timeout_s`` for those in flight, then abort the rest.

        Returns how many requests were aborted.
        """
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._queues and time.monotonic() < deadline and self.healthy:
            await asyncio.sleep(0.05)
        remaining = list(self._queues)
        for rid in remaining:
            self.abort(rid)
        while self._queues and self.healthy:  # the engine task delivers the "abort" outputs
            await asyncio.sleep(0.01)
        return len(remaining)

    # ----------------------------------------------------------------- requests

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[EngineOutput]:
        """Stream the outputs of one request. Validation errors raise before the first output.

        Closing the iterator early (a client that went away) aborts the request and frees its blocks.
        """
        self.check_accepting()
        params = self.engine.validate_request(prompt_token_ids, params)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._pending.append(_NewRequest(request_id, list(prompt_token_ids), params, time.monotonic()))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def check_accepting(self, num_new_requests: int = 1) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead_error!r}")
        if self.draining:
            raise EngineDeadError("the server is shutting down")
        if self.max_waiting_requests is not None:
            waiting = self.last_stats.num_waiting + len(self._pending)
            if waiting + num_new_requests > self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"the waiting queue is full ({waiting} requests waiting, the limit is {self.max_waiting_requests})"
                )

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step; its blocks are freed there. Unknown ids are ignored."""
        if request_id in self._queues:
            self._aborts.add(request_id)
            self._wake.set()

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (never read mid-step)."""
        return self.last_stats

    # --------------------------------------------------------------- engine task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._pending and not self._aborts and not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                self._apply_aborts()
                self._apply_new_requests()
                if self.engine.has_unfinished_requests():
                    outputs, stats = await loop.run_in_executor(self._executor, self._step)
                    self.last_stats = stats
                    self._dispatch(outputs)
                else:
                    self.last_stats = self.engine.stats()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("engine step failed; the engine is stopping")
            self.dead_error = exc
            self._fail_all(EngineDeadError(f"the engine stopped after an error: {exc!r}"))

    def _step(self) -> tuple[list[EngineOutput], EngineStats]:
        outputs = self.engine.step()
        return outputs, self.engine.stats()

    def _apply_new_requests(self) -> None:
        pending, self._pending = self._pending, []
        for new in pending:
            if new.request_id not in self._queues:  # aborted before it reached the engine
                continue
            request = self.engine.add_request(new.request_id, new.prompt_token_ids, new.params)
            request.arrival_time = new.arrival_time

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, set()
        self._dispatch(self.engine.abort_requests(list(aborts)))
        for rid in aborts:  # aborted before it reached the engine: finish it here
            if rid in self._queues and not self.engine.scheduler.requests.get(rid):
                if any(p.request_id == rid for p in self._pending):
                    self._pending = [p for p in self._pending if p.request_id != rid]
                    self._dispatch([EngineOutput(rid, [], finished=True, finish_reason="abort")])

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue
            queue.put_nowait(out)
            if out.finished:
                del self._queues[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._queues.clear()
        self._pending.clear()
