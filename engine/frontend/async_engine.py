"""The API server's side of the engine: an async client of the engine core process.

    handler ──generate()──> OutputProcessor.add_request ──AddRequests──> engine core process
    handler <── RequestStream <── OutputProcessor.process <── StepOutputs (one per step)

``generate`` returns a ``RequestStream`` at once; one task receives the core's step
messages and runs the output processor (detokenization, stop strings, logprobs) for every
request of the step. A stream merges the deltas its reader has not taken yet, so a reader
that falls behind gets several tokens in its next chunk instead of holding up the rest:
nothing on this side can make the engine wait.

If the engine process dies, every stream fails with ``EngineDeadError`` at once (the
process's sentinel is watched by the event loop), ``healthy`` turns false and new
requests are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.core.process import (
    AbortRequests,
    AddRequests,
    CoreRequest,
    Shutdown,
    make_encoder,
    output_decoder,
    run_engine_core,
)
from engine.errors import RequestError
from engine.frontend.output_processor import ChoiceDelta, OutputProcessor, RequestState
from engine.frontend.request_metrics import MetricsRecorder
from engine.loading.default_model import resolve_model_path
from engine.loading.model_info import ModelInfo
from engine.loading.multimodal import ImageInput
from engine.loading.tokenizer import load_tokenizer
from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams

logger = logging.getLogger("minivllm")

_SHUTDOWN_WAIT_S = 10.0  # after Shutdown, how long the core gets to exit before it is killed
_REAP_WAIT_S = 1.0  # once the core's sentinel fires, how long to wait for its exit status


class EngineDeadError(RuntimeError):
    """The engine stopped after an error (or is shutting down) and takes no more requests."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full."""


class EngineStartupError(RuntimeError):
    """The engine core process could not load the model; the message says why."""


class RequestStream:
    """The deltas of one request, merged per choice until its reader takes them.

    Iterating yields lists of ``ChoiceDelta`` (at most one per choice, in index order) and
    ends once every choice has finished. Closing it early aborts what is left.
    """

    def __init__(self, request_id: str, num_choices: int, abort: Callable[[str], None],
                 on_last_delta: Callable[[str], None]):
        self.request_id = request_id
        self._abort = abort  # called with the request id when the reader leaves before the end
        self._on_last_delta = on_last_delta  # called once every choice's last delta has arrived
        self.state: RequestState | None = None  # set once the output processor has it
        self._pending: dict[int, ChoiceDelta] = {}
        self._ready = asyncio.Event()
        self._error: BaseException | None = None
        self._num_unfinished = num_choices  # choices whose last delta the reader has not taken
        self._num_running = num_choices  # choices whose last delta has not arrived

    def put(self, delta: ChoiceDelta) -> None:
        pending = self._pending.get(delta.index)
        if pending is None:
            self._pending[delta.index] = delta
        else:
            pending.merge(delta)
        if delta.finish_reason is not None:
            self._num_running -= 1
            if self._num_running == 0:
                self._on_last_delta(self.request_id)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised by the next read; deltas not read yet are dropped)."""
        self._error = error
        self._pending.clear()
        self._ready.set()

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0 and not self._pending

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[ChoiceDelta]:
        while not self._pending:
            if self._error is not None:
                raise self._error
            if self._num_unfinished <= 0:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        pending, self._pending = self._pending, {}
        batch = [pending[i] for i in sorted(pending)] if len(pending) > 1 else list(pending.values())
        self._num_unfinished -= sum(d.finish_reason is not None for d in batch)
        return batch

    def close(self) -> None:
        """Abort whatever has not finished (a client that went away); idempotent."""
        if self._num_unfinished and self._error is None:
            self._abort(self.request_id)
        self._num_unfinished = 0
        self._pending.clear()


class AsyncEngine:
    """Spawns the engine core process, sends it requests and turns its outputs into streams."""

    def __init__(self, config: EngineConfig, model: ModelInfo, stats: EngineStats, tokenizer,
                 process: multiprocessing.Process, control, sockets: _Sockets, max_waiting_requests: int | None = None):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.processor = OutputProcessor(tokenizer)
        self.dead_error: BaseException | None = None
        self.draining = False
        self.last_stats = stats
        self._process = process
        self._control = control
        self._sockets = sockets
        self._encoder = make_encoder()
        self._decoder = output_decoder()
        self._streams: dict[str, RequestStream] = {}
        self._num_sent = 0  # engine requests sent to the core
        self._num_added_seen = 0  # ... of which the core had received when it sent its last message
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._metrics: MetricsRecorder | None = None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def launch(cls, config: EngineConfig, max_waiting_requests: int | None = None, log_level: str = "info",
               startup_timeout_s: float | None = None,
               while_loading: Callable[[], None] | None = None) -> AsyncEngine:
        """Start the engine core process and wait until its model is loaded.

        ``while_loading`` runs here once the core process has started, beside its imports and model loading
        (the server imports its HTTP side then). Raises ``EngineStartupError`` with the core's own message
        when it cannot start.
        """
        # Fetch/convert the default model here, with its progress bars, before the core needs it.
        config = dataclasses.replace(config, model=resolve_model_path(config))
        sockets = _Sockets.open()
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        control, child_control = context.Pipe()
        process = context.Process(
            target=run_engine_core, name="minivllm-engine-core", daemon=True,
            args=(config, sockets.input_address, sockets.output_address, child_control, log_level),
        )
        try:
            process.start()
            child_control.close()
            logger.info("engine core process %d starting", process.pid)
            if while_loading is not None:
                while_loading()
            tokenizer = load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
            model, stats = _wait_until_ready(process, control, startup_timeout_s)
        except BaseException:
            if process.pid is not None:
                _stop_process(process)
            sockets.close()
            raise
        return cls(config, model, stats, tokenizer, process, control, sockets, max_waiting_requests)

    def start(self) -> None:
        """Start receiving outputs (in the server's event loop)."""
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._receive_outputs(), name="minivllm-engine-outputs")
        loop.add_reader(self._process.sentinel, self._on_process_exit)

    async def stop(self) -> None:
        """Stop the engine core process; requests still in flight end with EngineDeadError."""
        self._stopping = True
        if self.dead_error is None:
            self._fail_all(EngineDeadError("the server shut down before this request finished"))
        if self._task is not None:
            asyncio.get_running_loop().remove_reader(self._process.sentinel)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._send(Shutdown())
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Make sure the core process is gone and release the sockets (blocking; safe to repeat)."""
        self._stopping = True
        _stop_process(self._process, _SHUTDOWN_WAIT_S if self._process.is_alive() else 0.0)
        self._sockets.close()

    @property
    def healthy(self) -> bool:
        return (self.dead_error is None and self._task is not None and not self._task.done()
                and self._process.is_alive())

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def engine_pid(self) -> int | None:
        return self._process.pid

    def attach_metrics(self, metrics: MetricsRecorder) -> None:
        self.processor.metrics = metrics
        self._metrics = metrics

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, wait up to ``timeout_s`` for those in flight, then abort the rest.

        Returns how many requests were aborted (their streams end with finish_reason "abort").
        """
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self.healthy:
            await asyncio.sleep(0.05)
        remaining = list(self._streams)
        for request_id in remaining:
            self.abort(request_id)
        return len(remaining)

    # ----------------------------------------------------------------- requests

    def check_accepting(self, num_new_requests: int = 1) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead_error}")
        if self.draining:
            raise EngineDeadError("the server is shutting down")
        if self.max_waiting_requests is not None:
            waiting = self.num_waiting_estimate()
            if waiting + num_new_requests > self.max_waiting_requests:
                if self._metrics is not None:
                    self._metrics.record_admission_rejection("max_num_queued_reqs")
                raise EngineOverloadedError(
                    f"the waiting queue is full ({waiting} requests waiting, the limit is {self.max_waiting_requests})"
                )

    def num_waiting_estimate(self) -> int:
        """Requests waiting in the core, counting those on their way there that will find no free seat."""
        stats = self.last_stats
        in_transit = self._num_sent - self._num_added_seen
        free_seats = max(0, self.config.max_num_seqs - stats.num_running - stats.num_waiting)
        return stats.num_waiting + max(0, in_transit - free_seats)

    def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 mm_inputs: list[list[ImageInput] | None] | None = None) -> RequestStream:
        """Start a request: ``params.n`` choices for each prompt, already checked against the model.

        ``mm_inputs``: per prompt, its images (``engine.loading.multimodal.ImageInput``s from ``MultiModalProcessor``,
        checked with ``ModelInfo.check_request(..., mm_inputs)``) or None. The deltas arrive on the returned
        stream; closing it early aborts the request.
        """
        if mm_inputs is not None and len(mm_inputs) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but images for {len(mm_inputs)}")
        self.check_accepting(len(prompts) * params.n)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        _encodable(self._encoder, params)  # a value the wire cannot carry is the client's: refused before anything
        stream = RequestStream(request_id, len(prompts) * params.n, self.abort, self._forget)
        stream.state, children = self.processor.add_request(request_id, prompts, params, stream)
        arrival = stream.state.arrival_s
        # Encoded and sent before the stream is registered: a request that cannot be sent leaves nothing behind.
        try:
            frame = _encodable(self._encoder, AddRequests([
                CoreRequest(c.request_id, c.prompt_token_ids, c.params, arrival,
                            (mm_inputs[c.prompt_index] or None) if mm_inputs is not None else None)
                for c in children]))
            self._send_frame(frame)
        except BaseException:
            self.processor.abort(request_id)
            raise
        self._streams[request_id] = stream
        self._num_sent += len(children)
        return stream

    def abort(self, request_id: str) -> None:
        """End a request now: its unfinished choices finish with "abort" and the core frees their blocks."""
        child_ids = self.processor.abort(request_id)
        self._streams.pop(request_id, None)
        if child_ids and self.dead_error is None:
            self._send(AbortRequests(child_ids))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def stats(self) -> EngineStats:
        """The core's latest snapshot (at most ~50 ms old while it runs; fresh whenever it goes idle)."""
        return self.last_stats

    # --------------------------------------------------------------- internals

    def _send(self, message) -> None:
        self._send_frame(self._encoder.encode(message))

    def _send_frame(self, frame) -> None:
        # A connecting PUSH socket with no high-water mark queues: this never blocks.
        self._sockets.inputs.send(frame, flags=zmq.NOBLOCK, copy=False)

    async def _receive_outputs(self) -> None:
        try:
            await self._receive_steps()
        except Exception as exc:  # noqa: BLE001 - a bug here would leave every stream waiting: fail them, say why
            logger.exception("the API server could not handle the engine's outputs")
            self.dead_error = EngineDeadError(f"the API server could not handle the engine's outputs: {exc!r}")
            self._fail_all(EngineDeadError(f"the engine stopped after an error: {self.dead_error}"))

    async def _receive_steps(self) -> None:
        while True:
            frame = await self._sockets.outputs.recv(copy=False)
            received = time.monotonic()
            step = self._decoder.decode(frame.buffer)
            if step.stats is not None:
                self.last_stats = step.stats
            self._num_added_seen = step.num_requests_added
            for child_id, reason in step.failed:
                self._fail_request(child_id, reason)
            for child_id, reason, param in step.rejected:  # the client's input: a 400 (or the stream's error)
                self._fail_request(child_id, reason, RequestError(reason, param=param))
            if step.outputs:
                to_abort = self.processor.process(step.outputs)
                if to_abort:  # stopped by a stop string
                    self._send(AbortRequests(to_abort))
                if self._metrics is not None:
                    self._metrics.record_delivery(received - step.sent_s, time.monotonic() - received)

    def _fail_request(self, child_id: str, reason: str, error: BaseException | None = None) -> None:
        request_id = self.processor.request_of(child_id)
        stream = self._streams.pop(request_id, None) if request_id is not None else None
        if stream is not None:
            self.abort(request_id)
            stream.fail(error or RuntimeError(f"the engine refused the request: {reason}"))

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if self._stopping:
            return
        # The sentinel fires as the process exits, a moment before it can be reaped: wait for its exit status.
        self._process.join(_REAP_WAIT_S)
        reason = f"the engine process exited unexpectedly ({_describe_exit(self._process.exitcode)})"
        if self._control.poll():
            try:
                message = self._control.recv()
            except (EOFError, OSError):
                message = None
            if message and message[0] == "dead":
                reason = message[1]
                logger.error("the engine core failed:\n%s", message[2])
        logger.error("engine dead: %s", reason)
        self.dead_error = EngineDeadError(reason)
        self._fail_all(EngineDeadError(f"the engine stopped after an error: {reason}"))
        if self._task is not None:
            self._task.cancel()

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        self.processor.clear()


# ------------------------------------------------------------------------ helpers


class _Sockets:
    """The two ZMQ sockets to the core. The core binds its inputs and this side binds the
    outputs, so each sending side connects: a connecting socket queues what it sends
    until the peer is there, and nothing is lost while the core starts."""

    def __init__(self, ipc_dir: Path):
        self.ipc_dir = ipc_dir
        self.input_address = f"ipc://{ipc_dir / 'inputs'}"
        self.output_address = f"ipc://{ipc_dir / 'outputs'}"
        self.context = zmq.asyncio.Context()
        self.inputs = self.context.socket(zmq.PUSH)
        self.inputs.setsockopt(zmq.SNDHWM, 0)
        self.inputs.connect(self.input_address)
        self.outputs = self.context.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.RCVHWM, 0)
        self.outputs.bind(self.output_address)

    @classmethod
    def open(cls) -> _Sockets:
        return cls(Path(tempfile.mkdtemp(prefix="minivllm-")))

    def close(self) -> None:
        if self.context.closed:
            return
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)
        self.context.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _encodable(encoder, message) -> bytes:
    """``message`` encoded for the core; a value msgspec cannot encode (an integer past 64 bits, a lone surrogate in a
    string) is a ``RequestError``."""
    try:
        return encoder.encode(message)
    except (OverflowError, TypeError, ValueError) as exc:
        raise RequestError(f"the request cannot be sent to the engine: {exc}") from None


def _wait_until_ready(process, control, timeout_s: float | None) -> tuple[ModelInfo, EngineStats]:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not control.poll(0.1):
        if not process.is_alive():
            raise EngineStartupError(f"the engine process exited during start-up (exit code {process.exitcode})")
        if deadline is not None and time.monotonic() > deadline:
            raise EngineStartupError(f"the engine did not start within {timeout_s} s")
    message = control.recv()
    if message[0] != "ready":
        raise EngineStartupError(message[1])
    return message[1], message[2]


def _describe_exit(exitcode: int | None) -> str:
    """'exit code 1', 'killed by SIGKILL' (multiprocessing's negative exit codes are signals)."""
    if exitcode is None:
        return "its exit status is unknown"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _stop_process(process, wait_s: float = 0.0) -> None:
    if wait_s:
        process.join(wait_s)
    if process.is_alive():
        process.terminate()  # ignored by the core; SIGKILL follows
        process.join(1.0)
    if process.is_alive():
        process.kill()
        process.join(5.0)
