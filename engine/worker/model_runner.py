"""Turns a scheduler plan into one forward pass and one sampled token per finished sequence.

The runner never sees a ``Request``: it keeps its own per-request rows (``InputBatch``),
updated from the scheduler's ``SchedulerOutput``, and builds the flat step inputs from
them with vector operations. The model sees only tensors and the step's attention
metadata. The one host sync of a step is reading the sampled tokens back.

A model that takes images gets them at prefill only: the step first encodes the images the
scheduler names into the encoder cache (embeddings by content hash), then the tokens of the
step that are image placeholders take their rows of those embeddings in place of the token
embeddings; their K/V go into the ordinary blocks. Such steps run eagerly; decode steps never
see an image, so they keep their CUDA graphs.

An M-RoPE model (Qwen2.5-VL) takes three positions per token, not the token's index: the runner
writes them into the step buffers' [3, tokens] positions from each request's own (the scheduler
hands them over with the request, engine/loading/mrope.py): a table up to the end of its last image
(chunked prefill and prefix-cache hits read their part of it), the index plus the request's
delta from there, which is every decode token. Decode graphs read the same buffer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import ConfigError, EngineConfig
from engine.distributed import broadcast_from_rank0, kv_head_range, min_over_ranks, tp_rank, tp_size
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from engine.models.linear import DECODE_KSPLIT_MAX_ROWS, LinearBase, decode_k_split_setting, decode_k_split_summary
from engine.ops.greedy import argmax_in_graphs, argmax_rows
from engine.outputs import Logprobs, ModelRunnerOutput, SchedulerOutput
from engine.worker.cuda_graphs import DecodeGraphs, MixedGraphs
from engine.worker.input_batch import InputBatch
from engine.worker.sampler import Sampler, SamplingTensors, build_logprobs, gather_logprobs, pad_token_ids, score_tokens
from engine.worker.step_buffers import StepBuffers
from engine.worker.step_channel import StepChannel, StepShape
from kvcache.paged_cache import PagedKVCache

logger = logging.getLogger("minivllm")

# Prompts in the profiling pass are cut into requests of at most this many tokens.
_PROFILE_REQUEST_LEN = 512
# Prompt logprobs are computed this many tokens at a time: [rows, vocab] float32 logits each.
_PROMPT_LOGPROBS_CHUNK = 1024


@dataclass
class StepHandle:
    """A launched step: its inputs and where its sampled tokens will be."""

    inputs: "StepInputs | None" = None
    sampled: torch.Tensor | None = None  # [num_sampled] on the device
    sampled_host: torch.Tensor | None = None  # pinned host copy, valid once ``ready`` has passed
    # Logprob pieces of the rows that asked for them, copied to host memory behind the step:
    # (their indices in the batch, top-N per row, chosen, ranks, top ids, top values).
    logprobs: tuple | None = None
    ready: "torch.cuda.Event | None" = None
    events: tuple | None = None  # timing events when steps are measured
    launched: float = 0.0
    # (logits, SamplingTensors) of a step whose sampling waits for launch_sampling (grammar masks).
    pending: tuple | None = None
    # Prompt logprobs of the step, being copied to host memory: ((chosen, ranks, top ids, top values),
    # the CUDA event after the copies).
    prompt_logprobs: tuple | None = None


@dataclass
class StepInputs:
    """The flat tensors of one step, plus which rows get a sampled token."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64; [3, num_tokens] for an M-RoPE model
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64: last token of each sampled request
    sampled_request_ids: list[str]  # requests that get a token, in logits order
    sampled_rows: np.ndarray  # [num_sampled] their InputBatch rows
    graph_size: int | None = None  # the captured decode graph to replay, if any
    mixed_size: int | None = None  # else the captured mixed-step graph (its token count), if any
    samples_leading_rows: bool = False  # logits_indices == 0..num_sampled-1
    # Tokens whose id a step in flight is still sampling: their batch positions and requests.
    placeholder_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    placeholder_request_ids: list[str] = field(default_factory=list)
    prompt_logprobs: "PromptLogprobsPlan | None" = None
    # Image embeddings for some of the step's tokens: (their positions in the flat tokens [K] int64 on the
    # device, their embeddings [K, hidden]); None when the step has no image token.
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class PromptLogprobsPlan:
    """The prompt tokens of a step whose logprobs were asked for: each computed token's logits score
    the prompt token after it."""

    token_indices: torch.Tensor  # [K] positions in the step's flat tokens, on the device
    token_ids_host: np.ndarray  # the same, in host memory (for the other tensor-parallel ranks)
    targets: torch.Tensor  # [K] the prompt token each of them predicts, on the device
    target_ids: np.ndarray  # the same, in host memory
    num_top: int  # top-N computed for all K (the largest any of the requests asked for)
    # Per request, in token order: (request id, prompt position of its first target, count, its top-N).
    requests: list[tuple[str, int, int, int]]


def make_attention_backend(name: str):
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ConfigError(f"unknown attention backend {name!r}")


def warm_up_token_counts(limit: int) -> list[int]:
    """Step sizes (tokens) that together compile every variant a step of up to ``limit`` tokens can pick: each
    power of two and the count just past it, and the largest counts of both kinds: for every step size and any one
    switch by token count (``n >= threshold``), a count on the same side of it that Triton specializes alike
    (1, a multiple of 16, or neither)."""
    counts = {n for k in range(limit.bit_length()) for n in (1 << k, (1 << k) + 1) if n <= limit}
    return sorted(counts | {n for n in (limit, limit - 1, limit - limit % 16) if n >= 1})


def kv_outside_windows(layer_windows: tuple[int, ...], num_tokens: int) -> float:
    """The share of a ``num_tokens``-token request's KV that no attention reads: in each windowed layer, the
    tokens before its window (0 for a window of 0, i.e. full attention). What one block table for all layers
    costs against per-layer tables that free those blocks (Gemma 3 at 32k tokens: 5 layers in 6 with 1,024-token
    windows, 81%)."""
    outside = sum(max(0, num_tokens - w) for w in layer_windows if w)
    return outside / (num_tokens * len(layer_windows))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = config.rank_device(tp_rank())
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # a tensor-parallel rank's own GPU
        self.dtype = config.resolve_dtype(self.device)
        self.kv_dtype = config.resolve_kv_cache_dtype(self.dtype)
        self.block_size = config.kvcache_block_size
        self.num_kv_heads = kv_head_range(model_config.num_key_value_heads)[1]  # this rank's share
        self.model = load_model(model_config, self.dtype, self.device, config.load_format, config.seed,
                                config.quantization)
        self.backend = make_attention_backend(config.resolve_attention_backend(self.device))
        for layer in self.model.attention_layers():
            layer.set_backend(self.backend)
        k_split = decode_k_split_summary(self.model)
        if k_split:
            logger.info("products of steps of up to %d tokens cut along K (MINIVLLM_DECODE_KSPLIT=%s): %s",
                        DECODE_KSPLIT_MAX_ROWS, decode_k_split_setting(), k_split)
        self.sampler = Sampler()
        self.kv_cache: PagedKVCache | None = None
        max_blocks = -(-max_model_len // self.block_size)
        self.batch = InputBatch(config.max_num_seqs, max_model_len, max_blocks, model_config.vocab_size, self.device)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.buffers = StepBuffers(max_tokens, config.max_num_seqs, max_blocks, self.device,
                                   mrope=model_config.mrope_section is not None)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        # Encoded images, by content hash: [image tokens, hidden] each (the scheduler decides what stays).
        self.encoder_cache: dict[str, torch.Tensor] = {}
        pin = self.device.type == "cuda"
        self._sampled_host = [torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._sampled_turn = 0
        self._inputs_copied: torch.cuda.Event | None = None  # the last step's input copies
        # Rank 0 of several: the channel its steps go out on to the other ranks (engine/worker/ranks.py).
        self.followers = None
        if tp_size() > 1 and tp_rank() == 0:
            self.followers = StepChannel()
        self.measure_steps = False  # record host/device time per step (benchmarks)
        # Forward passes launched, by how they ran (the engine's metrics report them).
        self.num_steps_by_kind = {"decode_graph": 0, "mixed_graph": 0, "eager": 0}
        self.last_timing: tuple | None = None
        logger.info("model runner: %s on %s, %s attention backend", self.dtype, self.device, self.backend.name)

    # ---------------------------------------------------------------- KV cache

    def bytes_per_block(self) -> int:
        mc = self.model_config
        return PagedKVCache.bytes_per_block(mc.num_hidden_layers, self.block_size, self.num_kv_heads,
                                            mc.head_dim, self.kv_dtype)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit: the configured count, or the memory budget over the block size.

        On CUDA the budget is what ``gpu_memory_utilization`` of the card leaves after the
        weights and the peak activations of a profiling pass at the largest batch.
        """
        if self.config.num_kvcache_blocks > 0:
            return self.config.num_kvcache_blocks
        if self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = int(self.config.cpu_kvcache_space_gib * 2**30)
        return min_over_ranks(PagedKVCache.num_blocks_for_budget(
            budget, self.model_config.num_hidden_layers, self.block_size, self.num_kv_heads,
            self.model_config.head_dim, self.kv_dtype,
        ))

    def init_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        usable_tokens = (num_blocks - 1) * self.block_size  # block 0 is the null block
        if usable_tokens < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {usable_tokens} tokens ({num_blocks} blocks of {self.block_size}), fewer than "
                f"max_model_len={self.max_model_len}: lower max_model_len or give the cache more memory"
            )
        self.kv_cache = PagedKVCache(mc.num_hidden_layers, num_blocks, self.block_size, self.num_kv_heads,
                                     mc.head_dim, self.kv_dtype, self.device)
        self._bind_kv_cache(self.kv_cache)
        logger.info("KV cache%s: %s", f" of rank {tp_rank()} (its share of the heads)" if tp_size() > 1 else "",
                    self.kv_cache.describe())
        if self.kv_dtype != self.dtype:
            dense = PagedKVCache.bytes_per_block(mc.num_hidden_layers, self.block_size, self.num_kv_heads,
                                                 mc.head_dim, self.dtype)
            logger.info("KV cache in float8_e4m3: %.2fx the tokens a %s cache would hold in the same memory",
                        dense / self.bytes_per_block(), str(self.dtype).removeprefix("torch."))
        windows = [w for w in mc.layer_windows if w]
        if windows:
            logger.info("sliding windows on %d of %d layers (%s tokens): one block table serves every layer, so a "
                        "request keeps the KV of all its tokens in every layer until it ends, where the windowed "
                        "layers read only their window's blocks; at %d tokens %.0f%% of the KV a request holds is "
                        "never read (older than its layer's window)", len(windows), mc.num_hidden_layers,
                        ", ".join(str(w) for w in sorted(set(windows))), self.max_model_len,
                        100 * kv_outside_windows(mc.layer_windows, self.max_model_len))

    def _bind_kv_cache(self, cache: PagedKVCache) -> None:
        for i, layer in enumerate(self.model.attention_layers()):
            layer.bind_kv_cache(*cache.layer(i), cache.layer_scales(i))

    def warm_up_kernels(self) -> None:
        """Compile the attention kernels' variants before the first request rather than during it."""
        start = time.perf_counter()
        layer = self.model.attention_layers()[0]
        windows = tuple(sorted({a.sliding_window for a in self.model.attention_layers()}))
        # FP8 projections that take quantized inputs get them from the decode kernels too (Attention.forward).
        fp8_inputs = any(m.takes_fp8_input for m in self.model.modules() if isinstance(m, LinearBase))
        # The KV-cache write ropes q and k (the layers' rope); FP8 q|k|v products may leave it their column scales.
        n = self.backend.warm_up(layer.num_heads, layer.k_cache, layer.v_cache, self.buffers.block_tables.device,
                                 max(self.config.max_num_batched_tokens, 1), windows, layer.kv_scales,
                                 self.dtype, layer.softcap, fp8_out=fp8_inputs, rope=layer.rope,
                                 column_scales=fp8_inputs)
        if n:
            logger.info("attention kernels: %d variants ready in %.1f s", n, time.perf_counter() - start)
        self._warm_up_experts()
        self._warm_up_step_sizes()

    def _warm_up_step_sizes(self) -> None:
        """Run the model once at every kind of token count a step can bring, so that the layers' Triton kernels
        compile now rather than stall a step.

        Triton compiles an integer argument apart when it is 1 or a multiple of 16, and layers pick variants by
        the step's token count (the FP8 SwiGLU's rows a program from ``_SWIGLU_ROWS_FROM``, the FP8 products'
        deferred column scales from ``BLOCK_SCALES_MIN_ROWS``): ``warm_up_token_counts`` meets every one of them.
        """
        if self.device.type != "cuda":
            return
        limit = self._max_step_tokens()
        counts = warm_up_token_counts(limit)
        start = time.perf_counter()
        with torch.inference_mode():
            for n in tqdm(counts, desc="warming up step sizes", unit="step", leave=False):
                self._dummy_forward(n)
        torch.cuda.synchronize(self.device)
        logger.info("model kernels: %d step sizes (1 to %d tokens) run in %.1f s", len(counts), limit,
                    time.perf_counter() - start)

    def _warm_up_experts(self) -> None:
        """The fused-MoE kernels' variants for every step size (one layer's experts stand for all: same shapes)."""
        from engine.models.moe import FusedExperts

        experts = next((m for m in self.model.modules() if isinstance(m, FusedExperts)), None)
        if experts is None or not experts.uses_triton(experts.w13):
            return
        from engine.ops import moe as moe_kernels

        start = time.perf_counter()
        top_k = self.model_config.moe.top_k
        with torch.inference_mode():
            n = moe_kernels.warm_up(experts.w13, experts.w2, top_k, max(self.config.max_num_batched_tokens, 1))
        logger.info("fused-MoE kernels: %d variants ready in %.1f s", n, time.perf_counter() - start)

    def capture_cuda_graphs(self) -> None:
        """Capture mixed-step and decode graphs (CUDA with a graph-safe backend, unless ``enforce_eager``), into one
        memory pool: a step replays one graph at a time."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.backend.name != "triton":
            logger.info("CUDA graphs off: every step runs eagerly")
            return
        if not getattr(self.model, "supports_cuda_graphs", True):
            logger.info("CUDA graphs off: %s's experts run eagerly (the torch reference)", self.model_config.architecture)
            return
        greedy = argmax_in_graphs() and tp_rank() == 0
        pool = torch.cuda.graph_pool_handle()
        token_sizes = self.config.graph_token_sizes()
        if token_sizes:  # the larger graphs first, so that the decode graphs reuse their memory
            self.mixed_graphs = MixedGraphs(self.model, self.buffers, token_sizes, self.config.max_num_seqs,
                                            self.block_size, self.max_model_len)
            self.mixed_graphs.capture(pool)
        self.graphs = DecodeGraphs(self.model, self.buffers, self.config.graph_batch_sizes(), self.block_size,
                                   self.max_model_len, greedy=greedy)
        self.graphs.capture(pool)

    def _profile_cuda_budget(self) -> int:
        """Run the largest step with a scratch cache; return the bytes left for the KV pool."""
        scratch_blocks = -(-self._profile_request_len() // self.block_size) + 1
        mc = self.model_config
        scratch = PagedKVCache(mc.num_hidden_layers, scratch_blocks, self.block_size, self.num_kv_heads,
                               mc.head_dim, self.kv_dtype, self.device)
        self._bind_kv_cache(scratch)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch.nbytes
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak - non_torch
        logger.info(
            "memory profile: %.2f GiB total, weights+peak activations %.2f GiB, other %.2f GiB, KV budget %.2f GiB",
            total / 2**30, peak / 2**30, non_torch / 2**30, budget / 2**30,
        )
        if budget <= 0:
            raise ConfigError("no GPU memory is left for the KV cache: raise gpu_memory_utilization or shrink the batch")
        return budget

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward pass over ``max_num_batched_tokens`` tokens and sampling of ``max_num_seqs`` rows.

        Every token's slot is in the null block, so it writes nothing that matters.
        """
        num_tokens = self._max_step_tokens()
        hidden = self._dummy_forward(num_tokens)
        num_rows = min(self.config.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:num_rows])
        st = SamplingTensors(
            temperature=torch.ones(num_rows, device=self.device),
            top_k=torch.full((num_rows,), 50, device=self.device),
            top_p=torch.full((num_rows,), 0.9, device=self.device),
            min_p=None,
        )
        self.sampler(logits, st)  # its greedy tokens of float32 logits included
        argmax_rows(logits)  # and of the model's dtype, as greedy-only steps take them
        if getattr(self.model, "accepts_images", False):  # the largest encoder batch a step may run
            self.model.encode_images(*self.model.dummy_images(self.config.max_num_batched_tokens, self.dtype,
                                                              self.device))

    def _max_step_tokens(self) -> int:
        return min(self.config.max_num_batched_tokens, self.config.max_num_seqs * self.max_model_len)

    def _profile_request_len(self) -> int:
        """The warm-up passes' request length: ``_PROFILE_REQUEST_LEN``, or ``max_model_len`` where shorter. A
        position past ``max_model_len`` may lie past the rope's table (``max_position_embeddings`` rows): the Triton
        rope would read garbage, whose K/V lands in the null block, which attention over padded block tables
        reads (masked out, but NaN * 0 is NaN)."""
        return min(_PROFILE_REQUEST_LEN, self.max_model_len)

    def _dummy_forward(self, num_tokens: int) -> torch.Tensor:
        """The model over ``num_tokens`` prompt tokens in requests of up to ``_profile_request_len`` tokens, every
        slot in the null block; returns the hidden states."""
        request_len = self._profile_request_len()
        lens = [request_len] * (num_tokens // request_len)
        if num_tokens % request_len:
            lens.append(num_tokens % request_len)
        meta = self._dummy_metadata(lens)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        return self.model(input_ids, positions, meta)

    def _dummy_metadata(self, lens: list[int]) -> AttentionMetadata:
        max_len = max(lens)
        qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        num_blocks = -(-max_len // self.block_size)
        return AttentionMetadata(
            slot_mapping=torch.zeros(sum(lens), dtype=torch.long, device=self.device),
            query_start_loc=qsl.to(self.device),
            seq_lens=seq_lens.to(self.device),
            block_tables=torch.zeros(len(lens), num_blocks, dtype=torch.int32, device=self.device),
            num_reqs=len(lens), num_decodes=0, num_decode_tokens=0, max_query_len=max_len, max_seq_len=max_len,
            block_size=self.block_size, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        )

    # --------------------------------------------------------------- one step

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to completion."""
        return self.finish(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, in_flight: StepHandle | None = None, sample: bool = True) -> StepHandle:
        """Queue one step's forward pass and sampling on the device; return without waiting for it.

        The sampled tokens are copied to pinned host memory behind the step, so ``finish``
        waits for exactly this step and nothing queued after it. When the step was planned
        while ``in_flight`` was still running, the tokens that step is sampling are fed to this
        one on the device, without a round trip through the host. ``sample=False`` queues only
        the forward pass: ``launch_sampling`` queues the rest once grammar masks are known.
        """
        self._update_states(sched)
        if sched.block_copies:  # forked beams' partial blocks, before anything writes to them
            self.kv_cache.copy_blocks(sched.block_copies)
        if sched.encoder_inputs:
            self._encode_images(sched.encoder_inputs)
        if sched.is_empty:
            self._free_encoder_outputs(sched.freed_encoder_hashes)
            return StepHandle()
        inputs = self._prepare_inputs(sched)
        if len(inputs.placeholder_tokens):
            self._feed_in_flight_tokens(inputs, in_flight)
        if self.followers is not None:
            broadcast_from_rank0(inputs.input_ids)  # with the tokens of the step in flight
        # Built before the forward pass is queued, so their small host-to-device copies never
        # wait behind it.
        st = self._sampling_tensors(inputs.sampled_rows) if len(inputs.sampled_rows) else None
        events = self._start_timing()
        greedy = None  # each sampled row's argmax of its logits, where a graph took it
        kind = ("decode_graph" if inputs.graph_size is not None else
                "mixed_graph" if inputs.mixed_size is not None else "eager")
        self.num_steps_by_kind[kind] += 1
        if inputs.graph_size is not None:
            logits, greedy = self.graphs.replay(inputs.graph_size)
            # Every row of a decode step is sampled, in order: a view instead of a gather.
            n = len(inputs.sampled_rows)
            logits = logits[:n] if inputs.samples_leading_rows else logits[inputs.logits_indices]
            if greedy is not None:
                greedy = greedy[:n] if inputs.samples_leading_rows else greedy[inputs.logits_indices]
        elif inputs.mixed_size is not None:
            # The graph's rows: the sampled tokens' hidden states first, then padding; the LM head takes the
            # sampled ones (other tensor-parallel ranks too: StepShape.num_sampled).
            rows = self.mixed_graphs.run(inputs.mixed_size)
            n = len(inputs.sampled_rows)
            logits = self.model.compute_logits(rows[:n]) if n else None
        elif inputs.image_embeds is not None:
            embeds = self.model.embed_input_ids(inputs.input_ids, *inputs.image_embeds)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs_embeds=embeds)
            logits = self.model.compute_logits(hidden[inputs.logits_indices]) if st is not None else None
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
            logits = self.model.compute_logits(hidden[inputs.logits_indices]) if st is not None else None
        if sched.freed_encoder_hashes:  # after the forward pass that read them is queued
            self._free_encoder_outputs(sched.freed_encoder_hashes)
        handle = StepHandle(inputs=inputs, events=events, launched=time.perf_counter())
        if inputs.prompt_logprobs is not None:
            handle.prompt_logprobs = self._launch_prompt_logprobs(hidden, inputs.prompt_logprobs)
        if st is None:
            if events:
                events[1].record()
            return handle
        handle.pending = (logits, st, greedy)
        if sample:
            self.launch_sampling(handle)
        return handle

    @torch.inference_mode()
    def launch_sampling(self, handle: StepHandle, masks: tuple[torch.Tensor, list[int]] | None = None) -> None:
        """Queue the sampling of a step whose forward pass is queued. ``masks``: a [sampled rows, vocab/32]
        int32 bitmask (host memory) of the tokens each constrained row's grammar allows, and those rows;
        None for no constraint."""
        logits, st, greedy = handle.pending
        handle.pending = None
        if masks is not None:
            bitmask = self._upload(masks[0])
            words = -(-logits.shape[-1] // 32)
            if bitmask.shape[1] < words:  # the grammars' vocabulary is the tokenizer's: the padding ids stay out
                bitmask = torch.nn.functional.pad(bitmask, (0, words - bitmask.shape[1]))
            st.bitmask, st.bitmask_rows = bitmask, masks[1]
        sampled, raw_logprobs = self.sampler(logits, st, greedy)
        # Two pinned buffers in turn: with a step planned ahead, this copy may land while the
        # host still reads the previous step's tokens.
        self._sampled_turn ^= 1
        inputs = handle.inputs
        sampled_host = self._sampled_host[self._sampled_turn][: len(inputs.sampled_rows)]
        sampled_host.copy_(sampled, non_blocking=True)
        handle.sampled, handle.sampled_host = sampled, sampled_host
        if raw_logprobs is not None:
            handle.logprobs = self._launch_logprobs(raw_logprobs, sampled, inputs.sampled_rows)
        if handle.events:
            handle.events[1].record()
        if self.device.type == "cuda":
            handle.ready = torch.cuda.Event()
            handle.ready.record()
        handle.launched = time.perf_counter()

    @torch.inference_mode()
    def finish(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step; record its tokens and return them."""
        if handle.inputs is None:
            return ModelRunnerOutput([], [])
        if handle.pending is not None:
            raise RuntimeError("finish() on a step whose sampling was never launched (launch_sampling)")
        if handle.ready is not None:
            handle.ready.synchronize()  # the step's one host sync
        if handle.events is not None:
            self._finish_timing(handle.events, handle.launched, handle.inputs)
        inputs = handle.inputs
        prompt_logprobs = {}
        if handle.prompt_logprobs is not None:
            pieces, ready = handle.prompt_logprobs
            if ready is not None:
                ready.synchronize()
            prompt_logprobs = self._prompt_logprobs(inputs.prompt_logprobs, pieces)
        if handle.sampled is None:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs)
        token_ids = handle.sampled_host.tolist()
        # Rows by request id: a request dropped since this step was launched (finished,
        # preempted) has no row any more, and its row may already belong to another request.
        rows = [self.batch.row_of.get(rid, -1) for rid in inputs.sampled_request_ids]
        live = [i for i, row in enumerate(rows) if row >= 0]
        self.batch.append_sampled(np.asarray([rows[i] for i in live], dtype=np.int64),
                                  np.asarray([token_ids[i] for i in live], dtype=np.int64))
        sampled_ids = inputs.sampled_request_ids
        output = ModelRunnerOutput(sampled_ids, token_ids, prompt_logprobs=prompt_logprobs)
        if handle.logprobs is not None:
            output.logprobs = self._logprobs(handle.logprobs, token_ids, sampled_ids)
        return output

    def _feed_in_flight_tokens(self, inputs: StepInputs, in_flight: StepHandle | None) -> None:
        """Write the tokens the in-flight step is sampling into this step's input ids, on the device."""
        if in_flight is None or in_flight.sampled is None:
            raise RuntimeError("a step needs tokens of a step in flight, but none was given")
        index_of = {rid: i for i, rid in enumerate(in_flight.inputs.sampled_request_ids)}
        src = torch.tensor([index_of[rid] for rid in inputs.placeholder_request_ids], dtype=torch.long)
        dst = torch.from_numpy(inputs.placeholder_tokens)
        inputs.input_ids[self._upload(dst)] = in_flight.sampled[self._upload(src)]

    def _start_timing(self):
        if not self.measure_steps:
            return None
        if self.device.type != "cuda":
            return ()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _finish_timing(self, events, launched: float, inputs: StepInputs) -> None:
        synced = time.perf_counter()
        device_s = synced - launched  # CPU: the step's compute is all "device" time
        if events:
            events[1].synchronize()
            device_s = events[0].elapsed_time(events[1]) / 1e3
        graph = inputs.graph_size is not None or inputs.mixed_size is not None
        self.last_timing = (launched, synced, device_s, graph, int(inputs.meta.num_reqs))

    def _encode_images(self, images: list) -> None:
        """Run the vision encoder (and projector) on the step's new images and keep each image's embeddings in
        the encoder cache under its content hash. Images of one size (LLaVA) go in a batch per pixel shape;
        images with a patch grid (Qwen2.5-VL) all at once, their patches concatenated, with their grids."""
        by_shape: dict[tuple[int, ...], list] = {}
        for mm in images:
            key = () if mm.grid_thw is not None else tuple(mm.pixel_values.shape)  # images with grids: one batch
            by_shape.setdefault(key, []).append(mm)
        for group in by_shape.values():
            pixels = [mm.pixel_values.to_numpy() for mm in group]
            if group[0].grid_thw is None:
                embeds = self.model.encode_images(self._upload(np.stack(pixels)).to(self.dtype))
            else:
                grids = self._upload(np.array([mm.grid_thw for mm in group], dtype=np.int64))
                embeds = self.model.encode_images(self._upload(np.concatenate(pixels)).to(self.dtype), grids)
            for mm, rows in zip(group, embeds):  # [tokens of the image, hidden] each
                if rows.shape[0] != mm.length:
                    raise RuntimeError(f"an image encoded to {rows.shape[0]} embeddings for {mm.length} tokens")
                self.encoder_cache[mm.content_hash] = rows

    def _free_encoder_outputs(self, content_hashes: list[str]) -> None:
        for content_hash in content_hashes:
            self.encoder_cache.pop(content_hash, None)

    def _gather_image_embeds(self, rows: np.ndarray, counts: np.ndarray, ends: np.ndarray):
        """(flat token positions, embeddings) of the step's image placeholder tokens, from the encoder cache;
        None when it has none. A request whose prefill passes its last image leaves ``batch.mm_inputs``."""
        b = self.batch
        positions, pieces, done = [], [], []
        for rid, images, lo, hi, first in self._step_chunks(b.mm_inputs, rows, counts, ends):
            for mm in images:
                if mm.offset >= hi:
                    break
                start, end = max(lo, mm.offset), min(hi, mm.end)
                if start >= end:
                    continue
                embeds = self.encoder_cache.get(mm.content_hash)
                if embeds is None:
                    raise RuntimeError(f"request {rid}: image {mm.content_hash} is not in the encoder cache")
                pieces.append(embeds[start - mm.offset : end - mm.offset])
                positions.append(np.arange(first + start - lo, first + end - lo, dtype=np.int64))
            if hi >= images[-1].end:
                done.append(rid)
        for rid in done:
            del b.mm_inputs[rid]
        if not pieces:
            return None
        return self._upload(np.concatenate(positions)), torch.cat(pieces)

    def _step_chunks(self, by_request: dict, rows: np.ndarray, counts: np.ndarray, ends: np.ndarray):
        """(request id, its entry, lo, hi, first) for each request of ``by_request`` that this step runs: its chunk
        is its tokens ``lo..hi-1``, at the step's flat positions from ``first`` on."""
        b = self.batch
        batch_index = {row: i for i, row in enumerate(rows.tolist())}
        for rid, entry in by_request.items():
            i = batch_index.get(b.row_of[rid])
            if i is not None:
                lo = int(b.num_computed[rows[i]])
                yield rid, entry, lo, lo + int(counts[i]), int(ends[i] - counts[i])

    def _fill_mrope_positions(self, rows: np.ndarray, counts: np.ndarray, ends: np.ndarray, positions: np.ndarray,
                              token_rows: np.ndarray, padded_tokens: int) -> None:
        """The step's [3, tokens] M-RoPE positions: each token's index plus its request's delta in all three rows,
        then, for the requests whose chunk reaches into the positions before the end of their last image, those
        from their table. A request whose prefill passes its last image leaves ``batch.mrope_tables``."""
        b = self.batch
        out = self.buffers.mrope_positions.np
        num_tokens = len(positions)
        out[:, :num_tokens] = positions + b.mrope_delta[token_rows]
        out[:, num_tokens:padded_tokens] = 0  # a decode graph's padding rows
        if not b.mrope_tables:
            return
        done = []
        for rid, table, lo, hi, first in self._step_chunks(b.mrope_tables, rows, counts, ends):
            end = min(hi, table.shape[1])
            if lo < end:
                out[:, first : first + end - lo] = table[:, lo:end]
            if hi >= table.shape[1]:
                done.append(rid)
        for rid in done:
            del b.mrope_tables[rid]

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.freed_request_ids:
            self.batch.remove(rid)
        for data in sched.new_requests:
            self.batch.add(data, self.eos_token_ids)
        for data in sched.cached_requests:
            self.batch.update(data)

    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """Flat step inputs, built with vector ops into the persistent buffers and copied asynchronously."""
        b, buf, bs = self.batch, self.buffers, self.block_size
        # With a step planned ahead, the previous step's copies may still be reading the pinned buffers.
        self.wait_for_input_copies()
        req_ids = list(sched.num_scheduled_tokens)
        rows = np.fromiter((b.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        counts = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        # Decodes (one new token) first, longest context first: the decode kernels start one program per row (and
        # KV head) in row order, so the long contexts start first and the short ones fill the tail, and no
        # program has to look its row up.
        seq_lens = b.num_computed[rows] + counts  # context length after this step
        order = np.lexsort((-seq_lens, counts > 1))
        rows, counts, seq_lens = rows[order], counts[order], seq_lens[order]
        num_reqs, num_tokens = len(rows), int(counts.sum())
        num_decodes = int(np.count_nonzero(counts == 1))

        ends = np.cumsum(counts)  # [num_reqs]
        token_req = np.repeat(np.arange(num_reqs), counts)  # [num_tokens] batch index of each token
        positions = b.num_computed[rows][token_req] + np.arange(num_tokens) - (ends - counts)[token_req]
        token_rows = rows[token_req]
        max_seq_len = int(seq_lens.max())
        width = -(-max_seq_len // bs)  # block-table columns this step reads
        # A request gets a token when this step computes the last of its known tokens.
        sample_mask = seq_lens >= b.num_tokens[rows]
        sampled = np.nonzero(sample_mask)[0]

        prompt_lp = None
        if (b.num_prompt_logprobs[rows] >= 0).any():
            prompt_lp = self._plan_prompt_logprobs(rows, token_req, token_rows, positions, req_ids, order)
        image_embeds = self._gather_image_embeds(rows, counts, ends) if b.mm_inputs else None
        eager = prompt_lp is not None or image_embeds is not None
        graph_size = None if eager else self._graph_size(num_reqs, num_decodes)
        mixed_size = None
        if not eager and graph_size is None and self.mixed_graphs is not None:
            mixed_size = self.mixed_graphs.padded_size(num_tokens)
        if mixed_size is not None:
            padded, padded_tokens = self.mixed_graphs.rows(mixed_size), mixed_size
        else:
            padded, padded_tokens = graph_size or num_reqs, graph_size or num_tokens
        buf.input_ids.np[:num_tokens] = b.token_ids[token_rows, positions]
        buf.positions.np[:num_tokens] = positions
        buf.slot_mapping.np[:num_tokens] = b.block_table[token_rows, positions // bs] * bs + positions % bs
        buf.seq_lens.np[:num_reqs] = seq_lens
        buf.query_start_loc.np[0] = 0
        buf.query_start_loc.np[1 : num_reqs + 1] = ends
        buf.block_tables.np[:num_reqs, :width] = b.block_table[rows, :width]
        buf.logits_indices.np[: len(sampled)] = ends[sampled] - 1 if graph_size is None else sampled
        if graph_size is not None:
            # Padding rows: length 0, slot 0 of the null block, token 0.
            for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
                getattr(buf, name).np[num_reqs:padded] = 0
            buf.query_start_loc.np[num_reqs + 1 : padded + 1] = ends[-1]
        if mixed_size is not None:
            # Padding tokens: token 0 at position 0, slot 0 of the null block; padding requests: no tokens, length 0;
            # logits rows past the sampled ones: token 0's.
            for name in ("input_ids", "positions", "slot_mapping"):
                getattr(buf, name).np[num_tokens:padded_tokens] = 0
            buf.seq_lens.np[num_reqs:padded] = 0
            buf.query_start_loc.np[num_reqs + 1 : padded + 1] = num_tokens
            buf.logits_indices.np[len(sampled):padded] = 0

        if buf.mrope_positions is not None:  # M-RoPE: the model reads three positions per token
            self._fill_mrope_positions(rows, counts, ends, positions, token_rows, padded_tokens)

        shape = StepShape(num_reqs=num_reqs, num_decodes=num_decodes, padded=padded, padded_tokens=padded_tokens,
                          width=width, graph_size=graph_size or 0, mixed_size=mixed_size or 0,
                          max_query_len=int(counts.max()), max_seq_len=max_seq_len,
                          num_logits=padded if mixed_size is not None else len(sampled), num_sampled=len(sampled))
        if self.followers is not None:  # the other tensor-parallel ranks run the same step
            self.followers.send(shape, buf, prompt_lp.token_ids_host if prompt_lp is not None else None,
                                sched.block_copies)
        input_ids, device_positions, meta, logits_indices = self.device_inputs(shape)
        inputs = StepInputs(
            input_ids=input_ids,
            positions=device_positions,
            meta=meta,
            logits_indices=logits_indices,
            sampled_request_ids=[req_ids[order[i]] for i in sampled.tolist()],
            sampled_rows=rows[sampled],
            graph_size=graph_size,
            mixed_size=mixed_size,
            samples_leading_rows=bool(graph_size is not None and len(sampled) and sampled[-1] == len(sampled) - 1),
            prompt_logprobs=prompt_lp,
            image_embeds=image_embeds,
        )
        unknown = np.nonzero(positions >= b.num_tokens[token_rows])[0]  # ids a step in flight is sampling
        if len(unknown):
            inputs.placeholder_tokens = unknown
            inputs.placeholder_request_ids = [req_ids[order[token_req[t]]] for t in unknown.tolist()]
        return inputs

    def wait_for_input_copies(self) -> None:
        """Wait until the last step's host-to-device input copies have read the pinned host buffers."""
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()

    def device_inputs(self, shape: StepShape):
        """The step's inputs on the device from the host buffers: (input ids, positions, attention metadata,
        logits indices). Rank 0 fills the buffers from its batch; the other ranks from rank 0's message."""
        buf, padded, padded_tokens, width = self.buffers, shape.padded, shape.padded_tokens, shape.width
        graph = shape.graph_size > 0 or shape.mixed_size > 0
        if shape.mixed_size:  # which rows are decodes, for the graph's attention (AttentionMetadata.decode_seq_lens)
            single = np.diff(buf.query_start_loc.np[: padded + 1]) == 1
            buf.decode_seq_lens.np[:padded] = np.where(single, buf.seq_lens.np[:padded], 0)
            buf.decode_seq_lens.copy_to_device(padded)
        seq_lens_cpu = buf.seq_lens.host[:padded].clone()
        qsl_cpu = buf.query_start_loc.host[: padded + 1].clone()
        meta = AttentionMetadata(
            slot_mapping=buf.slot_mapping.copy_to_device(padded_tokens),
            query_start_loc=buf.query_start_loc.copy_to_device(padded + 1),
            seq_lens=buf.seq_lens.copy_to_device(padded),
            block_tables=buf.block_tables.copy_to_device(padded, width) if graph
            else buf.block_tables.copy_to_device(padded, width)[:, :width],
            num_reqs=padded, num_decodes=padded if graph else shape.num_decodes,
            num_decode_tokens=padded if graph else shape.num_decodes,
            max_query_len=shape.max_query_len, max_seq_len=shape.max_seq_len, block_size=self.block_size,
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu,
        )
        input_ids = buf.input_ids.copy_to_device(padded_tokens)
        positions = buf.model_positions_to_device(padded_tokens)
        logits_indices = buf.logits_indices.copy_to_device(shape.num_logits)
        if self.device.type == "cuda":
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()
        return input_ids, positions, meta, logits_indices

    def _plan_prompt_logprobs(self, rows, token_req, token_rows, positions, req_ids, order) -> PromptLogprobsPlan | None:
        """Which of the step's tokens score a prompt token for a request that asked for prompt logprobs."""
        b = self.batch
        wanted = (b.num_prompt_logprobs[token_rows] >= 0) & (positions + 1 < b.num_prompt_tokens[token_rows])
        idx = np.nonzero(wanted)[0]
        if not len(idx):
            return None
        targets = b.token_ids[token_rows[idx], positions[idx] + 1]
        batch_index, first, counts = np.unique(token_req[idx], return_index=True, return_counts=True)
        requests = [(req_ids[order[i]], int(positions[idx[f]]) + 1, int(c), int(b.num_prompt_logprobs[rows[i]]))
                    for i, f, c in zip(batch_index.tolist(), first.tolist(), counts.tolist())]
        return PromptLogprobsPlan(token_indices=self._upload(idx), token_ids_host=idx, targets=self._upload(targets), target_ids=targets,
                                  num_top=max(r[3] for r in requests), requests=requests)

    def _launch_prompt_logprobs(self, hidden: torch.Tensor, plan: PromptLogprobsPlan) -> tuple:
        """Score each planned prompt token from the hidden state before it, a chunk at a time (the logits of
        a whole prompt would be [tokens, vocab]); the pieces are copied to host memory behind the step."""
        pieces = []
        for start in range(0, len(plan.targets), _PROMPT_LOGPROBS_CHUNK):
            end = start + _PROMPT_LOGPROBS_CHUNK
            logits = self.model.compute_logits(hidden[plan.token_indices[start:end]]).float()
            pieces.append(score_tokens(logits, plan.targets[start:end], plan.num_top))
            del logits
        pin = self.device.type == "cuda"
        host = []
        for parts in zip(*pieces):
            t = torch.cat(parts)
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            h.copy_(t, non_blocking=True)
            host.append(h)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return tuple(host), ready

    def follow_prompt_logprobs(self, hidden: torch.Tensor, token_indices: torch.Tensor) -> None:
        """A follower rank's part in rank 0's prompt logprobs: the same chunks of logits (gathered)."""
        for start in range(0, len(token_indices), _PROMPT_LOGPROBS_CHUNK):
            self.model.compute_logits(hidden[token_indices[start:start + _PROMPT_LOGPROBS_CHUNK]])

    @staticmethod
    def _prompt_logprobs(plan: PromptLogprobsPlan, pieces: tuple) -> dict:
        chosen, ranks, top_ids, top_vals = (t.tolist() for t in pieces)
        out, at = {}, 0
        for rid, first, count, num_top in plan.requests:
            end = at + count
            out[rid] = (first, [Logprobs(t, c, r, ids[:num_top], vals[:num_top]) for t, c, r, ids, vals in zip(
                plan.target_ids[at:end].tolist(), chosen[at:end], ranks[at:end], top_ids[at:end], top_vals[at:end])])
            at = end
        return out

    def _graph_size(self, num_reqs: int, num_decodes: int) -> int | None:
        """The captured batch size to replay for a decode-only step, or None to run eagerly."""
        if self.graphs is None or num_decodes != num_reqs:
            return None
        return self.graphs.padded_size(num_reqs)

    def _upload(self, t: torch.Tensor | np.ndarray) -> torch.Tensor:
        """A small host array on the device without waiting for the device.

        A blocking copy (``.to(device)``) would synchronize the stream, i.e. wait for the step
        in flight. From pageable memory the driver stages the bytes before the call returns,
        so the source may be dropped at once.
        """
        if isinstance(t, np.ndarray):
            t = torch.from_numpy(np.ascontiguousarray(t))
        return t.to(self.device, non_blocking=True)

    def _sampling_tensors(self, rows: np.ndarray) -> SamplingTensors:
        b = self.batch
        dev = self._upload

        temperature = b.temperature[rows]
        top_k, top_p, min_p = b.top_k[rows], b.top_p[rows], b.min_p[rows]
        vocab = self.model_config.vocab_size
        st = SamplingTensors(
            temperature=dev(temperature),
            top_k=dev(np.where(top_k > 0, top_k, vocab)) if (top_k > 0).any() else None,
            top_p=dev(top_p) if (top_p < 1.0).any() else None,
            min_p=dev(min_p) if (min_p > 0.0).any() else None,
            generators={i: b.generators[r] for i, r in enumerate(rows.tolist()) if r in b.generators},
            all_greedy=bool((temperature == 0).all()),
            max_num_logprobs=int(b.num_logprobs[rows].max()),
        )
        if b.banned_until_min:
            st.banned = self._banned_tokens(rows)
        if b.logit_bias:
            st.logit_bias = self._logit_bias(rows)
        if b.allowed:
            st.allowed = self._allowed_tokens(rows)
        pres, freq, rep = b.presence_penalty[rows], b.frequency_penalty[rows], b.repetition_penalty[rows]
        if (pres != 0).any() or (freq != 0).any() or (rep != 1).any():
            st.presence_penalty, st.frequency_penalty, st.repetition_penalty = dev(pres), dev(freq), dev(rep)
            st.output_token_counts, st.prompt_token_mask = self._token_counts(rows)
        return st

    def _logit_bias(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(batch rows, token ids, biases) of the rows that carry a logit_bias, flattened."""
        b = self.batch
        parts = [(i, *b.logit_bias[r]) for i, r in enumerate(rows.tolist()) if r in b.logit_bias]
        if not parts:
            return None
        row_idx = np.concatenate([np.full(len(ids), i, dtype=np.int64) for i, ids, _ in parts])
        ids = np.concatenate([ids for _, ids, _ in parts])
        values = np.concatenate([values for _, _, values in parts])
        return self._upload(row_idx), self._upload(ids), self._upload(values)

    def _allowed_tokens(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(batch rows that carry allowed_token_ids, and their (row, token) pairs, flattened)."""
        b = self.batch
        parts = [(i, b.allowed[r]) for i, r in enumerate(rows.tolist()) if r in b.allowed]
        if not parts:
            return None
        limited = np.array([i for i, _ in parts], dtype=np.int64)
        pair_rows = np.concatenate([np.full(len(ids), i, dtype=np.int64) for i, ids in parts])
        return self._upload(limited), self._upload(pair_rows), self._upload(np.concatenate([ids for _, ids in parts]))

    def _banned_tokens(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row, token) pairs to mask: EOS and stop tokens of rows that have not reached min_tokens."""
        b = self.batch
        pairs = [(i, t) for i, r in enumerate(rows.tolist()) if r in b.banned_until_min
                 and b.num_tokens[r] - b.num_prompt_tokens[r] < b.min_tokens[r] for t in b.banned_until_min[r]]
        if not pairs:
            return None
        idx = self._upload(torch.tensor(pairs, dtype=torch.long).T.contiguous())
        return idx[0], idx[1]

    def _token_counts(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: how often each vocab token was generated [N, V], and which are in the prompt [N, V]."""
        b, vocab = self.batch, self.model_config.vocab_size
        width = int(b.num_tokens[rows].max())
        ids = b.token_ids[rows, :width].copy()  # [N, width]
        cols = np.arange(width)[None, :]
        in_prompt = cols < b.num_prompt_tokens[rows][:, None]
        valid = cols < b.num_tokens[rows][:, None]
        out_ids = self._upload(np.where(valid & ~in_prompt, ids, vocab))
        prompt_ids = self._upload(np.where(in_prompt, ids, vocab))
        counts = torch.zeros(len(rows), vocab + 1, dtype=torch.int32, device=self.device)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.int32))
        prompt_mask = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=self.device)
        prompt_mask.scatter_(1, prompt_ids, True)
        return counts[:, :vocab], prompt_mask[:, :vocab]

    def _launch_logprobs(self, raw_logprobs: torch.Tensor, sampled: torch.Tensor, rows: np.ndarray) -> tuple:
        """Gather the logprob pieces on the device and queue their copy to host memory behind the step,
        so that ``finish`` reads them after the step's one sync, without waiting for a step planned after it."""
        num_top = self.batch.num_logprobs[rows]
        wanted = np.nonzero(num_top >= 0)[0]
        idx = self._upload(wanted)
        wanted_logprobs = raw_logprobs[idx]
        pieces = gather_logprobs(wanted_logprobs, sampled[idx], int(num_top.max()))
        explicit = None  # rows with logprob_token_ids: (padded ids, counts); their logprobs are the last piece
        named = self.batch.logprob_token_ids
        if named:
            rows_named = [named.get(r) for r in rows[wanted].tolist()]
            if any(ids is not None for ids in rows_named):
                explicit = pad_token_ids(rows_named)
                pieces = (*pieces, wanted_logprobs.gather(-1, self._upload(explicit[0])))
        pin = self.device.type == "cuda"
        host = []
        for t in pieces:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            h.copy_(t, non_blocking=True)
            host.append(h)
        return (wanted, num_top[wanted], explicit, *host)

    @staticmethod
    def _logprobs(pieces: tuple, token_ids: list[int], sampled_ids: list[str]) -> dict:
        wanted, num_top, explicit, chosen, ranks, top_ids, top_vals, *named = pieces
        entries = build_logprobs(
            [token_ids[i] for i in wanted], chosen.tolist(), ranks.tolist(), top_ids.tolist(), top_vals.tolist(),
            num_top.tolist(), None if explicit is None else (*explicit, named[0].tolist()),
        )
        return {sampled_ids[i]: e for i, e in zip(wanted.tolist(), entries)}
