"""The types that cross boundaries: scheduler -> runner -> scheduler -> caller.

``EngineOutput`` and ``Logprobs`` also cross the process boundary between the engine
core and the API server, so they are msgspec structs: encoding one step's outputs for
256 requests takes tens of microseconds (pickling dataclasses takes ~25x longer).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from engine.core.encoder_cache import EncoderCacheStats
from engine.loading.mrope import MRopePositions
from engine.sampling_params import SamplingParams
from kvcache.metrics import KVCacheStats, KVTransferStats


class FinishReason(str, enum.Enum):
    """Why a request (or one choice of it) ended; compares equal to its OpenAI string."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away, or the server shut down

    def __str__(self) -> str:
        return self.value


@dataclass
class NewRequestData:
    """A request the runner has not seen (or has dropped after a preemption)."""

    request_id: str
    token_ids: list[int]  # every known token: the prompt, plus outputs when resuming
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit (or a beam's fork/resend: what is computed): these tokens' KV is already in the pool
    # Top-N logprobs to compute for each prompt token from here on (-1: all); None: none.
    prompt_logprobs: int | None = None
    # The prompt's images (engine.multimodal.ImageInput), by offset; None without any.
    mm_inputs: list | None = None
    # An M-RoPE model's positions of the prompt (engine.mrope.MRopePositions); None: each token's index.
    mrope: MRopePositions | None = None


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds; only what changed since its last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Blocks to drop from the end of its table before the new ones (the slots of rejected proposals).
    num_trimmed_blocks: int = 0


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> new tokens computed this step
    total_num_scheduled_tokens: int
    # Requests that finished or were preempted since the last step: the runner drops their state.
    freed_request_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0
    # (source, destination) block pairs to copy before the step: a forked beam's last partial block.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Copies between the device pool and the host tier before the step (KVCacheManager.take_transfers):
    # (host block, device block) loads and (device block, host block) saves.
    kv_loads: list[tuple[int, int]] = field(default_factory=list)
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    # Images to encode before the step's forward pass (one per content hash), into the encoder cache.
    encoder_inputs: list = field(default_factory=list)
    # Content hashes whose embeddings the runner drops after the step: no request needs them any more.
    freed_encoder_hashes: list[str] = field(default_factory=list)
    # Speculative decoding: the tokens proposed for a request, computed after its last token this step (its
    # scheduled tokens count them) and verified by its sampling.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities of one generated token: its own, its rank, and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptLogprobsChunk:
    """One request's prompt logprobs computed by a step: an entry per prompt token from ``first_position``
    on (the logits of the token before each one score it)."""

    first_position: int
    entries: list[Logprobs]


@dataclass(slots=True, frozen=True)
class RunnerTiming:
    """The runner's measure of one step, when steps are measured (``ModelRunner.measure_steps``)."""

    launched_s: float  # time.perf_counter() when the step's last launch returned: the host's work ended there
    device_s: float  # forward pass and sampling on the device (CUDA events; on the CPU, launch to sync)
    graph: bool  # replayed a captured graph (decode or mixed step)
    num_reqs: int  # rows of the forward pass, a graph's padding included

    @classmethod
    def measured(cls, launched_s: float, events: tuple, shape) -> RunnerTiming:
        """A measured step's timing once it has synced: ``events`` (start, end) CUDA events, or () on the CPU, where
        the step's compute is all "device" time; ``shape`` its StepShape."""
        device_s = time.perf_counter() - launched_s
        if events:
            events[1].synchronize()
            device_s = events[0].elapsed_time(events[1]) / 1e3
        return cls(launched_s, device_s, bool(shape.graph_size or shape.mixed_size), shape.padded)


@dataclass(slots=True)
class ModelRunnerOutput:
    """Tokens sampled this step, for the requests whose known tokens are now all computed."""

    request_ids: list[str]
    sampled_token_ids: list[int]
    # Per request that asked: a Logprobs per token it got (its accepted proposals', then its sampled token's).
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    # Per request computing prompt tokens that asked for their logprobs.
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    timing: RunnerTiming | None = None  # when steps are measured
    # Speculative decoding: the proposed tokens a request's sampling accepted, which come before its sampled token.
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Pooling requests whose prompt ended this step: their pooled hidden state (engine/worker/pooling.py).
    pooled: dict[str, list[float]] = field(default_factory=dict)


class BeamResult(msgspec.Struct, array_like=True, gc=False):
    """One returned beam: its generated tokens (the stop token included), why it ended, and its score."""

    token_ids: list[int]
    finish_reason: FinishReason
    stop_token_id: int | None
    score: float  # cumulative logprob / generated_len ** length_penalty


class EngineOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step produced for one request: its new tokens and whether it is done."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the EOS or stop_token_ids entry that stopped it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    new_logprobs: list[Logprobs] = []
    queue_time_s: float | None = None  # arrival to first scheduling; None until the request is scheduled
    # With the first token, when the request asked for them: one entry per prompt token after the first.
    prompt_logprobs: list[Logprobs] | None = None
    # A finished beam search (engine/core/beam_search.py): its best beams, best first.
    beams: list[BeamResult] | None = None
    num_preemptions: int = 0  # times the request was preempted so far (its KV dropped and recomputed)
    pooled: list[float] | None = None  # a finished pooling request's output (SamplingParams.pooling)


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding's counters so far (vLLM's spec_decode_* metrics)."""

    num_drafts: int  # requests' sets of proposals verified
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]  # [k]: proposals accepted at each position


@dataclass
class LoRAStats:
    """LoRA adapters (``enable_lora``): requests by adapter name, and the device slots' traffic."""

    max_loras: int
    running: dict[str, int] = field(default_factory=dict)  # adapter name -> running requests
    waiting: dict[str, int] = field(default_factory=dict)  # adapter name -> waiting requests
    num_loads: int = 0  # adapters copied into a device slot
    num_evictions: int = 0  # adapters that left a device slot for another


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: queue sizes, counters, and the KV pool."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    kv: KVCacheStats
    # int8 [num_blocks], BlockPool.block_states() values: a copy taken with the rest of the
    # snapshot, so the dashboard's map always agrees with ``kv`` (a memcpy: ~5 us for 100k blocks).
    block_states: np.ndarray = field(compare=False, repr=False)
    num_waiting_for_grammar: int = 0  # of num_waiting: held back while their grammar compiles
    # int8 [num_blocks], BlockPool.visual_blocks(): 1 for the blocks holding image tokens.
    visual_blocks: np.ndarray | None = field(default=None, compare=False, repr=False)
    encoder: EncoderCacheStats | None = None  # a model that takes images: its encoder cache
    # Forward passes run so far, by how: "decode_graph", "mixed_graph" (engine/worker/cuda_graphs.py) or "eager".
    num_steps_by_kind: dict[str, int] = field(default_factory=dict)
    # The host tier's copies (kvcache/metrics.py KVTransferStats), when it is on; its occupancy is kv.host.
    kv_transfers: KVTransferStats | None = None
    # int8 [host blocks], HostBlockPool.block_states() (0 free, 1 cached, 2 held), when the host tier is on.
    host_block_states: np.ndarray | None = field(default=None, compare=False, repr=False)
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding on
    lora: LoRAStats | None = None  # with LoRA adapters on
