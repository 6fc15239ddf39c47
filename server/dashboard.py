"""The KV pool dashboard: one static page and the JSON snapshot it polls.

    GET /dashboard           server/static/dashboard.html: a canvas map of the pool and the numbers
    GET /dashboard/snapshot  DashboardSnapshot, built from the engine's latest stats

With a host tier (``--kv-offloading-size``) the snapshot also carries its blocks' states (free, cached or
held, ``kvcache/host_pool.py``), encoded like the pool's, and its counters (``HostTier``); without one,
``host`` is None and ``host_states`` empty.

The snapshot reads only ``engine.stats()``, the latest snapshot the engine core process sent
(taken between steps, at most ~50 ms old while it runs), so a request never sees the pool mid-step. The
per-block states in it are a copy of an int8 array the block pool keeps current, so a snapshot costs a bincount
and a base64 pass
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
from kvcache.host_pool import HOST_CACHED, HOST_FREE, HOST_HELD
from kvcache.metrics import KVTransferStats
from server.serving import ServingContext

STATES_ENCODING = "base64-int8"
_NAME_OF_STATE = {STATE_FREE: "free", STATE_IN_USE: "in_use", STATE_CACHED_FREE: "cached_free",
                  STATE_SHARED: "shared", STATE_NULL: "null"}
# The name of each state value, indexed by the value.
STATE_NAMES = tuple(_NAME_OF_STATE[value] for value in range(len(_NAME_OF_STATE)))
_NAME_OF_HOST_STATE = {HOST_FREE: "free", HOST_CACHED: "cached", HOST_HELD: "held"}
# The name of each host block state value, indexed by the value.
HOST_STATE_NAMES = tuple(_NAME_OF_HOST_STATE[value] for value in range(len(_NAME_OF_HOST_STATE)))


class BlockCounts(BaseModel):
    """Block counts. The first four are the ``minivllm:kv_cache_blocks_*`` gauges of the same snapshot."""

    total: int  # all blocks but the null block
    free: int  # ref 0, cached or not: by_state free + cached_free
    used: int  # ref >= 1: by_state in_use + shared
    cached: int  # findable by prefix hash, in use or free
    by_state: dict[str, int]  # blocks in each state, keyed by STATE_NAMES
    visual: int = 0  # of the used and cached blocks, those holding an image's tokens (their own color on the map)


class Transfers(BaseModel):
    """Copies in one direction between the device pool and the host tier since start (rank 0's share under
    tensor parallelism); bytes / seconds is their bandwidth."""

    blocks: int
    bytes: int
    seconds: float  # device time of the copies on CUDA (CPU time on the CPU), counted once they finished


class HostTier(BaseModel):
    """The host KV tier (``--kv-offloading-size``): occupancy now, counters since start."""

    total: int  # host blocks: the minivllm:kv_host_blocks_total gauge
    used: int  # cached or held: minivllm:kv_host_blocks_used, by_state cached + held
    by_state: dict[str, int]  # host blocks in each state, keyed by HOST_STATE_NAMES
    external_prefix_cache_queries: int  # prompt tokens looked up in the host tier (the device pool lacked them)
    external_prefix_cache_hits: int  # of those, tokens found there and copied back
    num_blocks_saved: int  # copies to the host tier: evicted cached blocks, swapped-out requests' blocks
    num_blocks_loaded: int  # copies back: host prefix hits, swapped-in requests' blocks
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_swapped_requests: int  # preempted by swap and not resumed yet
    to_host: Transfers
    to_device: Transfers


class SpecDecode(BaseModel):
    """Speculative decoding (``--speculative-config``): counters since start, as /metrics has them."""

    num_drafts: int  # requests' sets of proposals verified: minivllm:spec_decode_num_drafts
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float  # accepted / proposed tokens, 0 to 1 (0 before any proposal)
    mean_accepted: float  # accepted tokens per set of proposals


class DashboardSnapshot(BaseModel):
    time: float  # Unix time, seconds: the page divides token deltas by time deltas
    engine_status: str  # "ok", "shutting_down", "dead" or "unavailable", as /health would answer
    block_size: int  # tokens per block
    num_blocks: int  # entries in ``states``, the null block (id 0) included
    states_encoding: str  # STATES_ENCODING: base64 of one int8 per block, in block id order (host_states too)
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
    # The host tier, when it is on (else None, 0 and ""): its counters, and its blocks' states in the
    # states_encoding, one int8 per host block in block id order, named by host_state_names.
    host: HostTier | None = None
    num_host_blocks: int = 0
    host_states: str = ""
    host_state_names: list[str] = list(HOST_STATE_NAMES)
    spec_decode: SpecDecode | None = None  # with speculative decoding on


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
        spec_decode=_spec_decode(stats),
        **_host_fields(stats),
    )


def _spec_decode(stats: EngineStats) -> SpecDecode | None:
    spec = stats.spec_decode
    if spec is None:
        return None
    accepted = spec.num_accepted_tokens
    return SpecDecode(num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens, num_accepted_tokens=accepted,
                      acceptance_rate=accepted / spec.num_draft_tokens if spec.num_draft_tokens else 0.0,
                      mean_accepted=accepted / spec.num_drafts if spec.num_drafts else 0.0)


def _host_fields(stats: EngineStats) -> dict:
    """The snapshot's host tier fields; none (their defaults) while the tier is off."""
    host, states = stats.kv.host, stats.host_block_states
    if host is None or states is None:
        return {}
    copies = stats.kv_transfers or KVTransferStats()
    return {
        "host": HostTier(
            total=host.num_total_blocks,
            used=host.num_used_blocks,
            by_state={name: int(np.count_nonzero(states == value)) for value, name in enumerate(HOST_STATE_NAMES)},
            external_prefix_cache_queries=host.external_prefix_cache_queries,
            external_prefix_cache_hits=host.external_prefix_cache_hits,
            num_blocks_saved=host.num_blocks_saved,
            num_blocks_loaded=host.num_blocks_loaded,
            num_swapped_out_blocks=host.num_swapped_out_blocks,
            num_swapped_in_blocks=host.num_swapped_in_blocks,
            num_swapped_requests=host.num_swapped_requests,
            to_host=Transfers(blocks=copies.blocks_to_host, bytes=copies.bytes_to_host,
                              seconds=copies.seconds_to_host),
            to_device=Transfers(blocks=copies.blocks_to_device, bytes=copies.bytes_to_device,
                                seconds=copies.seconds_to_device),
        ),
        "num_host_blocks": len(states),
        "host_states": base64.b64encode(states.astype(np.int8, copy=False).tobytes()).decode("ascii"),
    }


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
