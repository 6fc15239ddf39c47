"""The KV pool dashboard: one static page and the JSON snapshot it polls.

    GET /dashboard           server/static/dashboard.html: a canvas map of the pool and the numbers
    GET /dashboard/snapshot  DashboardSnapshot, built from the engine's latest stats

The snapshot reads only ``engine.stats()``, the latest snapshot the engine core process sent
(taken between steps, at most ~50 ms old while it runs), so a request never sees the pool mid-step. The per-block states in it are a copy of an
int8 array the block pool keeps current, so a snapshot costs a bincount and a base64 pass
over ``num_blocks`` bytes, and no Python loop over blocks. Token totals are read from the
same Prometheus counters ``/metrics`` renders. Like ``/metrics``, both routes are open.
"""

from __future__ import annotations

import base64
import time
from importlib import resources

import numpy as np
from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from prometheus_client import Counter
from pydantic import BaseModel

from engine.outputs import EngineStats
from kvcache.block_pool import STATE_CACHED_FREE, STATE_FREE, STATE_IN_USE, STATE_NULL, STATE_SHARED
from server.serving import ServingContext

STATES_ENCODING = "base64-int8"
_NAME_OF_STATE = {STATE_FREE: "free", STATE_IN_USE: "in_use", STATE_CACHED_FREE: "cached_free",
                  STATE_SHARED: "shared", STATE_NULL: "null"}
# The name of each state value, indexed by the value.
STATE_NAMES = tuple(_NAME_OF_STATE[value] for value in range(len(_NAME_OF_STATE)))


class BlockCounts(BaseModel):
    """Block counts. The first four are the ``minivllm:kv_cache_blocks_*`` gauges of the same snapshot."""

    total: int  # all blocks but the null block
    free: int  # ref 0, cached or not: by_state free + cached_free
    used: int  # ref >= 1: by_state in_use + shared
    cached: int  # findable by prefix hash, in use or free
    by_state: dict[str, int]  # blocks in each state, keyed by STATE_NAMES
    visual: int = 0  # of the used and cached blocks, those holding an image's tokens (their own color on the map)


class DashboardSnapshot(BaseModel):
    time: float  # Unix time, seconds: the page divides token deltas by time deltas
    engine_status: str  # "ok", "shutting_down", "dead" or "unavailable", as /health would answer
    block_size: int  # tokens per block
    num_blocks: int  # entries in ``states``, the null block (id 0) included
    states_encoding: str  # STATES_ENCODING: base64 of one int8 per block, in block id order
    states: str
    state_names: list[str]  # STATE_NAMES: the name of each state value
    # Same encoding, one int8 per block: 1 where the block holds image tokens (a vision model's KV), else 0.
    visual: str = ""
    counts: BlockCounts
    num_running: int
    num_waiting: int
    num_preemptions: int
    generation_tokens_total: int
    prompt_tokens_total: int
    kv_usage: float  # used / total, 0 to 1
    fragmentation: float  # allocated but unused token slots / allocated slots
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found cached
    # Forward passes so far by how they ran: "decode_graph", "mixed_graph", "eager" (minivllm:engine_steps_total).
    num_steps_by_kind: dict[str, int] = {}


def dashboard_router(ctx: ServingContext) -> APIRouter:
    router = APIRouter()
    page = resources.files("server").joinpath("static/dashboard.html").read_text(encoding="utf-8")

    @router.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/snapshot")
    async def snapshot() -> DashboardSnapshot:
        return build_snapshot(ctx)

    return router


def build_snapshot(ctx: ServingContext) -> DashboardSnapshot:
    engine = ctx.engine
    return snapshot_from_stats(
        engine.stats(),
        engine_status=_engine_status(engine),
        generation_tokens_total=_counter_total(ctx.metrics.generation_tokens),
        prompt_tokens_total=_counter_total(ctx.metrics.prompt_tokens),
    )


def snapshot_from_stats(
    stats: EngineStats, engine_status: str, generation_tokens_total: int, prompt_tokens_total: int
) -> DashboardSnapshot:
    kv = stats.kv
    states = stats.block_states
    # Five vectorized compares beat np.bincount here: it would first widen the int8s to intp.
    by_state = {name: int(np.count_nonzero(states == value)) for value, name in enumerate(STATE_NAMES)}
    visual = stats.visual_blocks
    if visual is None:
        visual = np.zeros(len(states), dtype=np.int8)
    num_visual = int(np.count_nonzero((visual != 0) & (states != STATE_FREE) & (states != STATE_NULL)))
    return DashboardSnapshot(
        time=time.time(),
        engine_status=engine_status,
        block_size=kv.block_size,
        num_blocks=len(states),
        states_encoding=STATES_ENCODING,
        states=base64.b64encode(states.astype(np.int8, copy=False).tobytes()).decode("ascii"),
        state_names=list(STATE_NAMES),
        visual=base64.b64encode(visual.astype(np.int8, copy=False).tobytes()).decode("ascii"),
        counts=BlockCounts(
            total=kv.num_total_blocks, free=kv.num_free_blocks, used=kv.num_used_blocks,
            cached=kv.num_cached_blocks, by_state=by_state, visual=num_visual,
        ),
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_preemptions=stats.num_preemptions,
        generation_tokens_total=generation_tokens_total,
        prompt_tokens_total=prompt_tokens_total,
        kv_usage=kv.usage,
        fragmentation=kv.fragmentation,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        num_steps_by_kind=dict(stats.num_steps_by_kind),
    )


def _engine_status(engine) -> str:
    """What ``/health`` would say, in one word."""
    if engine.dead_error is not None:
        return "dead"
    if engine.draining:
        return "shutting_down"
    return "ok" if engine.healthy else "unavailable"


def _counter_total(counter: Counter) -> int:
    """The counter's value, read the way ``/metrics`` renders it (its ``_total`` sample)."""
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                return int(sample.value)
    raise ValueError(f"counter {counter} has no _total sample")
