"""Where a steady decode step's device time goes, kernel by kernel (needs a CUDA GPU).

    python bench/profile_decode.py --shape qwen3-0.6b --batch 160 --steps 20

Fills the engine with ``--batch`` requests whose prompts follow the W1 length range, lets
every prefill finish, then records ``--steps`` decode steps under ``torch.profiler`` and
prints the device time per step of each kernel (grouped by name) next to the step's
roofline: the weights plus the active KV read once at the measured copy bandwidth.
The same number of steps runs first without the profiler, whose tracing can change how kernels
overlap: their median device time is printed beside the profiled steps'.
The Chrome trace goes to ``$OUT/decode_trace.json`` (or ``bench/out``).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import measure_ceilings, model_costs  # noqa: E402
from workloads import WORKLOADS, shape_dir  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.loading.model_config import ModelConfig  # noqa: E402


def kernel_table(prof, num_steps: int) -> list[tuple[str, int, float]]:
    """(kernel name, launches per step, device µs per step), largest first."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        entry = totals[event.name[:90]]
        entry[0] += 1
        entry[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    rows = [(name, round(n / num_steps), us / num_steps) for name, (n, us) in totals.items()]
    return sorted(rows, key=lambda r: -r[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=160)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--prefill", action="store_true",
                        help="profile the first step instead (the prompts' prefill, up to 16,384 tokens)")
    parser.add_argument("--host", action="store_true",
                        help="with --prefill: profile the step's host work (cProfile) instead of its kernels")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", default=None, choices=["fp8"])
    args = parser.parse_args()

    model_dir = shape_dir(args.shape)
    config = ModelConfig.from_pretrained(model_dir)
    w1 = WORKLOADS["W1"]
    prompts, _ = w1.sample(config.vocab_size)
    prompts = (prompts * (args.batch // len(prompts) + 1))[: args.batch]
    ceil = measure_ceilings(torch.device("cuda"))
    llm = LLM(str(model_dir), load_format="dummy", max_model_len=4096, max_num_seqs=max(args.batch, 1),
              max_num_batched_tokens=16384, enforce_eager=args.enforce_eager,
              # A prefill profile holds exactly one step: nothing queued behind it.
              async_scheduling=False if args.prefill else args.async_scheduling,
              overlap_steps=False if args.prefill else None, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2048, ignore_eos=True)
    for i, p in enumerate(prompts if not args.prefill else []):
        engine.add_request(str(i), p, params)
    if args.prefill:
        # Warm the kernels on other requests first; the profiled step is a fresh 16k-token prefill.
        other = [[(t + 1) % config.vocab_size for t in p] for p in prompts[:16]]  # no prefix-cache hits
        llm.generate([{"prompt_token_ids": p} for p in other], SamplingParams(max_tokens=2), use_tqdm=False)
        for i, p in enumerate(prompts):
            engine.add_request(f"p{i}", p, params)
        args.steps = 1
    while not args.prefill and (engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)):
        engine.step()
    for _ in range(0 if args.prefill else 10):
        engine.step()
    engine.measure_steps(True)
    torch.cuda.synchronize()
    if args.prefill and args.host:
        profile = cProfile.Profile()
        profile.enable()
        engine.step()
        torch.cuda.synchronize()
        profile.disable()
        t = engine.step_timings[-1]
        print(f"\nprefill step of {t.num_tokens} tokens: host {t.host_s * 1e3:.1f} ms (under cProfile), device "
              f"{t.device_s * 1e3:.1f} ms")
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        return
    for _ in range(0 if args.prefill else args.steps):
        engine.step()
    torch.cuda.synchronize()
    plain = engine.step_timings[-args.steps:]
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    timings = engine.step_timings[-args.steps:]

    if args.prefill:
        sched_tokens = timings[-1].num_tokens
        # matmul_params leaves out the embedding and the LM head (which multiplies one token per prompt).
        flops = 2 * model_costs(engine.runner.model, config).matmul_params * sched_tokens
        print(f"\nprefill step of {sched_tokens} tokens: matmul floor {flops / ceil.matmul_flops_per_s * 1e3:.2f} ms")
    contexts = np.array([r.num_computed_tokens for r in engine.scheduler.running])
    costs = model_costs(engine.runner.model, config, engine.runner.bytes_per_block() // engine.runner.block_size)
    roof_ms = (costs.weight_bytes + costs.kv_bytes_per_token * contexts.sum()) / ceil.copy_bytes_per_s * 1e3
    rows = kernel_table(prof, args.steps)
    total_us = sum(r[2] for r in rows)
    settings = {name: os.environ[name] for name in ("MINIVLLM_DECODE_KSPLIT", "TORCH_BLAS_PREFER_CUBLASLT")
                if name in os.environ}
    print(f"\n{args.shape}: {len(contexts)} requests decoding, context mean {contexts.mean():.0f} "
          f"(max {contexts.max()}), {'eager' if args.enforce_eager else 'CUDA graphs'}"
          f"{', async scheduling' if engine.async_scheduling else ''}{f', {settings}' if settings else ''}")
    if not args.prefill:
        print(f"unprofiled steps: device {np.median([t.device_s for t in plain]) * 1e3:.3f} ms, wall "
              f"{np.median([t.wall_s for t in plain]) * 1e3:.3f} ms (median of {len(plain)})")
    print(f"step roofline {roof_ms:.2f} ms (copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s); kernels "
          f"{total_us / 1e3:.2f} ms of device time per step; timed steps: host "
          f"{np.median([t.host_s for t in timings]) * 1e3:.2f} / device "
          f"{np.median([t.device_s for t in timings]) * 1e3:.2f} / wall "
          f"{np.median([t.wall_s for t in timings]) * 1e3:.2f} ms (median)")
    print(f"{'kernel':90s} {'n/step':>6s} {'µs/step':>9s} {'share':>6s}")
    for name, n, us in rows[:40]:
        print(f"{name:90s} {n:6d} {us:9.1f} {us / total_us:6.1%}")
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = ("prefill" if args.prefill else "eager" if args.enforce_eager else "graphs") + \
        (f"_kv{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else "") + \
        (f"_w{args.quantization}" if args.quantization else "") + \
        "".join(f"_{name.removeprefix('MINIVLLM_').lower()}{value}" for name, value in settings.items())
    (out_dir / f"decode_kernels_{args.shape}_{suffix}.json").write_text(json.dumps(
        {"shape": args.shape, "batch": len(contexts), "context_mean": float(contexts.mean()),
         "roofline_ms": roof_ms, "settings": settings, "kernels": rows,
         "unprofiled_device_ms": None if args.prefill else float(np.median([t.device_s for t in plain]) * 1e3)},
        indent=1))


if __name__ == "__main__":
    main()
