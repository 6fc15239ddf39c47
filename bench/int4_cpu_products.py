"""Where torch's CPU int4 op stops beating a dense product, by token count, for one model's linear shapes.

    python bench/int4_cpu_products.py                       # the default model's shapes (hidden 576, MLP 1536)
    python bench/int4_cpu_products.py --tokens 1 8 32 64 --rounds 60

Each product of one decoder layer (q|k|v, o, gate|up, down) is timed four ways on the same random Q4 codes, with
group 32 as GGUF's: ``op`` (``_weight_int4pack_mm_for_cpu`` in bfloat16, x cast in and the product cast back, as
a float32 model runs it), ``dequantized`` (``Int4LinearMethod``'s path past ``INT4_CPU_OP_MAX_TOKENS``: W
dequantized into the scratch buffers on every call, then a dense product), ``float32`` (a dense float32 W kept,
the model dequantized at load: ``--quantization none``) and ``bfloat16 kept`` (a dense bfloat16 copy of W kept,
for reference). The machines are shared and noisy, so the ways run interleaved, a round of each after the other,
and the medians of ``--rounds`` rounds are printed: microseconds per layer (the four products summed) and the
ratios to float32. The layer times ``--layers`` are roughly a step's linear layers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models.linear import (  # noqa: E402
    Int4LinearMethod,
    RowParallelLinear,
    int4,  # noqa: E402
    pack_int4,
)
from engine.models.linear.layer import process_weights_after_loading  # noqa: E402
from engine.models.weight_loading import load_checkpoint_weights  # noqa: E402

GROUP = 32


def make_layer(out_features: int, in_features: int, gen: torch.Generator):
    layer = RowParallelLinear(in_features, out_features, bias=False)
    layer.set_method(Int4LinearMethod(GROUP, float32_in_bfloat16=True))
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    scales = torch.rand(out_features, in_features // GROUP, generator=gen) * 0.04 + 0.01
    zeros = torch.randn(out_features, in_features // GROUP, generator=gen) * 0.02
    model = torch.nn.ModuleDict({"proj": layer})
    load_checkpoint_weights(model, [("proj.qweight", pack_int4(codes)), ("proj.scales", scales),
                                    ("proj.zeros", zeros)])
    process_weights_after_loading(model)
    weight = int4.dequantize_int4(layer.qweight, layer.scales, layer.zeros, GROUP)
    return layer, weight, weight.to(torch.bfloat16)


def ways(layers, tokens: int, gen: torch.Generator) -> dict:
    xs = [torch.randn(tokens, layer.in_features, generator=gen) for layer, _, _ in layers]

    def op():
        for (layer, _, _), x in zip(layers, xs):
            torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), layer.int4_packed, GROUP,
                                                       layer.int4_scales_zeros).float()

    def dequantized():
        for (layer, _, _), x in zip(layers, xs):
            int4.cpu_dequantized_product(layer, x, GROUP).float()

    def float32():
        for (_, weight, _), x in zip(layers, xs):
            F.linear(x, weight)

    def bfloat16_kept():
        for (_, _, weight16), x in zip(layers, xs):
            F.linear(x.to(torch.bfloat16), weight16).float()

    return {"op": op, "dequantized": dequantized, "float32": float32, "bfloat16 kept": bfloat16_kept}


def race(fns: dict, rounds: int) -> dict:
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if not int4.int4_cpu_op_available():
        sys.exit("this torch has no CPU int4 op")
    head_dim = args.hidden // args.heads
    shapes = {"qkv": (args.hidden + 2 * args.kv_heads * head_dim, args.hidden), "o": (args.hidden, args.hidden),
              "gate_up": (2 * args.intermediate, args.hidden), "down": (args.hidden, args.intermediate)}
    gen = torch.Generator().manual_seed(0)
    layers = [make_layer(out, inp, gen) for out, inp in shapes.values()]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dense bfloat16: {int4.dense_bfloat16()}; "
          f"shapes (out x in) {', '.join(f'{k} {o}x{i}' for k, (o, i) in shapes.items())}; "
          f"INT4_CPU_OP_MAX_TOKENS = {int4.INT4_CPU_OP_MAX_TOKENS}")
    print(f"{'tokens':>6}  {'op':>8} {'dequantized':>12} {'float32':>8} {'bf16 kept':>10}   us per layer;  "
          f"op/f32  deq/f32  x{args.layers} layers (ms): op, dequantized, float32")
    for tokens in args.tokens:
        t = race(ways(layers, tokens, gen), args.rounds)
        f32 = t["float32"]
        print(f"{tokens:>6}  {t['op']:>8.0f} {t['dequantized']:>12.0f} {f32:>8.0f} {t['bfloat16 kept']:>10.0f}"
              f"   {t['op'] / f32:>14.2f} {t['dequantized'] / f32:>8.2f}   "
              f"{t['op'] * args.layers / 1e3:.1f}, {t['dequantized'] * args.layers / 1e3:.1f}, "
              f"{f32 * args.layers / 1e3:.1f}", flush=True)


if __name__ == "__main__":
    main()
