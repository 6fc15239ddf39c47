"""Steps over dummy tokens, for start-up: every token's slot is in the null block, so they write nothing that is
read. They compile the kernels' variants for every step size before the first request (rather than stall a step),
and measure the peak memory of the largest step, which sizes the KV pool.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from engine.attention.metadata import AttentionMetadata
from engine.config import EngineConfig
from engine.ops.greedy import argmax_rows
from engine.worker.sampler import Sampler
from engine.worker.sampling_tensors import SamplingTensors

logger = logging.getLogger("minivllm")

# Prompts in the profiling pass are cut into requests of at most this many tokens.
_PROFILE_REQUEST_LEN = 512


def warm_up_token_counts(limit: int) -> list[int]:
    """Step sizes (tokens) that together compile every variant a step of up to ``limit`` tokens can pick: each
    power of two and the count just past it, and the largest counts of both kinds: for every step size and any one
    switch by token count (``n >= threshold``), a count on the same side of it that Triton specializes alike
    (1, a multiple of 16, or neither)."""
    counts = {n for k in range(limit.bit_length()) for n in (1 << k, (1 << k) + 1) if n <= limit}
    return sorted(counts | {n for n in (limit, limit - 1, limit - limit % 16) if n >= 1})


class DummySteps:
    """Forward passes of prompts of dummy tokens over the model as loaded, on its device."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, max_model_len: int, device: torch.device,
                 dtype: torch.dtype):
        self.model = model
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.kvcache_block_size
        # The largest step the scheduler can plan.
        self.max_step_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len)
        # The requests' length: _PROFILE_REQUEST_LEN, or max_model_len where shorter. A position past max_model_len
        # may lie past the rope's table (max_position_embeddings rows): the Triton rope would read garbage, whose
        # K/V lands in the null block, which attention over padded block tables reads (masked out, but NaN * 0 is
        # NaN).
        self.request_len = min(_PROFILE_REQUEST_LEN, max_model_len)

    def forward(self, num_tokens: int) -> torch.Tensor:
        """The model over ``num_tokens`` prompt tokens in requests of up to ``request_len`` tokens; returns the
        hidden states."""
        lens = [self.request_len] * (num_tokens // self.request_len)
        if num_tokens % self.request_len:
            lens.append(num_tokens % self.request_len)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        return self.model(input_ids, positions, self._metadata(lens))

    def warm_up_step_sizes(self) -> None:
        """Run the model once at every kind of token count a step can bring, so that the layers' Triton kernels
        compile now rather than stall a step.

        Triton compiles an integer argument apart when it is 1 or a multiple of 16, and layers pick variants by
        the step's token count (the FP8 SwiGLU's rows a program from ``_SWIGLU_ROWS_FROM``, the FP8 products'
        deferred column scales from ``BLOCK_SCALES_MIN_ROWS``): ``warm_up_token_counts`` meets every one of them.
        """
        counts = warm_up_token_counts(self.max_step_tokens)
        start = time.perf_counter()
        with torch.inference_mode():
            for n in tqdm(counts, desc="warming up step sizes", unit="step", leave=False):
                self.forward(n)
        torch.cuda.synchronize(self.device)
        logger.info("model kernels: %d step sizes (1 to %d tokens) run in %.1f s", len(counts), self.max_step_tokens,
                    time.perf_counter() - start)

    @torch.inference_mode()
    def profile_run(self, sampler: Sampler) -> None:
        """A forward pass over the largest step's tokens and sampling of ``max_num_seqs`` rows (and the largest
        encoder batch, for a model that takes images)."""
        hidden = self.forward(self.max_step_tokens)
        num_rows = min(self.config.max_num_seqs, self.max_step_tokens)
        logits = self.model.compute_logits(hidden[:num_rows])
        st = SamplingTensors(
            temperature=torch.ones(num_rows, device=self.device),
            top_k=torch.full((num_rows,), 50, device=self.device),
            top_p=torch.full((num_rows,), 0.9, device=self.device),
            min_p=None,
        )
        sampler(logits, st)  # its greedy tokens of float32 logits included
        argmax_rows(logits)  # and of the model's dtype, as greedy-only steps take them
        if getattr(self.model, "accepts_images", False):  # the largest encoder batch a step may run
            self.model.encode_images(*self.model.dummy_images(self.config.max_num_batched_tokens, self.dtype,
                                                              self.device))

    def _metadata(self, lens: list[int]) -> AttentionMetadata:
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


def warm_up_experts(model: torch.nn.Module, top_k: int, max_num_tokens: int) -> None:
    """The fused-MoE kernels' variants for every step size (one layer's experts stand for all: same shapes)."""
    from engine.models.moe import FusedExperts

    experts = next((m for m in model.modules() if isinstance(m, FusedExperts)), None)
    if experts is None or not experts.uses_triton(experts.w13):
        return
    from engine.ops import moe as moe_kernels

    start = time.perf_counter()
    with torch.inference_mode():
        n = moe_kernels.warm_up(experts.w13, experts.w2, top_k, max(max_num_tokens, 1))
    logger.info("fused-MoE kernels: %d variants ready in %.1f s", n, time.perf_counter() - start)
