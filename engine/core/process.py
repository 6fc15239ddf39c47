"""The engine core: the ``LLMEngine`` loop in a process of its own, never waiting for the API server.

    API server process                              engine core process
      AsyncEngine ── AddRequests / AbortRequests ──>  inputs (ZMQ PULL)
                                                       loop: apply inputs → step() → send
      AsyncEngine <────── StepOutputs, one per step ─  outputs (ZMQ PUSH, unbounded queue)
      start-up and fatal errors  <────────────────────  control pipe (multiprocessing)

The loop busy-polls its inputs between steps and blocks on them only when no request is
left, so the device goes from one step to the next whatever the server is doing: the
server detokenizes and writes SSE in its own process. While every request waits for its
grammar to compile, nothing can be scheduled: the loop then blocks on its inputs and the
compiles' wake-up pipe, until a compile ends or the next compile time bound passes. A
message goes out only when something changed (outputs, tokens computed, failures, stats).
Messages are msgspec structs (msgpack): a step's outputs for 256 requests encode in ~30 us.

Lifetime: the process exits when it is told to (``Shutdown``), when its parent dies
(multiprocessing's parent sentinel, so no orphan holds a GPU), or after a failed step,
which it reports on the control pipe first. It ignores SIGINT and SIGTERM: the API
server drains first, then shuts it down.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import zmq

from engine.config import EngineConfig
from engine.loading.multimodal import ImageInput
from engine.outputs import EngineOutput, EngineStats
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine (torch, the models) is imported by the core process itself, in run_engine_core
    from engine.core.llm_engine import LLMEngine

logger = logging.getLogger("minivllm")

_IDLE_POLL_MS = 1000  # how long an idle loop blocks on its inputs before looking again
_IDLE_CHECK_S = 1.0  # idle this long, the loop checks the KV invariants (once per idle period)
_STATS_INTERVAL_S = 0.05  # a busy engine sends its stats at most this often (and whenever counts change)


# --------------------------------------------------------------------------- messages


class CoreRequest(msgspec.Struct, array_like=True, gc=False):
    """One engine request, already checked by the API server."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() in the API server (the same clock in every process)
    # The prompt's images, by offset: placeholder spans, content hashes and pixel values as raw bytes.
    mm_inputs: list[ImageInput] | None = None


class AddRequests(msgspec.Struct, tag="add", array_like=True, gc=False):
    requests: list[CoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, gc=False):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = AddRequests | AbortRequests | Shutdown


class StepOutputs(msgspec.Struct, array_like=True, gc=False):
    """Everything one step produced, for every request in it: the one message per step."""

    outputs: list[EngineOutput]
    stats: EngineStats | None = None  # a fresh snapshot, when one is due
    num_requests_added: int = 0  # requests the core has received so far (for the waiting-queue estimate)
    failed: list[tuple[str, str]] = []  # (request id, why) for requests the engine refused
    sent_s: float = 0.0  # time.monotonic() when the core sent it, to measure the delivery delay
    num_scheduled_tokens: int = 0  # the step's tokens (prompt and decode): vLLM's iteration_tokens_total
    # (request id, why, the request field) for requests the client's input failed: a grammar that did
    # not compile, or not within its time bound (a 400 for the client, not a server error)
    rejected: list[tuple[str, str, str]] = []


def _enc_hook(obj):
    if isinstance(obj, np.ndarray):
        return obj.tobytes()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(type_, obj):
    if type_ is np.ndarray:
        return np.frombuffer(obj, dtype=np.int8)
    raise NotImplementedError(f"cannot decode {type_}")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreInput)


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(StepOutputs, dec_hook=_dec_hook)


# ------------------------------------------------------------------------- the loop


class EngineCore:
    def __init__(self, engine: LLMEngine, inputs: zmq.Socket, outputs: zmq.Socket, parent_sentinel: int | None):
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.parent_sentinel = parent_sentinel
        self._encoder = make_encoder()
        self._decoder = input_decoder()
        self._num_added = 0
        self._failed: list[tuple[str, str]] = []
        self._stats_dirty = True
        self._last_stats_s = 0.0
        self._last_counts: tuple[int, int] | None = None
        self._idle_since: float | None = None  # None while requests run, or once checked in this idle period
        self._wakeup_fd: int | None = None  # the grammar compiles' wake-up pipe, once the engine has one

    def run(self) -> None:
        """Serve until told to stop or orphaned."""
        poller = zmq.Poller()
        poller.register(self.inputs, zmq.POLLIN)
        if self.parent_sentinel is not None:
            poller.register(self.parent_sentinel, zmq.POLLIN)
        engine = self.engine
        while True:
            events = dict(poller.poll(self._poll_timeout_ms(poller)))
            if self.parent_sentinel is not None and self.parent_sentinel in events:
                logger.warning("the API server process is gone: the engine core stops")
                return
            if self.inputs in events and not self._apply_inputs():
                logger.info("engine core: shutting down")
                return
            if self._wakeup_fd is not None and self._wakeup_fd in events:
                engine.grammars.clear_wakeup()
            if engine.has_unfinished_requests():
                self._idle_since = time.monotonic()
                if engine.waiting_for_grammars():
                    self._send(engine.settle_grammars(), only_if_changed=True)
                else:
                    outputs = engine.step()
                    self._send(outputs, engine.last_num_scheduled_tokens, only_if_changed=True)
            elif self._stats_dirty or self._failed or engine.grammar_failures:
                self._send([])
            elif not events:
                self._check_when_idle()

    def _poll_timeout_ms(self, poller: zmq.Poller) -> int:
        """0 while steps can run; while every request waits for a grammar, until the first compile's time
        bound (a compile that ends wakes the loop through its pipe); when idle, ``_IDLE_POLL_MS``."""
        engine = self.engine
        if not engine.has_unfinished_requests():
            return _IDLE_POLL_MS
        if not engine.waiting_for_grammars():
            return 0
        if self._wakeup_fd is None:
            self._wakeup_fd = engine.grammars.wakeup_fd
            poller.register(self._wakeup_fd, zmq.POLLIN)
        wait_s = engine.grammars.seconds_to_deadline()
        return _IDLE_POLL_MS if wait_s is None else min(_IDLE_POLL_MS, 1 + int(wait_s * 1000))

    def _check_when_idle(self) -> None:
        """Check the KV invariants once the engine has been idle for a while: a request that arrives
        during the check (~60 ms for 60k blocks) waits for it, so not right after a burst ends."""
        if self._idle_since is None or time.monotonic() - self._idle_since < _IDLE_CHECK_S:
            return
        self._idle_since = None
        if self.engine.config.check_invariants_when_idle:
            self.engine.check_invariants()

    def _apply_inputs(self) -> bool:
        """Apply every message waiting, in order; False once told to shut down."""
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            message = self._decoder.decode(frame.buffer)
            self._stats_dirty = True
            if isinstance(message, AddRequests):
                for req in message.requests:
                    self._num_added += 1
                    try:
                        self.engine.add_request(req.request_id, req.prompt_token_ids, req.params, req.arrival_time,
                                                checked=True, mm_inputs=req.mm_inputs)
                    except Exception as exc:  # noqa: BLE001 - refuse this request, keep serving the rest
                        logger.exception("engine core: request %s refused", req.request_id)
                        self._failed.append((req.request_id, str(exc)))
            elif isinstance(message, AbortRequests):
                self.engine.abort_requests(message.request_ids)  # the server has finished them already
            else:
                return False

    def _send(self, outputs: list[EngineOutput], num_tokens: int = 0, only_if_changed: bool = False) -> None:
        """One message for the step (which computed ``num_tokens``); a stats snapshot rides along when
        counts changed, when idle, and at least every ``_STATS_INTERVAL_S`` (a snapshot costs ~30 us for
        256 requests). ``only_if_changed``: no message for a step that produced nothing (no outputs, no
        tokens computed, no failures) unless a snapshot is due."""
        engine = self.engine
        now = time.monotonic()
        scheduler = engine.scheduler
        counts = (scheduler.num_running, scheduler.num_waiting)
        stats = None
        due = now - self._last_stats_s >= _STATS_INTERVAL_S
        if self._stats_dirty or due or counts != self._last_counts or not engine.has_unfinished_requests():
            stats, self._last_counts, self._last_stats_s, self._stats_dirty = engine.stats(), counts, now, False
        if (only_if_changed and not outputs and stats is None and not num_tokens and not self._failed
                and not engine.grammar_failures):
            return
        failed, self._failed = self._failed, []
        rejected, engine.grammar_failures = engine.grammar_failures, []
        message = StepOutputs(outputs, stats, self._num_added, failed, sent_s=time.monotonic(),
                              num_scheduled_tokens=num_tokens, rejected=rejected)
        self.outputs.send(self._encoder.encode(message), copy=False)


# ---------------------------------------------------------------------- the process


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, control: Connection,
                    log_level: str) -> None:
    """The engine core process: load the model, report ready (or why not), then loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server decides when this process stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    try:
        from engine.core.llm_engine import LLMEngine

        engine = LLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 - any start-up failure goes back to the CLI as a message
        logger.debug("the engine could not start", exc_info=True)
        control.send(("failed", _describe(exc)))
        return
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)
    inputs.bind(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)  # never block the loop on a slow reader: queue instead
    outputs.connect(output_address)
    parent = multiprocessing.parent_process()
    gc.collect()
    gc.freeze()  # what start-up made lives for good: keep it out of every later collection
    control.send(("ready", engine.model_info, engine.stats()))
    def rank_died(message: str) -> None:
        # A collective with a dead rank may never return: say so and end this process (the other ranks
        # follow it), rather than hang.
        control.send(("dead", message, ""))
        os._exit(1)

    engine.on_rank_death = rank_died
    try:
        EngineCore(engine, inputs, outputs, parent.sentinel if parent is not None else None).run()
    except BaseException as exc:  # noqa: BLE001 - a failed step kills the engine; say why first
        logger.exception("engine step failed; the engine core is stopping")
        control.send(("dead", _describe(exc), traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        engine.close()
        outputs.close(linger=0)
        inputs.close(linger=0)
        context.term()


def _describe(exc: BaseException) -> str:
    return str(exc) if str(exc) else repr(exc)
