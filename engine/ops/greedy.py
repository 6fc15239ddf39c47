"""The greedy token of each row of a logits matrix, as ``torch.argmax(logits, dim=-1)`` gives it, in two Triton passes.

A decode step of greedy rows ends with the argmax of a [rows, vocab] logits matrix (151,936 columns on Qwen3). torch's
reduction reads it at about a third of the copy bandwidth (bench/RESULTS.md). Here the first pass cuts each row into
chunks of ``BLOCK`` columns, one program a chunk, each writing its largest value and that value's first column; the
second pass takes, per row, the first chunk holding the row's largest value. Ties go to the lowest column, as in
torch. NaN counts as larger than any number, as in torch; a row holding both +inf and NaN, where torch returns the
first NaN, gives the first of either here.

Where they run (``MINIVLLM_GREEDY_ARGMAX``; decode graphs read it when they are captured, the sampler at each call):
``graph`` (the default) inside the decode CUDA graphs, whose replays then hand the sampler each row's argmax along
with the logits, with torch.argmax for eager steps; ``kernel`` in the graphs and in eager CUDA steps; ``torch``
nowhere, torch.argmax after the graph and in eager steps. The kernels take half torch's device time, but their two
launches cost several times torch's host time: inside a graph that cost is gone, outside one it is paid on every step
(bench/RESULTS.md, 2026-12-06).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import settings
from engine.ops.intmath import cdiv, next_power_of_2
from engine.ops.triton_helpers import interpreted

BLOCK = 4096  # columns a first-pass program reads: 8 KB of bfloat16
NUM_WARPS = 4


@triton.jit
def _chunk_max_kernel(x_ptr, stride_row, vocab, val_ptr, col_ptr, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(col_ptr + row * num_chunks + chunk, chunk * BLOCK + at)


@triton.jit
def _row_max_kernel(val_ptr, col_ptr, out_ptr, num_chunks, CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    vals = tl.load(val_ptr + row * num_chunks + chunks, mask=chunks < num_chunks, other=float("-inf"))
    _, first = tl.max(vals, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(col_ptr + row * num_chunks + first).to(tl.int64))


def takes(logits: torch.Tensor) -> bool:
    """Whether the kernels take ``logits``: 2-D, not empty, rows contiguous, 16- or 32-bit floats."""
    return (logits.dim() == 2 and logits.shape[0] > 0 and logits.shape[1] > 0 and logits.stride(1) == 1
            and logits.dtype in (torch.float32, torch.float16, torch.bfloat16))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` ([rows] int64) of a [rows, vocab] matrix through the two kernels: CUDA tensors, or
    CPU ones under Triton's interpreter."""
    if not takes(logits) or not (logits.is_cuda or interpreted()):
        raise ValueError(f"greedy_tokens: logits must be a non-empty 2-D float tensor with contiguous rows on a CUDA "
                         f"device, got {tuple(logits.shape)} {logits.dtype} with strides {logits.stride()} on "
                         f"{logits.device}")
    return _launch_greedy(logits)


def _launch_greedy(logits: torch.Tensor, block: int = BLOCK, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The two passes on logits ``greedy_tokens`` takes; ``block`` and ``num_warps`` (the first pass's) replace the
    launch's, for sweeps."""
    rows, vocab = logits.shape
    num_chunks = cdiv(vocab, block)
    vals = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    cols = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _chunk_max_kernel[(rows, num_chunks)](logits, logits.stride(0), vocab, vals, cols, num_chunks, BLOCK=block,
                                          num_warps=num_warps)
    _row_max_kernel[(rows,)](vals, cols, out, num_chunks, CHUNKS=next_power_of_2(num_chunks), num_warps=1)
    return out


def _setting() -> str:
    setting = settings.greedy_argmax()
    if setting not in ("graph", "kernel", "torch"):
        raise ValueError(f"MINIVLLM_GREEDY_ARGMAX must be 'graph', 'kernel' or 'torch', got {setting!r}")
    return setting


def argmax_in_graphs() -> bool:
    """Whether decode CUDA graphs take their rows' greedy tokens themselves (``graph`` or ``kernel``)."""
    return _setting() != "torch"


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's greedy tokens: with ``MINIVLLM_GREEDY_ARGMAX=kernel``, the kernels for CUDA logits they take;
    else torch.argmax."""
    if _setting() == "kernel" and logits.is_cuda and takes(logits):
        return _launch_greedy(logits)
    return logits.argmax(dim=-1)
