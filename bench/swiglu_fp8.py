"""SwiGLU written as an FP8 product's input, against variants of its kernel (the H200 numbers in bench/RESULTS.md).

    python bench/swiglu_fp8.py [--inter 14336 --rows 151 16384]

The engine's kernel (``fused_ops.silu_and_mul_fp8``) reads a row of ``[gate | up]`` and writes ``silu(gate) * up``
as float8 values with one scale per 128 columns; in a prefill step it also multiplies gate|up's per-channel weight
scales in (``column_scales``). The variants here take several rows a program (the column scales loaded once for
all of them), divide approximately in SiLU, or multiply by a scale's reciprocal instead of dividing by the scale.
Prints the GPU time per call (each call replayed from a CUDA graph) next to the plain bf16 SwiGLU and the copy
time of the bytes read and written, and how many FP8 bytes and scales each variant writes differently from the
engine's kernel.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import graph_time, measure_ceilings  # noqa: E402

from engine.ops import fused as fused_ops  # noqa: E402
from engine.ops.fp8 import GROUP, empty_quantized  # noqa: E402

_GROUP = tl.constexpr(GROUP)


@triton.jit
def _variant_kernel(x_ptr, col_scale_ptr, q_ptr, s_ptr, num_rows, num_padded, inter_size, stride_x, stride_q,
                    stride_s, stride_sg, COL_SCALES: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                    FAST_SILU: tl.constexpr, RCP_QUANT: tl.constexpr):
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK // _GROUP)[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]
    in_row = offs < inter_size
    if COL_SCALES:
        gate_scale = tl.load(col_scale_ptr + offs, mask=in_row, other=0.0)
        up_scale = tl.load(col_scale_ptr + inter_size + offs, mask=in_row, other=0.0)
    groups = tl.program_id(1) * (BLOCK // _GROUP) + tl.arange(0, BLOCK // _GROUP)
    for r in tl.static_range(ROWS):
        row = (tl.program_id(0) * ROWS + r).to(tl.int64)
        mask = in_row & (row < num_rows)
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inter_size + offs, mask=mask, other=0.0).to(tl.float32)
        if COL_SCALES:
            gate = gate * gate_scale
            gate = gate.to(tl.bfloat16).to(tl.float32)
            up = (up * up_scale).to(tl.bfloat16).to(tl.float32)
        if FAST_SILU:
            act = tl.fdiv(gate, 1.0 + tl.exp(-gate))
        else:
            act = gate / (1.0 + tl.exp(-gate))
        act = act.to(tl.bfloat16).to(tl.float32)
        v = (act * up).to(tl.bfloat16).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(v), 1) / 448.0, 1.1754943508222875e-38)
        if RCP_QUANT:
            values = v * (1.0 / scale)[:, None]
        else:
            values = v / scale[:, None]
        tl.store(q_ptr + row * stride_q + offs, values.to(q_ptr.dtype.element_ty),
                 mask=in_row & (row < num_padded))
        tl.store(s_ptr + row * stride_s + groups * stride_sg, scale,
                 mask=(groups < tl.cdiv(inter_size, _GROUP)) & (row < num_padded))


def variant(x: torch.Tensor, column_scales: torch.Tensor | None, block: int, rows: int, fast_silu: bool,
            rcp_quant: bool, warps: int):
    num_tokens, width = x.shape
    inter = width // 2
    values, scales = empty_quantized(num_tokens, inter, GROUP, x.device, cublas_layout=True)
    padded = values.shape[0]
    _variant_kernel[(triton.cdiv(padded, rows), triton.cdiv(inter, block))](
        x, column_scales if column_scales is not None else x, values, scales, num_tokens, padded, inter,
        x.stride(0), values.stride(0), scales.stride(0), scales.stride(1), COL_SCALES=column_scales is not None,
        BLOCK=block, ROWS=rows, FAST_SILU=fast_silu, RCP_QUANT=rcp_quant, num_warps=warps, enable_fp_fusion=False)
    return values, scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inter", type=int, default=14336, help="intermediate size (Llama-3.1-8B's by default)")
    parser.add_argument("--rows", type=int, nargs="+", default=[151, 16384])
    args = parser.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    copy_bw = measure_ceilings(device).copy_bytes_per_s
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")
    for num_tokens in args.rows:
        x = torch.randn(num_tokens, 2 * args.inter, device=device, dtype=torch.bfloat16, generator=gen)
        col = torch.rand(2 * args.inter, device=device, generator=gen) * 0.01 + 0.001
        for column_scales in (None, col):
            moved = x.numel() * 2 + num_tokens * args.inter * (1 + 4 / GROUP)
            print(f"\n{num_tokens} tokens, column scales {'on' if column_scales is not None else 'off'}: "
                  f"copy time {moved / copy_bw * 1e6:.1f} us")
            plain = graph_time(lambda: fused_ops.silu_and_mul(x, column_scales=column_scales)) * 1e6
            print(f"  bf16 out (engine)                          {plain:8.1f} us")
            ref_v, ref_s = fused_ops.silu_and_mul_fp8(x, column_scales)
            engine = graph_time(lambda: fused_ops.silu_and_mul_fp8(x, column_scales)) * 1e6
            print(f"  FP8 out (engine)                           {engine:8.1f} us")
            for block, rows, fast, rcp, warps in itertools.product((512, 1024, 2048), (1, 4, 8), (False, True),
                                                                    (False, True), (4, 8)):
                if block == 2048 and warps == 4 or fast != rcp:
                    continue
                v, s = variant(x, column_scales, block, rows, fast, rcp, warps)
                bad_v = (v[:num_tokens].view(torch.uint8) != ref_v[:num_tokens].view(torch.uint8)).sum().item()
                bad_s = (s[:num_tokens] != ref_s[:num_tokens]).sum().item()
                us = graph_time(lambda: variant(x, column_scales, block, rows, fast, rcp, warps)) * 1e6
                print(f"  block {block:4} rows {rows} warps {warps} fast {int(fast)}   {us:8.1f} us"
                      f"   differs: {bad_v} bytes, {bad_s} scales")


if __name__ == "__main__":
    main()
