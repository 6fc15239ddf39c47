"""Grammar compiles on threads of their own: several at once, the same spec compiled once, none waited on forever.

    acquire(key, fn) ──> the unfinished job for this key, or a new one queued; its waiters count up
    a free slot      ──> the oldest queued job starts on a new thread (xgrammar lets go of the GIL)
    release(job)     ──> one waiter fewer; a job nobody waits for any more is dropped if still queued,
                         or given up if running: its thread runs on to the end (a compile cannot be
                         interrupted) but no longer holds a slot, so it holds up no other compile
    a job ends       ──> ``on_done`` (the engine core wakes up if it waits for grammars)

A compile that passes its time bound (the caller's deadline) is released by every request waiting on
it, and so given up. Given-up threads are bounded too: past ``max_running`` of them, a given-up job
keeps its slot until it ends, so a flood of slow grammars cannot take every core.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

QUEUED, RUNNING, GIVEN_UP, DONE = "queued", "running", "given up", "done"


class CompileJob:
    """One compile: queued, running (since ``started_s``, ``time.monotonic()``), given up, or done."""

    def __init__(self, key: Hashable, fn: Callable[[], Any]):
        self.key = key
        self.fn = fn
        self.state = QUEUED
        self.started_s: float | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.num_waiters = 0

    @property
    def done(self) -> bool:
        return self.state == DONE


class CompileQueue:
    def __init__(self, max_running: int, on_done: Callable[[], None], thread_name: str = "minivllm-grammar"):
        self.max_running = max_running
        self._on_done = on_done
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._queue: collections.deque[CompileJob] = collections.deque()
        self._jobs: dict[Hashable, CompileJob] = {}  # unfinished jobs by key, given-up ones included
        self._num_running = 0  # jobs holding a slot
        self._num_given_up = 0  # running jobs that no longer hold one
        self._closed = False

    def acquire(self, key: Hashable, fn: Callable[[], Any]) -> CompileJob:
        """The job compiling ``key`` (``fn`` computes it), joined by one more waiter; ``release`` it once done
        with it. A job given up but still running is joined again rather than started a second time."""
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = CompileJob(key, fn)
                self._queue.append(job)
                self._start_queued()
            job.num_waiters += 1
            return job

    def release(self, job: CompileJob) -> None:
        """One waiter fewer: a job nobody waits for is dropped (queued) or given up (running)."""
        with self._lock:
            job.num_waiters -= 1
            if job.num_waiters > 0 or job.state in (DONE, GIVEN_UP):
                return
            if job.state == QUEUED:
                self._queue.remove(job)
                del self._jobs[job.key]
            elif self._num_given_up < self.max_running:
                job.state = GIVEN_UP
                self._num_running -= 1
                self._num_given_up += 1
                self._start_queued()
            # else: it keeps its slot until it ends (too many given-up threads run already)

    def close(self) -> None:
        """Start nothing more; running compiles end on their own (their threads are daemons)."""
        with self._lock:
            self._closed = True
            self._queue.clear()

    def _start_queued(self) -> None:  # with the lock held
        while self._queue and self._num_running < self.max_running and not self._closed:
            job = self._queue.popleft()
            job.state, job.started_s = RUNNING, time.monotonic()
            self._num_running += 1
            threading.Thread(target=self._run, args=(job,), name=self._thread_name, daemon=True).start()

    def _run(self, job: CompileJob) -> None:
        try:
            job.result = job.fn()
        except BaseException as exc:  # noqa: BLE001 - reported on the requests that wait for it
            job.error = exc
        with self._lock:
            if job.state == GIVEN_UP:
                self._num_given_up -= 1
            else:
                self._num_running -= 1
            job.state = DONE
            del self._jobs[job.key]
            self._start_queued()
        self._on_done()
