"""CUDA graphs for the steps of a running engine: decode steps, one graph per bucketed batch size, and mixed steps
(decodes with prefill chunks), one per bucketed token count.

A decode-only step of ``n`` requests is padded to the next captured size and replayed:
the whole forward pass and the logits are one graph launch instead of hundreds of kernel
launches from Python. Padding rows have sequence length 0 (attention writes zeros for
them) and write their K/V into the null block, so they change nothing that is read.
An M-RoPE model's graphs read its [3, size] positions
(``StepBuffers.model_positions``), filled before each replay like every other input.

A mixed step of ``t`` tokens is padded to the next captured token count ``size`` and its requests to
``min(size, max_num_seqs)`` rows (``MixedGraphs``). Which rows are decodes is not known when the graph is
captured, so attention runs both kernels over every row, each told on the device which rows are its own
(``AttentionMetadata.decode_seq_lens``). Eagerly such a step costs the host several milliseconds of launches
(a small model's decode step takes less on the device); replayed, its tokens wait no longer than a decode
step's. Steps with images or prompt logprobs, and steps past the largest size, run eagerly. These graphs end at
the hidden states of the tokens to sample; the LM head runs after the replay, so that no graph keeps logits.

With ``greedy`` (``MINIVLLM_GREEDY_ARGMAX=graph``, the default) each decode graph also takes every row's argmax of
its logits (``engine.ops.greedy``'s kernels), which the sampler uses wherever nothing changes the logits first: half
torch.argmax's device time, and no launches of its own.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from tqdm.auto import tqdm

from engine.attention.metadata import AttentionMetadata
from engine.ops.greedy import greedy_tokens, takes
from engine.worker.step_buffers import StepBuffers

logger = logging.getLogger("minivllm")


class _StepGraphs:
    """One captured graph per size, over the static step buffers: what the two kinds share."""

    kind = ""

    def __init__(self, model: torch.nn.Module, buffers: StepBuffers, sizes: list[int], block_size: int,
                 max_seq_len: int, greedy: bool = False):
        self.model = model
        self.buffers = buffers
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # what each replay writes (``_forward``'s first result)
        self.greedy = greedy
        self._greedy: dict[int, torch.Tensor] = {}  # [rows] int64: each row's argmax of those logits
        self.replays = 0

    def padded_size(self, count: int) -> int | None:
        """The captured size a step of ``count`` (decode rows, or a mixed step's tokens) runs at; None past the
        largest. A mixed step's requests always fit its size's rows: it has no more requests than tokens, nor
        than ``max_num_reqs``."""
        i = bisect.bisect_left(self.sizes, count)
        return self.sizes[i] if i < len(self.sizes) else None

    def metadata(self, size: int) -> AttentionMetadata:
        raise NotImplementedError

    def _prepare_buffers(self) -> None:
        """Give the static buffers contents every size can run on while it is warmed up and captured."""
        raise NotImplementedError

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step as captured: (its output, each row's greedy token or None)."""
        raise NotImplementedError

    def _hidden(self, size: int) -> torch.Tensor:
        b = self.buffers
        return self.model(b.input_ids.device[:size], b.model_positions(size), self.metadata(size))

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every size, largest first so later graphs reuse the first one's memory (``pool``: a graph pool
        to share with other graphs, captured after these if smaller)."""
        start = time.perf_counter()
        self._prepare_buffers()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for size in tqdm(sorted(self.sizes, reverse=True), desc=f"capturing {self.kind} CUDA graphs", unit="graph"):
            for _ in range(2):  # compile and warm up outside the capture
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size], tokens = self._forward(size)
            if tokens is not None:
                self._greedy[size] = tokens
            self._graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d %s CUDA graphs (%s %s%s) in %.1f s", len(self._graphs), self.kind, self._unit,
                    self.sizes, ", greedy tokens taken inside" if self.greedy else "", time.perf_counter() - start)

    _unit = "sizes"

    def replay(self, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the captured step; the inputs must already be in the static buffers. Returns its output and, with
        ``greedy``, each row's argmax of the logits (int64; else None)."""
        self.replays += 1
        self._graphs[size].replay()
        return self._outputs[size], self._greedy.get(size)


class DecodeGraphs(_StepGraphs):
    """Decode-only steps: ``size`` requests of one token each; logits for every row."""

    kind = "decode"
    _unit = "batch sizes"

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
        """Every row's logits ([size, vocab] in the model dtype), and with ``greedy`` their argmax."""
        logits = self.model.compute_logits(self._hidden(size))
        return logits, (greedy_tokens(logits) if self.greedy and takes(logits) else None)

    def _prepare_buffers(self) -> None:
        b = self.buffers
        b.query_start_loc.np[:] = range(len(b.query_start_loc.np))
        b.query_start_loc.copy_to_device(len(b.query_start_loc.np))


class MixedGraphs(_StepGraphs):
    """Steps of up to ``size`` tokens of any kind, in ``rows(size)`` requests (padding ones have no tokens). A replay
    gives the hidden states of the tokens ``logits_indices`` names ([rows, hidden]: the sampled ones first, in order;
    padding entries name token 0), and the caller computes the logits: kept by each of dozens of graphs, [rows,
    vocab] outputs would hold a GiB or more of GPU memory, where these hold a few MB."""

    kind = "mixed-step"
    _unit = "token counts"

    def __init__(self, model: torch.nn.Module, buffers: StepBuffers, token_sizes: list[int], max_num_reqs: int,
                 block_size: int, max_seq_len: int):
        super().__init__(model, buffers, token_sizes, block_size, max_seq_len)
        self.max_num_reqs = max_num_reqs

    def rows(self, size: int) -> int:
        """Requests a graph of ``size`` tokens takes: as many as a step of that many tokens can have."""
        return min(size, self.max_num_reqs)

    def metadata(self, size: int) -> AttentionMetadata:
        b, rows = self.buffers, self.rows(size)
        return AttentionMetadata(
            slot_mapping=b.slot_mapping.device[:size],
            query_start_loc=b.query_start_loc.device[: rows + 1],
            seq_lens=b.seq_lens.device[:rows],
            block_tables=b.block_tables.device[:rows],
            # The prefill kernel's tiles follow max_query_len: the largest a step of this size may need.
            num_reqs=rows, num_decodes=0, num_decode_tokens=0, max_query_len=size,
            max_seq_len=self.max_seq_len, block_size=self.block_size,
            query_start_loc_cpu=b.query_start_loc.host[: rows + 1], seq_lens_cpu=b.seq_lens.host[:rows],
            decode_seq_lens=b.decode_seq_lens.device[:rows],
        )

    def _forward(self, size: int) -> tuple[torch.Tensor, None]:
        return self._hidden(size)[self.buffers.logits_indices.device[: self.rows(size)]], None

    def _prepare_buffers(self) -> None:
        # No tokens in any request, every slot in the null block: the warm-up runs write nothing that is read.
        b = self.buffers
        for buf in (b.input_ids, b.positions, b.slot_mapping, b.seq_lens, b.query_start_loc, b.decode_seq_lens,
                    b.logits_indices) + ((b.mrope_positions,) if b.mrope_positions is not None else ()):
            buf.np[...] = 0
            buf.device.zero_()

    def run(self, size: int) -> torch.Tensor:
        """Replay the graph of ``size`` and return its hidden rows; where none was captured (the CPU), run the same
        forward pass on the same buffers eagerly."""
        if size in self._graphs:
            return self.replay(size)[0]
        self.replays += 1
        with torch.inference_mode():
            return self._forward(size)[0]
