"""Turns a scheduler plan into one forward pass and one sampled token per finished sequence.

The runner never sees a ``Request``: it keeps its own per-request rows (``InputBatch``),
updated from the scheduler's ``SchedulerOutput``, and builds the flat step inputs from
them with vector operations (``StepInputPreparer``). The model sees only tensors and the
step's attention metadata. The one host sync of a step is reading the sampled tokens back::

    launch(sched)         rows updated -> inputs prepared (graph chosen) -> forward queued -> sampling queued
    launch_sampling(h)    (a step that waited for grammar masks) sampling queued
    finish(h)             one sync -> ModelRunnerOutput (tokens, logprobs, prompt logprobs, timing)

A model that takes images gets them at prefill only: the step first encodes the images the
scheduler names into the encoder cache (embeddings by content hash, ``ImageEncoder``), then the tokens of the
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

import contextlib
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import make_attention_backend
from engine.config import ConfigError, EngineConfig
from engine.distributed import (
    broadcast_from_rank0,
    kv_head_range,
    min_over_ranks,
    tp_rank,
    tp_size,
)
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from engine.lora.worker import LoRAWorker
from engine.models.linear import (
    DECODE_KSPLIT_MAX_ROWS,
    LinearBase,
    decode_k_split_setting,
    decode_k_split_summary,
)
from engine.ops.greedy import argmax_in_graphs
from engine.outputs import ModelRunnerOutput, RunnerTiming, SchedulerOutput
from engine.worker.cpu_compile import compile_cpu_decode
from engine.worker.cuda_graphs import DecodeGraphs, MixedGraphs
from engine.worker.draft_model import DraftModel
from engine.worker.dummy_steps import DummySteps, warm_up_experts
from engine.worker.eagle3 import Eagle3Drafter, reads_target_states
from engine.worker.image_encoder import ImageEncoder
from engine.worker.input_batch import InputBatch
from engine.worker.kv_offload import KVOffloader
from engine.worker.kv_report import log_sliding_windows
from engine.worker.logprobs import LogprobsCopy, copy_logprobs
from engine.worker.pooling import pooled_rows
from engine.worker.prompt_logprobs import PromptLogprobsCopy, launch_prompt_logprobs
from engine.worker.sampler import Sampler, logits_or_greedy_tokens, takes_greedy_tokens
from engine.worker.sampling_tensors import SamplingTensors, build_sampling_tensors
from engine.worker.speculation import record_accepted, verify_step
from engine.worker.step_buffers import StepBuffers, upload
from engine.worker.step_channel import BlockCopies, StepChannel
from engine.worker.step_inputs import StepInputPreparer, StepInputs
from kvcache.paged_cache import PagedKVCache

logger = logging.getLogger("minivllm")


@dataclass(slots=True)
class PendingSampling:
    """A step whose forward pass is queued and whose sampling waits for ``launch_sampling`` (grammar masks)."""

    logits: torch.Tensor  # [num_sampled, vocab] of the sampled rows
    tensors: SamplingTensors
    greedy: torch.Tensor | None  # [num_sampled] each row's argmax of the logits, where a decode graph took it


@dataclass(slots=True)
class StepHandle:
    """A launched step: its inputs and where its results will be."""

    inputs: StepInputs | None = None  # None: an empty step (nothing scheduled)
    sampled: torch.Tensor | None = None  # [num_sampled] on the device
    sampled_host: torch.Tensor | None = None  # pinned host copy, valid once ``ready`` has passed
    logprobs: LogprobsCopy | None = None  # of the sampled rows that asked for them
    prompt_logprobs: PromptLogprobsCopy | None = None
    ready: torch.cuda.Event | None = None
    # Timing events when steps are measured: (start, end) on CUDA, () on the CPU; None when not measured.
    events: tuple | None = None
    launched: float = 0.0  # time.perf_counter() when its last launch returned
    pending: PendingSampling | None = None
    verified: tuple[torch.Tensor, torch.Tensor] | None = None  # a speculative step's (tokens, accepted counts)
    pooled: dict[int, torch.Tensor] | None = None  # pooling rows' outputs, by index among the sampled rows

    @property
    def awaits_sampling(self) -> bool:
        """Its forward pass is queued but its sampling is not: ``ModelRunner.launch_sampling`` queues it."""
        return self.pending is not None

    @property
    def sampled_request_ids(self) -> list[str]:
        """The requests its sampling gives a token, in order."""
        return self.inputs.sampled_request_ids if self.inputs is not None else []


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
                                config.resolve_quantization(model_config.model_path, model_config.quantization_config))
        self.backend = make_attention_backend(config.resolve_attention_backend(self.device))
        for layer in self.model.attention_layers():
            layer.set_backend(self.backend)
        args = (self.dtype, self.kv_dtype, self.device, self.block_size, self.backend)
        self.drafter = (DraftModel.from_config(config, model_config, *args)  # a draft model's proposals, or
                        or Eagle3Drafter.from_config(config, self.model, *args))  # an EAGLE-3 head's
        k_split = decode_k_split_summary(self.model)
        if k_split:
            logger.info("products of steps of up to %d tokens cut along K (MINIVLLM_DECODE_KSPLIT=%s): %s",
                        DECODE_KSPLIT_MAX_ROWS, decode_k_split_setting(), k_split)
        self.sampler = Sampler()
        self.kv_cache: PagedKVCache | None = None
        self.offloader: KVOffloader | None = None  # the host tier (engine/worker/kv_offload.py), if on
        max_blocks = -(-max_model_len // self.block_size)
        self.batch = InputBatch(config.max_num_seqs, max_model_len, max_blocks, model_config.vocab_size, self.device)
        max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.buffers = StepBuffers(max_tokens, config.max_num_seqs, max_blocks, self.device,
                                   mrope=model_config.mrope_section is not None)
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        # Encoded images, by content hash: [image tokens, hidden] each (the scheduler decides what stays).
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.lora = LoRAWorker(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, max_tokens,
                               self.dtype, self.device) if config.enable_lora else None
        self.input_preparer = StepInputPreparer(self.batch, self.buffers, self.block_size, self.device,
                                                self.encoder_cache, self.lora)
        self.images = ImageEncoder(self.model, self.dtype, self.device, self.encoder_cache)
        self.dummy_steps = DummySteps(self.model, config, max_model_len, self.device, self.dtype)
        pin = self.device.type == "cuda"
        self._sampled_host = [torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._sampled_turn = 0
        # Rank 0 of several: the channel its steps go out on to the other ranks (engine/worker/ranks.py).
        self.followers = StepChannel() if tp_size() > 1 and tp_rank() == 0 else None
        self.measure_steps = False  # time each step (host and device; ModelRunnerOutput.timing), for benchmarks
        # Forward passes launched, by how they ran (the engine's metrics report them).
        self.num_steps_by_kind = {"decode_graph": 0, "mixed_graph": 0, "eager": 0}
        logger.info("model runner: %s on %s, %s attention backend", self.dtype, self.device, self.backend.name)

    # ---------------------------------------------------------------- KV cache

    def bytes_per_block(self) -> int:
        """A block's bytes across the target's layers (and a draft model's, whose cache has as many blocks)."""
        mc = self.model_config
        return PagedKVCache.bytes_per_block(mc.num_hidden_layers, self.block_size, self.num_kv_heads,
                                            mc.head_dim, self.kv_dtype) + (self.drafter.bytes_per_block()
                                                                           if self.drafter is not None else 0)

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
        if self.drafter is not None:  # the target's share of the budget: the draft's blocks take the rest
            budget = budget * (self.bytes_per_block() - self.drafter.bytes_per_block()) // self.bytes_per_block()
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
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks)
        if self.config.kv_offloading_size_gib > 0:
            self.offloader = KVOffloader.of_size(self.kv_cache, self.config.kv_offloading_size_gib)
        logger.info("KV cache%s: %s", f" of rank {tp_rank()} (its share of the heads)" if tp_size() > 1 else "",
                    self.kv_cache.describe())
        if self.kv_dtype != self.dtype:
            dense = PagedKVCache.bytes_per_block(mc.num_hidden_layers, self.block_size, self.num_kv_heads,
                                                 mc.head_dim, self.dtype)
            logger.info("KV cache in float8_e4m3: %.2fx the tokens a %s cache would hold in the same memory",
                        dense / self.bytes_per_block(), str(self.dtype).removeprefix("torch."))
        log_sliding_windows(mc, self.max_model_len)

    @property
    def num_host_blocks(self) -> int:
        return self.offloader.num_host_blocks if self.offloader is not None else 0

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
        if self.model_config.moe is not None:
            warm_up_experts(self.model, self.model_config.moe.top_k, self.config.max_num_batched_tokens)
        if self.device.type == "cuda":
            with self._all_lora_products():  # their kernels compile before the first request too
                self.dummy_steps.warm_up_step_sizes()
        compile_cpu_decode(self.model, self.config, self.backend, self.dtype)  # --compile (CPU)

    def capture_cuda_graphs(self) -> None:
        """Capture mixed-step and decode graphs (CUDA with a graph-safe backend, unless ``enforce_eager``), into one
        memory pool: a step replays one graph at a time."""
        if self.device.type != "cuda" or self.config.enforce_eager or self.backend.name != "triton" or \
                self.config.runner == "pooling" or reads_target_states(self.config):
            logger.info("CUDA graphs off: every step runs eagerly")
            return
        if not getattr(self.model, "supports_cuda_graphs", True):
            logger.info("CUDA graphs off: %s's experts run eagerly (the torch reference)", self.model_config.architecture)
            return
        greedy = argmax_in_graphs() and tp_rank() == 0
        with self._all_lora_products():
            self._capture_graphs(greedy)

    def _capture_graphs(self, greedy: bool) -> None:
        pool = torch.cuda.graph_pool_handle()
        token_sizes = self.config.graph_token_sizes()
        if token_sizes:  # the larger graphs first, so that the decode graphs reuse their memory
            self.mixed_graphs = MixedGraphs(self.model, self.buffers, token_sizes, self.config.max_num_seqs,
                                            self.block_size, self.max_model_len)
            self.mixed_graphs.capture(pool)
        self.graphs = DecodeGraphs(self.model, self.buffers, self.config.graph_batch_sizes(), self.block_size,
                                   self.max_model_len, greedy=greedy)
        self.graphs.capture(pool)

    def _all_lora_products(self):
        """Warm-up, profiling and capture run the LoRA products whatever the step maps (``LoRAWorker.capturing``)."""
        return self.lora.capturing() if self.lora is not None else contextlib.nullcontext()

    def _profile_cuda_budget(self) -> int:
        """Run the largest step with a scratch cache; return the bytes left for the KV pool."""
        scratch_blocks = -(-self.dummy_steps.request_len // self.block_size) + 1
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

    def profile_run(self) -> None:
        """The largest step the engine can schedule, and sampling of ``max_num_seqs`` rows, over dummy tokens
        whose every slot is in the null block: it writes nothing that matters."""
        with self._all_lora_products():
            self.dummy_steps.profile_run(self.sampler)

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
        self.copy_blocks(BlockCopies(sched.block_copies, sched.kv_loads, sched.kv_saves))
        if sched.encoder_inputs:
            self.images.encode(sched.encoder_inputs)
        if sched.is_empty:
            self.images.free(sched.freed_encoder_hashes)
            return StepHandle()
        inputs = self._prepare_inputs(sched)
        if len(inputs.placeholder_tokens):
            self._feed_in_flight_tokens(inputs, in_flight)
        if self.followers is not None:
            broadcast_from_rank0(inputs.input_ids)  # with the tokens of the step in flight
        # Built before the forward pass is queued, so their small host-to-device copies never wait behind it.
        st = (build_sampling_tensors(self.batch, inputs.sampled_rows, self.device, positions=inputs.sampled_positions)
              if len(inputs.sampled_rows) else None)
        handle = StepHandle(inputs=inputs, events=self._start_timing())
        logits, greedy = self._forward(inputs, handle, sample and st is not None and takes_greedy_tokens(st))
        if sched.freed_encoder_hashes:  # after the forward pass that read them is queued
            self.images.free(sched.freed_encoder_hashes)
        handle.launched = time.perf_counter()
        if st is None:
            if handle.events:
                handle.events[1].record()
            return handle
        handle.pending = PendingSampling(logits, st, greedy)
        if sample:
            self.launch_sampling(handle)
        return handle

    def _forward(self, inputs: StepInputs, handle: StepHandle,
                 greedy_only: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Queue the step's forward pass (a captured graph's replay where the step has one) and its prompt logprobs.
        Returns the logits of the sampled rows (None when none is sampled, or where ``greedy_only`` lets an eager
        step give only greedy tokens) and, where a decode graph took them, their greedy tokens."""
        shape, n = inputs.shape, inputs.shape.num_sampled
        if shape.graph_size:
            self.num_steps_by_kind["decode_graph"] += 1
            logits, greedy = self.graphs.replay(shape.graph_size)
            if inputs.samples_leading_rows:  # every row of a decode step is sampled, in order: a view, not a gather
                return logits[:n], None if greedy is None else greedy[:n]
            return logits[inputs.logits_indices], None if greedy is None else greedy[inputs.logits_indices]
        if shape.mixed_size:
            # The graph's rows: the sampled tokens' hidden states first, then padding; the LM head takes the
            # sampled ones (other tensor-parallel ranks too: StepShape.num_sampled).
            self.num_steps_by_kind["mixed_graph"] += 1
            rows = self.mixed_graphs.run(shape.mixed_size)
            return (self.model.compute_logits(rows[:n]) if n else None), None
        self.num_steps_by_kind["eager"] += 1
        if inputs.image_embeds is not None:
            embeds = self.model.embed_input_ids(inputs.input_ids, *inputs.image_embeds)
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, inputs_embeds=embeds)
        elif self.drafter is not None and self.drafter.aux_layers:  # an EAGLE-3 head keeps the step's states
            hidden = self.drafter.run_target(self.model, inputs, self.batch)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if inputs.prompt_logprobs is not None:
            handle.prompt_logprobs = launch_prompt_logprobs(self.model, hidden, inputs.prompt_logprobs)
        greedy_only = greedy_only and inputs.spec_counts is None  # (a speculative step verifies its logits)
        handle.pooled = pooled_rows(self.batch, inputs.sampled_rows, hidden[inputs.logits_indices],
                                    self.model) if n else None
        return logits_or_greedy_tokens(self.model, hidden[inputs.logits_indices], greedy_only) if n else (None, None)

    @torch.inference_mode()
    def launch_sampling(self, handle: StepHandle, masks: tuple[torch.Tensor, list[int]] | None = None) -> None:
        """Queue the sampling of a step whose forward pass is queued. ``masks``: a [sampled rows, vocab/32]
        int32 bitmask (host memory) of the tokens each constrained row's grammar allows, and those rows;
        None for no constraint."""
        pending, handle.pending = handle.pending, None
        st = pending.tensors
        if masks is not None:
            bitmask = upload(masks[0], self.device)
            words = -(-pending.logits.shape[-1] // 32)
            if bitmask.shape[1] < words:  # the grammars' vocabulary is the tokenizer's: the padding ids stay out
                bitmask = torch.nn.functional.pad(bitmask, (0, words - bitmask.shape[1]))
            st.bitmask, st.bitmask_rows = bitmask, masks[1]
        sampled, raw_logprobs = (verify_step(handle, pending.logits, st, self.batch) if handle.inputs.spec_counts
                                 is not None else self.sampler(pending.logits, st, pending.greedy))
        # Two pinned buffers in turn: with a step planned ahead, this copy may land while the
        # host still reads the previous step's tokens.
        self._sampled_turn ^= 1
        inputs = handle.inputs
        sampled_host = self._sampled_host[self._sampled_turn][: len(inputs.sampled_rows)]
        sampled_host.copy_(sampled, non_blocking=True)
        handle.sampled, handle.sampled_host = sampled, sampled_host
        if raw_logprobs is not None:
            handle.logprobs = copy_logprobs(raw_logprobs, sampled, inputs.sampled_rows, self.batch, self.device)
        if handle.events:
            handle.events[1].record()
        if self.device.type == "cuda":
            handle.ready = torch.cuda.Event()
            handle.ready.record()
        handle.launched = time.perf_counter()

    @torch.inference_mode()
    def finish(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step; record its tokens and return them (with its timing, when measured)."""
        inputs = handle.inputs
        if inputs is None:
            return ModelRunnerOutput([], [])
        if handle.pending is not None:
            raise RuntimeError("finish() on a step whose sampling was never launched (launch_sampling)")
        if handle.ready is not None:
            handle.ready.synchronize()  # the step's one host sync
        timing = (RunnerTiming.measured(handle.launched, handle.events, inputs.shape) if handle.events is not None
                  else None)
        prompt_logprobs = handle.prompt_logprobs.collect() if handle.prompt_logprobs is not None else {}
        if handle.sampled is None:
            return ModelRunnerOutput([], [], prompt_logprobs=prompt_logprobs, timing=timing)
        token_ids = handle.sampled_host.tolist()
        # Rows by request id: a request dropped since this step was launched (finished,
        # preempted) has no row any more, and its row may already belong to another request.
        sampled_ids = inputs.sampled_request_ids
        rows = [self.batch.row_of.get(rid, -1) for rid in sampled_ids]
        live = [i for i, row in enumerate(rows) if row >= 0]
        accepted = record_accepted(self.batch, handle.verified, rows, live) if handle.verified is not None else []
        self.batch.append_sampled(np.asarray([rows[i] for i in live], dtype=np.int64),
                                  np.asarray([token_ids[i] for i in live], dtype=np.int64))
        output = ModelRunnerOutput(sampled_ids, token_ids, prompt_logprobs=prompt_logprobs, timing=timing,
                                   accepted_token_ids={rid: a for rid, a in zip(sampled_ids, accepted) if a},
                                   pooled={sampled_ids[i]: v.tolist() for i, v in (handle.pooled or {}).items()})
        if handle.logprobs is not None:
            output.logprobs = handle.logprobs.entries(token_ids, sampled_ids, accepted)
        return output

    def copy_blocks(self, copies: BlockCopies) -> None:
        """A step's block copies, before anything it runs writes to the blocks: the host tier's (saved blocks read
        before loaded ones are written), then forked beams' partial blocks (whose destinations may have just been
        saved)."""
        if copies.loads or copies.saves:
            self.offloader.run(copies.loads, copies.saves)
        if copies.forks:
            self.kv_cache.copy_blocks(copies.forks)

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.freed_request_ids:
            self.batch.remove(rid)
        for data in sched.new_requests:
            self.batch.add(data, self.eos_token_ids)
        for data in sched.cached_requests:
            self.batch.update(data)
        self.batch.set_proposals(sched.spec_token_ids)
        if self.drafter is not None:  # requests that left or (re)joined start over; proposals over the placeholders
            self.drafter.forget([*sched.freed_request_ids, *(data.request_id for data in sched.new_requests)])
            self.drafter.draft(self.batch, sched.spec_token_ids)

    def _prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """The step's inputs, in the host buffers (sent to the other ranks, if any) and then on the device."""
        inputs = self.input_preparer.prepare(sched, self.graphs, self.mixed_graphs)
        if self.followers is not None:  # the other tensor-parallel ranks run the same step
            plan = inputs.prompt_logprobs
            self.followers.send(inputs.shape, self.buffers, plan.token_indices_host if plan is not None else None,
                                BlockCopies(sched.block_copies, sched.kv_loads, sched.kv_saves), self.lora)
        inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices = \
            self.input_preparer.device_inputs(inputs.shape)
        return inputs

    def _feed_in_flight_tokens(self, inputs: StepInputs, in_flight: StepHandle | None) -> None:
        """Write the tokens the in-flight step is sampling into this step's input ids, on the device."""
        if in_flight is None or in_flight.sampled is None:
            raise RuntimeError("a step needs tokens of a step in flight, but none was given")
        index_of = {rid: i for i, rid in enumerate(in_flight.inputs.sampled_request_ids)}
        src = torch.tensor([index_of[rid] for rid in inputs.placeholder_request_ids], dtype=torch.long)
        dst = torch.from_numpy(inputs.placeholder_tokens)
        inputs.input_ids[upload(dst, self.device)] = in_flight.sampled[upload(src, self.device)]

    def _start_timing(self) -> tuple | None:
        if not self.measure_steps:
            return None
        if self.device.type != "cuda":
            return ()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end
