"""Launch choices of the attention kernels: functions of shapes and of the GPU, never of a step's values.

Split counts, tile shapes and the other compile-time choices come from sweeps on H100 and H200 GPUs
(bench/attention_kernels.py, bench/fp8_attention_sweep.py, bench/kv_write.py; the times are in bench/RESULTS.md).
Every choice depends only on host ints and tensor shapes, so a launch captured in a CUDA graph stays valid.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from engine import settings
from engine.ops.intmath import cdiv, next_power_of_2

MAX_NUM_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 64  # one key tile: measured on an H200, splits this short still paid off
LOG2_E = 1.4426950408889634
_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second (and third) axis
# Up to this many rows an FP8 cache's write ropes q and k itself; past it the rope kernel runs first (write_paged_kv).
# The fused launch measured slower from 2,048 tokens on and no faster at 256 (bench/kv_write.py; bench/RESULTS.md):
# rope runs apart until decode sizes are tuned.
_FP8_FUSED_ROPE_MAX_ROWS = 0


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (an H200's 132 where there is no GPU, e.g. in the interpreter)."""
    if device.type != "cuda":
        return 132
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=4096)
def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, sm_count: int = 132) -> int:
    """How many pieces to cut each context into so that a small decode batch still fills the GPU.

    One piece per (sequence, KV head) program when there are already about two programs per SM;
    otherwise enough pieces for that, but about ``MIN_TOKENS_PER_SPLIT`` keys each at the least,
    rounded up to a power of two so that few variants get compiled. Pieces past a short context
    are empty and cheap. Under a CUDA graph, pass a bound fixed by shapes (the block table's capacity).
    """
    num_programs = max(num_seqs * num_kv_heads, 1)
    if num_programs >= 2 * sm_count:
        return 1
    wanted = cdiv(2 * sm_count, num_programs)
    useful = max(max_context_len // MIN_TOKENS_PER_SPLIT, 1)
    return min(next_power_of_2(min(wanted, useful)), MAX_NUM_SPLITS)


def _decode_tiles(head_dim: int, num_splits: int, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N keys, num_warps, num_stages) of the decode kernel.

    From sweeps (bench/attention_kernels.py --mixed-sweep, bench/fp8_attention_sweep.py; the times are in
    bench/RESULTS.md): 64-key tiles for split (short or few) contexts, 128-key tiles for large unsplit batches of
    mixed lengths; 8 warps were slower everywhere. An FP8 cache: 128-key tiles split or not. No register limit:
    capped at 128 a thread, four FP8 programs fit an SM instead of three, but the batch took longer (bf16 too).
    FP8 unsplit: two pipeline stages, not three.

    bf16 unsplit: two stages, which give K and V one buffer each, so an SM holds two programs; three stages'
    second buffers leave room for one program an SM. Until the bf16 kernel loaded each tile's block ids a tile
    ahead, three stages gave one buffer too.
    """
    if head_dim > 128:
        return 32, 4, 3
    if num_splits == 1 and (tiles := settings.decode_tiles()):
        return _tiles_setting(tiles)
    if fp8:
        return 128, 4, (2 if num_splits == 1 else 3)
    return (128, 4, 2) if num_splits == 1 else (64, 4, 3)


@functools.lru_cache(maxsize=8)
def _tiles_setting(value: str) -> tuple[int, int, int]:
    """``MINIVLLM_DECODE_TILES=BLOCK_N,warps,stages``: the decode kernel's tiles for unsplit contexts (head_dim <= 128),
    for measuring other settings on a GPU (bench/gpu_throughput.py --env)."""
    try:
        block_n, warps, stages = (int(x) for x in value.split(","))
    except ValueError:
        raise ValueError(f"MINIVLLM_DECODE_TILES must be BLOCK_N,warps,stages (e.g. 128,4,2), got {value!r}") from None
    if block_n not in (16, 32, 64, 128, 256) or warps not in (1, 2, 4, 8, 16) or not 1 <= stages <= 8:
        raise ValueError(f"MINIVLLM_DECODE_TILES: BLOCK_N one of 16, 32, 64, 128, 256, warps one of 1, 2, 4, 8, 16 "
                         f"and stages in [1, 8], got {value!r}")
    return block_n, warps, stages


def _group_pad(group: int) -> int:
    """Rows of the decode kernels' dots for ``group`` query heads a KV head: tl.dot takes 16 at the least."""
    return max(16, next_power_of_2(group))


def _decode_kv_heads(group: int, num_kv_heads: int, num_splits: int) -> int:
    """KV heads per program of the FP8 decode kernel (``KV_HEADS`` there): two where contexts are split in two and
    their query heads fit the 16 rows a dot pads to, else one: faster at 2 splits, slower with more (few rows want
    every program they can get), and unsplit no faster than the two pipeline stages alone (bench/RESULTS.md)."""
    if num_splits == 2 and 2 * group <= _group_pad(group) and num_kv_heads % 2 == 0:
        return 2
    return 1


def _prefill_tiles(max_query_len: int, group: int, head_dim: int, fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages): rows just big enough for the longest query.

    64 x 64 tiles with 4 warps and 3 stages: the best of a sweep (bf16, head_dim 128, a W1-like 16k-token prefill
    step; 8 warps, 128-row and 128-key tiles were slower), and far fewer registers than 128 x 128. An FP8 cache
    takes 128-key tiles at 64 rows (bench/fp8_attention_sweep.py --prefill; the times are in bench/RESULTS.md).
    """
    block_m = min(64, max(16, next_power_of_2(max(max_query_len, 1) * group)))
    block_m = max(block_m, next_power_of_2(group))  # at least one token per tile
    if head_dim <= 128:
        return block_m, (128 if fp8 and block_m == 64 else 64), 4, 3
    return block_m, 32, 4, 2


def _write_tokens(rows: int) -> int:
    """Tokens per program of the FP8 KV-write kernel for a step of ``rows`` tokens, tuned by a sweep over step
    sizes (bench/kv_write.py, queries rotated in programs of their own up to 512 tokens; bench/RESULTS.md)."""
    return 1 if rows <= 64 else 4 if rows <= 512 else 8


def _splits_queries(rows: int) -> bool:
    """Whether the FP8 KV-write kernel rotates a step's queries in programs of their own (a second row of the
    grid) rather than in those that write K and V: twice the programs, each half the work, which is what decode
    steps want; at 2,048 tokens the two are even (bench/kv_write.py; bench/RESULTS.md)."""
    return rows <= 512


@functools.lru_cache(maxsize=None)
def _limits_registers() -> bool:
    """Whether this Triton takes ``maxnreg`` (registers per thread at most) for NVIDIA GPUs."""
    if torch.version.hip is not None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "maxnreg" in CUDAOptions.__dataclass_fields__


def _fp8_ptx(q: torch.Tensor) -> bool:
    """Whether the FP8 decode kernel converts in inline PTX: 16-bit queries on an NVIDIA GPU of sm_89 or later
    (``cvt.rn.f16x2.e4m3x2``); not in the interpreter, which runs no PTX."""
    return q.is_cuda and q.dtype != torch.float32 and _converts_e4m3_pairs(q.device.index or 0)


@functools.lru_cache(maxsize=None)
def _converts_e4m3_pairs(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 9)


def _dot_dtype(dtype: torch.dtype, fp8: bool):
    """The dtype the kernels' dots run in: the queries', or float16 for 16-bit queries on an FP8 cache."""
    if not fp8 or dtype == torch.float32:
        return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
    return tl.float16


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would run through TF32 tensor cores by default: keep them exact.
    return "ieee" if dtype == torch.float32 else "tf32"



def _scale_args(kv_scales, k_cache: torch.Tensor) -> tuple:
    """(k_scale_ptr, v_scale_ptr, stride_sb, stride_ss) for the kernels; the caches stand in without scales."""
    if kv_scales is None:
        return k_cache, k_cache, 0, 0
    return kv_scales[0], kv_scales[1], kv_scales[0].stride(0), kv_scales[0].stride(1)
