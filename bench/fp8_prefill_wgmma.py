"""A warp-specialized Gluon FP8 product for prefill batch sizes on Hopper, measured against cuBLAS's 128 x 128-tile
block-scaled product followed by the per-channel scales (what the engine runs from 256 tokens on).

    python bench/fp8_prefill_wgmma.py                      # Llama-3.1-8B's projections at 1,024-16,384 tokens
    python bench/fp8_prefill_wgmma.py --batches 16384 --layers gate_up

``C = (X * x_scales) @ (W * w_scales)^T``, X quantized per token and 128 columns, W per output channel. Each
program computes a 128-token x ``BLOCK_N``-weight tile of C: a one-warp producer partition streams the tiles of
X and W and the activations' scales through ``STAGES`` shared-memory buffers with TMA; two consumer warpgroups
each multiply 64 of the tokens by the weight tile (``wgmma``, tokens on the M side), wait for it, release the
buffers and scale the product into their float32 accumulator ("promotion"). The two consumers run unsynchronized,
so one's promotion overlaps the other's product (DeepGEMM's arrangement). The per-channel weight scales multiply
the accumulator once at the end: no pass over the output afterwards.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8_gemm import graph_time  # noqa: E402
from fp8_wgmma import cli, products, time_configs  # noqa: E402

from engine.ops import fp8 as fp8_kernels  # noqa: E402

try:  # Gluon ships with recent Tritons only
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

GROUP = 128
BLOCK_M = 128  # tokens a program: two consumer warpgroups of 64


@dataclass(frozen=True)
class PrefillConfig:
    block_n: int
    stages: int
    consumer_regs: int = 232


if gluon is not None:

    @gluon.jit
    def _producer(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, full, empty, off_m, off_n, num_groups):
        STAGES: gl.constexpr = x_smem.shape[0]
        K_STEP: gl.constexpr = x_smem.shape[2]
        for g in range(num_groups):
            slot = g % STAGES
            # A buffer is free once both consumers released it (the first pass finds them free).
            mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
            bar = full.index(slot)
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [off_m, g * K_STEP], bar, x_smem.index(slot))
            tma.async_copy_global_to_shared(w_desc, [off_n, g * K_STEP], bar, w_smem.index(slot))
            tma.async_copy_global_to_shared(s_desc, [g, off_m], bar, s_smem.index(slot))

    @gluon.jit
    def _consumer(x_smem, w_smem, s_smem, full, empty, w_scale_ptr, out_ptr, off_m, off_n, num_rows, n,
                  num_groups, stride_out, HALF: gl.constexpr):
        """64 tokens (``HALF`` 0 or 1 of the program's 128) x BLOCK_N weights; 4 warps."""
        STAGES: gl.constexpr = x_smem.shape[0]
        BLOCK_N: gl.constexpr = w_smem.shape[1]
        half: gl.constexpr = HALF
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 32])
        acc = gl.zeros([64, BLOCK_N], gl.float32, layout=mma)
        product = gl.zeros([64, BLOCK_N], gl.float32, layout=mma)
        for g in range(num_groups):
            slot = g % STAGES
            mbarrier.wait(full.index(slot), (g // STAGES) & 1)
            scale = s_smem.index(slot).slice(half * 64, 64, dim=1).permute((1, 0)).load(mma)  # [64, 1]
            x = x_smem.index(slot).slice(half * 64, 64, dim=0)
            product = warpgroup_mma(x, w_smem.index(slot).permute((1, 0)), product, use_acc=False, is_async=True)
            product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
            mbarrier.arrive(empty.index(slot), count=1)
            acc += product * scale
        rows = off_m + half * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        col_mask = cols < n
        acc = acc * gl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
        ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < num_rows)[:, None] & col_mask[None, :])

    @gluon.jit
    def _consumer0(x_smem, w_smem, s_smem, full, empty, w_scale_ptr, out_ptr, off_m, off_n, num_rows, n, num_groups,
                   stride_out):
        _consumer(x_smem, w_smem, s_smem, full, empty, w_scale_ptr, out_ptr, off_m, off_n, num_rows, n, num_groups,
                  stride_out, 0)

    @gluon.jit
    def _consumer1(x_smem, w_smem, s_smem, full, empty, w_scale_ptr, out_ptr, off_m, off_n, num_rows, n, num_groups,
                   stride_out):
        _consumer(x_smem, w_smem, s_smem, full, empty, w_scale_ptr, out_ptr, off_m, off_n, num_rows, n, num_groups,
                  stride_out, 1)

    @gluon.jit(do_not_specialize=["num_rows"])
    def _fp8_prefill_kernel(x_desc, w_desc, s_desc, w_scale_ptr, out_ptr, num_rows, n, num_groups, stride_out,
                            STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        pid_n = gl.program_id(0)  # fastest: the programs that share a token tile run together
        pid_m = gl.program_id(1)
        off_m = pid_m * 128
        off_n = pid_n * BLOCK_N
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES] + s_desc.block_type.shape, s_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        args = (x_smem, w_smem, s_smem, full, empty, w_scale_ptr, out_ptr, off_m, off_n, num_rows, n, num_groups,
                stride_out)
        gl.warp_specialize([
            (_consumer0, args),
            (_consumer1, args),
            (_producer, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, full, empty, off_m, off_n, num_groups)),
        ], [4, 1], [CONSUMER_REGS, 40])


def fp8_prefill(xq: torch.Tensor, x_scales: torch.Tensor, num_rows: int, weight: torch.Tensor,
                w_scales: torch.Tensor, out_dtype: torch.dtype, cfg: PrefillConfig) -> torch.Tensor:
    """xq [rows, k] float8 with token-major scales [rows, k / 128] (``quantize_rows(cublas_layout=True)``), weight
    [n, k] float8 with per-channel scales [n] -> [num_rows, n] in ``out_dtype``."""
    n, k = weight.shape
    rows = xq.shape[0]
    if k % GROUP or xq.shape[1] != k or rows % 4 or x_scales.stride() != (1, rows):
        raise ValueError("fp8_prefill: operands not in the engine's quantized layout")
    out = torch.empty((num_rows, n), dtype=out_dtype, device=xq.device)

    def desc(t, box, dtype):
        return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, dtype))

    x_desc = desc(xq, [BLOCK_M, GROUP], gl.float8e4nv)
    w_desc = desc(weight, [cfg.block_n, GROUP], gl.float8e4nv)
    s_desc = desc(x_scales.t(), [1, BLOCK_M], gl.float32)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(num_rows, BLOCK_M))
    _fp8_prefill_kernel[grid](x_desc, w_desc, s_desc, w_scales, out, num_rows, n, k // GROUP, n,
                              STAGES=cfg.stages, CONSUMER_REGS=cfg.consumer_regs, num_warps=4)
    return out


def sweep(shape: str, batches, layers) -> None:
    def first(xq, xs, m, w):
        fp8_prefill(xq, xs, m, w["values"], w["scales"], torch.bfloat16, PrefillConfig(128, 4))

    for name, n, k, ws, m, xq, xs in products(shape, batches, layers, first):
        def engine(w):  # what the engine runs from 256 tokens on: 128 x 128 tiles of ones, then the scales
            c = w["cublas"]
            out = torch._scaled_mm(xq, w["values"].t(), scale_a=xs, scale_b=c.tiles, out_dtype=torch.bfloat16)
            return fp8_kernels.scale_columns_(out[:m], c.rows)

        want = engine(ws[0]).float()
        tiles_only = graph_time([lambda w=w: torch._scaled_mm(xq, w["values"].t(), scale_a=xs,
                                                               scale_b=w["cublas"].tiles,
                                                               out_dtype=torch.bfloat16) for w in ws])
        ours_engine = graph_time([lambda w=w: engine(w) for w in ws])
        flops = 2 * m * n * k
        print(f"{name} m={m}: cuBLAS 128x128 tiles {tiles_only:.1f} us ({flops / tiles_only / 1e6:.0f} TFLOPS), "
              f"+ column scales {ours_engine:.1f} us", flush=True)
        configs = [PrefillConfig(*c) for c in itertools.product((128, 64), (3, 4, 5), (232, 200))]
        results = time_configs(configs, lambda cfg: fp8_prefill, xq, xs, m, ws, want)
        for t, cfg, error in results[:4]:
            print(f"    {t:8.1f} us {flops / t / 1e6:5.0f} TFLOPS {ours_engine / t:5.2f}x  {cfg}  "
                  f"error against cuBLAS {error:.1e}", flush=True)


def main() -> None:
    cli(__doc__, "1024,4096,16384", sweep)


if __name__ == "__main__":
    main()
