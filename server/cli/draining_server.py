"""uvicorn with a graceful shutdown.

The first SIGTERM (or Ctrl-C) stops admitting requests (503), lets those in flight finish for up to
``--shutdown-timeout`` seconds, aborts the rest (their streams end with ``finish_reason: "abort"``), and only then
lets uvicorn close its connections and exit with status 0. A second signal skips the wait: the streams still open
end with an error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from engine.frontend.async_engine import AsyncEngine

logger = logging.getLogger("minivllm.server")


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first exit signal drains the engine before uvicorn shuts down.

    uvicorn closes its listening sockets as soon as it starts shutting down; draining first
    keeps them open, so a client arriving during the drain gets a 503 rather than a refused
    connection. A second signal ends the drain at once: the app's shutdown stops the engine, so
    every open stream ends with an error event and ``[DONE]`` before uvicorn closes the
    connections (rather than uvicorn cancelling them mid-stream). A third one stops waiting for
    anything. Signals are not re-raised after shutdown, so the process exits with 0.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout_s: float,
                 ready_line: str = ""):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.ready_line = ready_line
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None
        self._num_signals = 0

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)  # exits the process if the app's start-up fails
        if self.started and self.ready_line:
            logger.info("%s", self.ready_line)

    def handle_exit(self, sig, frame) -> None:
        self._num_signals += 1
        if self._loop is None or self._num_signals > 2:
            self.force_exit = self.should_exit  # a signal while uvicorn already shuts down: stop waiting
            self.should_exit = True
            return
        start = self._start_drain if self._num_signals == 1 else self._start_stop
        self._loop.call_soon_threadsafe(start)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    def _start_stop(self) -> None:
        self._stop_task = asyncio.get_running_loop().create_task(self._stop_now())

    async def _drain(self) -> None:
        try:
            logger.info("shutting down: no new requests; %d in flight get up to %.1f s to finish (signal again to "
                        "stop them now)", self.engine.num_in_flight, self.shutdown_timeout_s)
            num_aborted = await self.engine.drain(self.shutdown_timeout_s)
            if num_aborted:
                logger.info("aborted %d requests that did not finish in time", num_aborted)
        finally:
            self.should_exit = True

    async def _stop_now(self) -> None:
        """The second signal: no more waiting for the requests in flight."""
        logger.info("stopping now: %d requests in flight end with an error", self.engine.num_in_flight)
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
            await asyncio.gather(self._drain_task, return_exceptions=True)
        try:
            # The app's shutdown stops the engine, which fails every open stream (an error event, then [DONE]);
            # uvicorn's own call to it later finds it done.
            await self.lifespan.shutdown()
        finally:
            self.should_exit = True
