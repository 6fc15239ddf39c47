"""CUDA graphs for decode steps, one per bucketed batch size.

A decode-only step of ``n`` requests is padded to the next captured size and replayed:
the whole forward pass and the logits are one graph launch instead of hundreds of kernel
launches from Python. Padding rows have sequence length 0 (attention writes zeros for
them) and write their K/V into the null block, so they change nothing that is read.
Mixed and prefill steps run eagerly. An M-RoPE model's graphs read its [3, size] positions
(``StepBuffers.model_positions``), filled before each replay like every other input.

With ``greedy`` (``MINIVLLM_GREEDY_ARGMAX=graph``, the default) each graph also takes every row's argmax of its logits
(``engine.greedy``'s kernels), which the sampler uses wherever nothing changes the logits first: half torch.argmax's
device time, and no launches of its own.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from tqdm.auto import tqdm

from engine.attention.metadata import AttentionMetadata
from engine.greedy import greedy_tokens, takes
from engine.step_buffers import StepBuffers

logger = logging.getLogger("minivllm")


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, buffers: StepBuffers, batch_sizes: list[int], block_size: int,
                 max_seq_len: int, greedy: bool = False):
        self.model = model
        self.buffers = buffers
        self.batch_sizes = sorted(batch_sizes)
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # [size, vocab] in the model dtype, written by each replay
        self.greedy = greedy
        self._greedy: dict[int, torch.Tensor] = {}  # [size] int64: each row's argmax of those logits

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a decode batch of ``num_reqs`` runs at, or None if it is too large."""
        i = bisect.bisect_left(self.batch_sizes, num_reqs)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def metadata(self, size: int) -> AttentionMetadata:
        """Decode metadata over the static device buffers (host copies are unused by graph-safe backends)."""
        b = self.buffers
        return AttentionMetadata(
            slot_mapping=b.slot_mapping.device[:size],
            query_start_loc=b.query_start_loc.device[: size + 1],
            seq_lens=b.seq_lens.device[:size],
            block_tables=b.block_tables.device[:size],
            num_reqs=size, num_decodes=size, num_decode_tokens=size, max_query_len=1,
            max_seq_len=self.max_seq_len, block_size=self.block_size,
            query_start_loc_cpu=b.query_start_loc.host[: size + 1], seq_lens_cpu=b.seq_lens.host[:size],
        )

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        b = self.buffers
        hidden = self.model(b.input_ids.device[:size], b.model_positions(size), self.metadata(size))
        logits = self.model.compute_logits(hidden)
        return logits, (greedy_tokens(logits) if self.greedy and takes(logits) else None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so later graphs reuse the first one's memory pool."""
        start = time.perf_counter()
        b = self.buffers
        b.query_start_loc.np[:] = range(len(b.query_start_loc.np))
        b.query_start_loc.copy_to_device(len(b.query_start_loc.np))
        pool = torch.cuda.graph_pool_handle()
        for size in tqdm(sorted(self.batch_sizes, reverse=True), desc="capturing CUDA graphs", unit="graph"):
            for _ in range(2):  # compile and warm up outside the capture
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size], tokens = self._forward(size)
            if tokens is not None:
                self._greedy[size] = tokens
            self._graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s%s) in %.1f s", len(self._graphs),
                    self.batch_sizes, ", greedy tokens taken inside" if self.greedy else "",
                    time.perf_counter() - start)

    def replay(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the captured step; the inputs must already be in the static buffers. Returns the [size, vocab] logits
        and, with ``greedy``, each row's argmax of them ([size] int64; else None)."""
        self._graphs[size].replay()
        return self._logits[size], self._greedy.get(size)
