"""GPU throughput on a real model shape with dummy weights, against the roofline and a peer.

    python bench/gpu_throughput.py --shape qwen3-0.6b --workload W1 --peer-requests 64
    python bench/gpu_throughput.py --shape llama-3.1-8b --workload W1 --peer-requests 0
    python bench/gpu_throughput.py --shape llama-3.1-8b --tensor-parallel-size 2 --peer-requests 0
    python bench/gpu_throughput.py --shape qwen3-0.6b --kv-cache-dtype fp8 --peer-requests 0
    python bench/gpu_throughput.py --shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 --peer-requests 0
    python bench/gpu_throughput.py --shape llama-3.1-8b --quantization w4a16 --peer-requests 0
    python bench/gpu_throughput.py --shape llama-3.1-8b --quantization w4a16 --num-requests 1 --peer-requests 0
    python bench/gpu_throughput.py --shape qwen3-0.6b --peer-requests 0 --env MINIVLLM_DECODE_KSPLIT=0 \
        --env MINIVLLM_DECODE_KSPLIT=auto

With ``--kv-cache-dtype fp8`` or ``--quantization fp8`` the bf16 engine runs first on the same requests
in the same invocation, and each run is given the roofline of its own bytes (FP8 weights and K/V are
half of bf16's; their scales count too) and, for FP8 weights, the FP8 matmul rate measured here.
``--quantization w4a16`` runs the shape as a 4-bit GPTQ checkpoint (dummy codes, groups of 128) after bf16, its
roofline counting the codes at half a byte and the group scales and zeros; ``--num-requests 1`` makes the run one
stream, whose decode step is its TPOT.
With ``--env`` each of those runs once per setting given, in that order, on the same requests: a setting is
environment variables the engine reads (``MINIVLLM_DECODE_KSPLIT``, ``MINIVLLM_GREEDY_ARGMAX``,
``MINIVLLM_DECODE_TILES``: ``LAUNCH_SETTINGS`` below) or torch's ``TORCH_BLAS_PREFER_CUBLASLT``, comma-separated.

Measures copy bandwidth and matmul rate in the same run, computes the workload's
roofline from them, runs minivllm (bf16, Triton attention, CUDA graphs), reports the
fraction of the roofline achieved and the per-step host/device time, then runs
transformers' continuous batching on the first N requests as the peer.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import git_commit  # noqa: E402
from peers import run_transformers_cb  # noqa: E402
from roofline import cuda_time, full_model_costs, measure_ceilings, model_costs, roofline  # noqa: E402
from workloads import WORKLOADS, shape_dir  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

ALL_REDUCE_BATCHES = (1, 8, 32, 64, 128, 192, 256)
# What --env sets; a run's record shows them. TORCH_BLAS_PREFER_CUBLASLT=1: the bf16 products through cuBLASLt
# (torch.backends.cuda.preferred_blas_library), whose kernel choices for decode-sized products differ from cuBLAS's.
# MINIVLLM_DECODE_KSPLIT=auto (the default), 0, S or qkv=S,o=S,gate_up=S,down=S: decode-sized products as S slices of K
# (engine.models.linear.ksplit), read when the model is built. MINIVLLM_GREEDY_ARGMAX=graph (the default), kernel or torch:
# where engine.greedy's two-pass kernels take greedy rows' tokens (inside decode graphs; eager steps too; nowhere).
# MINIVLLM_DECODE_TILES=BLOCK_N,warps,stages: the decode attention kernel's tiles for unsplit contexts.
LAUNCH_SETTINGS = ("TORCH_BLAS_PREFER_CUBLASLT", "MINIVLLM_DECODE_KSPLIT", "MINIVLLM_GREEDY_ARGMAX",
                   "MINIVLLM_DECODE_TILES")
_ENV_AT_START = {name: os.environ.get(name) for name in LAUNCH_SETTINGS}


def env_items(setting: str) -> list[tuple[str, str]]:
    """An ``--env`` setting's (NAME, VALUE) pairs: items are cut at the commas before a known NAME, so that a value
    may hold commas itself (``MINIVLLM_DECODE_KSPLIT=o=4,down=4``)."""
    items = re.split(",(?=(?:%s)=)" % "|".join(LAUNCH_SETTINGS), setting)
    return [tuple(item.split("=", 1)) if "=" in item else (item, "") for item in items]


def _all_reduce_rank(rank: int, world: int, port: int, hidden: int, out: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    times = {}
    for batch in ALL_REDUCE_BATCHES:
        x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(10):
            dist.all_reduce(x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(100):
            dist.all_reduce(x)
        end.record()
        end.synchronize()
        times[batch] = start.elapsed_time(end) / 1e3 / 100
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def measure_all_reduce(world: int, hidden: int) -> dict[int, float]:
    """Seconds per NCCL all-reduce of [batch, hidden] bf16 over ``world`` GPUs, by batch (before the engine
    takes the GPUs; a decode step does two per layer)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "all_reduce.json")
        mp.spawn(_all_reduce_rank, args=(world, port, hidden, out), nprocs=world, join=True)
        return {int(k): v for k, v in json.loads(Path(out).read_text()).items()}


def all_reduce_time(table: dict[int, float]):
    """Interpolate a measured all-reduce table over batch sizes."""
    sizes = sorted(table)
    return lambda batch: float(np.interp(batch, sizes, [table[b] for b in sizes]))


def run_minivllm(model_dir: Path, prompts, output_lens, args, kv_cache_dtype: str = "auto",
                 quantization: str | None = None, env: str | None = None,
                 preemption_mode: str | None = None) -> tuple[dict, LLM]:
    if env is not None:  # read when the engine starts or its kernels launch; each run sets only its own
        for name, value in _ENV_AT_START.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for name, value in env_items(env):
            os.environ[name] = value
        torch.backends.cuda.preferred_blas_library(
            "cublaslt" if os.environ.get("TORCH_BLAS_PREFER_CUBLASLT") == "1" else "cublas")
    if quantization == "w4a16":  # a checkpoint's quantization, read from its config: no engine flag
        model_dir, quantization = w4a16_dir(model_dir), None
        name_suffix = " w4a16 weights"
    else:
        name_suffix = f" {quantization} weights" if quantization else ""
    llm = LLM(str(model_dir), load_format="dummy", max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
              tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=kv_cache_dtype,
              quantization=quantization, num_kvcache_blocks=getattr(args, "num_kvcache_blocks", -1),
              preemption_mode=preemption_mode,
              kv_offloading_size_gib=args.kv_offloading_size if preemption_mode in ("swap", "auto") else 0.0)
    warm = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts[:4])
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.engine.measure_steps(True)
    torch.cuda.synchronize()
    with compiles_logged() as compiled, full_collections_logged() as collections:
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == sum(output_lens)
    name = "minivllm" + name_suffix + \
        (f" {kv_cache_dtype} KV" if kv_cache_dtype != "auto" else "") + (f" [{env}]" if env else "") + \
        (f" preemption {preemption_mode}" if preemption_mode else "")
    runner = llm.engine.runner
    return {"name": name, "kv_cache_dtype": kv_cache_dtype, "quantization": quantization,
            "env": {name: os.environ.get(name) for name in LAUNCH_SETTINGS},
            "blas": str(torch.backends.cuda.preferred_blas_library()),
            "kv_bytes_per_token": runner.bytes_per_block() // runner.block_size,
            "kv_cache_tokens": runner.kv_cache.num_slots, "elapsed_s": elapsed, "output_tokens": num_out,
            "tok_s": num_out / elapsed,
            "preemptions": llm.engine.stats().num_preemptions, "async_scheduling": llm.engine.async_scheduling,
            "steps_planned_ahead": llm.engine.num_steps_planned_ahead,
            "steps": step_summary(llm), "compiled_mid_run": compiled, "gc_full_collections_ms": collections,
            "preemption_mode": preemption_mode, "host_tier": host_tier_summary(llm)}, llm


W4A16_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}


def w4a16_dir(model_dir: Path) -> Path:
    """The shape of ``model_dir`` as a 4-bit GPTQ checkpoint's config (``W4A16_CONFIG``), beside it."""
    target = model_dir.parent / f"{model_dir.name}-w4a16"
    if not target.exists():
        target.mkdir()
        config = json.loads((model_dir / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, "quantization_config": W4A16_CONFIG}, indent=2))
    return target


def host_tier_summary(llm) -> dict | None:
    """What the host tier moved in the run (None without one): blocks, swaps, and the copies' bandwidth."""
    stats = llm.engine.stats()
    if stats.kv.host is None:
        return None
    torch.cuda.synchronize()
    moved = dataclasses.asdict(llm.engine.stats().kv_transfers)
    for direction in ("to_host", "to_device"):
        seconds = moved[f"seconds_{direction}"]
        moved[f"gb_s_{direction}"] = moved[f"bytes_{direction}"] / seconds / 1e9 if seconds else None
    return {**dataclasses.asdict(stats.kv.host), **moved}


@contextlib.contextmanager
def full_collections_logged():
    """Milliseconds of each full (generation 2) garbage collection while the block runs: one stalls a step for
    as long as it takes to walk every tracked object, the KV block pool's included."""
    durations: list[float] = []
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            durations.append((time.perf_counter() - started[0]) * 1e3)
            logging.getLogger("bench").warning("full garbage collection mid-run: %.0f ms", durations[-1])

    gc.callbacks.append(callback)
    try:
        yield durations
    finally:
        gc.callbacks.remove(callback)


@contextlib.contextmanager
def compiles_logged():
    """The Triton kernels compiled while the block runs (each is a step that stalls), as a list of names."""
    compiled: list[str] = []
    knobs = getattr(__import__("triton"), "knobs", None)
    if knobs is None:  # Triton before 3.4 has no compile hooks
        yield compiled
        return

    def hook(*args, **kwargs):
        compiled.append(kwargs.get("repr", "?"))
        logging.getLogger("bench").warning("Triton compiled mid-run: %s", compiled[-1][:300])
        return False

    previous, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    try:
        yield compiled
    finally:
        knobs.runtime.jit_cache_hook = previous


def step_summary(llm: LLM) -> dict:
    """Host vs device time per step, for graph-replayed decode steps and for eager steps."""
    out = {}
    for kind, pick in (("decode_graph", lambda t: t.graph), ("eager", lambda t: not t.graph)):
        steps = [t for t in llm.engine.step_timings if pick(t)]
        if not steps:
            continue
        host = np.array([t.host_s for t in steps]) * 1e3
        dev = np.array([t.device_s for t in steps]) * 1e3
        wall = np.array([t.wall_s for t in steps]) * 1e3
        out[kind] = {"steps": len(steps), "host_ms_median": float(np.median(host)),
                     "device_ms_median": float(np.median(dev)), "wall_ms_median": float(np.median(wall)),
                     "wall_ms_max": float(wall.max()), "wall_s_total": float(wall.sum() / 1e3),
                     "gpu_busy_fraction": float(dev.sum() / wall.sum()),
                     "mean_batch": float(np.mean([t.num_reqs for t in steps]))}
        if kind == "eager":  # few, and each one's tokens and times show which step stalled
            out[kind]["each"] = [{"tokens": t.num_tokens, "device_ms": round(t.device_s * 1e3, 2),
                                  "wall_ms": round(t.wall_s * 1e3, 2)} for t in steps]
    return out


def measure_fp8_matmul(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of a large FP8 x FP8 matmul (torch._scaled_mm, per-row and per-column scales, bf16 out)."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    return 2 * n**3 / cuda_time(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
                                reps=10, warmup=3)


def run_peer(model_dir: Path, prompts, output_lens) -> dict:
    """The peer on random bf16 weights in the same shape (sdpa attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    return run_transformers_cb(model, prompts, output_lens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--peer-requests", type=int, default=64, help="peer runs on the first N requests (0: none)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan each step before the last one's tokens (default: the engine's, on with CUDA)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="fp8: also run with an FP8 KV cache, after the bf16 run")
    parser.add_argument("--quantization", default=None, choices=["fp8", "w4a16"],
                        help="fp8: also run with FP8 weights, after the bf16 run; w4a16: also run the shape as a "
                             "GPTQ checkpoint (4-bit weights, groups of 128, symmetric; the LM head in bf16)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs the model is split over; the roofline is then per GPU, plus the all-reduces "
                             "measured in the same run")
    parser.add_argument("--kv-pool-fraction", type=float, default=None,
                        help="size the KV pool at this fraction of the tokens every request holds at its end, all "
                             "at once (0.3: a preemption-heavy run); default: from the memory budget")
    parser.add_argument("--preemption-mode", nargs="+", default=[None], choices=["recompute", "swap", "auto"],
                        help="one run per mode, in this order (swap and auto use the host tier)")
    parser.add_argument("--kv-offloading-size", type=float, default=0.0,
                        help="GiB of pinned host memory for the KV host tier of the swap and auto runs")
    parser.add_argument("--env", action="append", default=None, metavar="NAME=VALUE[,NAME=VALUE]",
                        help="run each configuration once per --env setting (e.g. MINIVLLM_DECODE_KSPLIT=0)")
    args = parser.parse_args()
    for setting in args.env or []:
        for name, value in env_items(setting):
            if name not in LAUNCH_SETTINGS:
                parser.error(f"--env takes NAME=VALUE items, NAME one of {', '.join(LAUNCH_SETTINGS)}: {setting!r}")
    if args.tensor_parallel_size > 1:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off, as the device notes ask
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    model_dir = shape_dir(args.shape)
    workload = WORKLOADS[args.workload]
    from engine.loading.model_config import ModelConfig

    config = ModelConfig.from_pretrained(model_dir)
    prompts, output_lens = workload.sample(config.vocab_size)
    if args.num_requests:
        prompts, output_lens = prompts[: args.num_requests], output_lens[: args.num_requests]

    ceil = measure_ceilings(torch.device("cuda"))
    tp = args.tensor_parallel_size
    all_reduce = measure_all_reduce(tp, config.hidden_size) if tp > 1 else None
    variants = [("auto", None)]
    if args.kv_cache_dtype != "auto" or args.quantization:
        variants.append((args.kv_cache_dtype, args.quantization))
        if args.quantization == "fp8":
            ceil.fp8_matmul_flops_per_s = measure_fp8_matmul(torch.device("cuda"))
    if args.kv_pool_fraction:
        needed = sum(len(p) + n for p, n in zip(prompts, output_lens))
        args.num_kvcache_blocks = max(int(needed * args.kv_pool_fraction) // 16 + 1, -(-args.max_model_len // 16) + 1)
    runs = []
    for kv_cache_dtype, quantization, env, mode in [(*v, e, m) for v in variants for e in args.env or [None]
                                                    for m in args.preemption_mode]:
        result, llm = run_minivllm(model_dir, prompts, output_lens, args, kv_cache_dtype, quantization, env, mode)
        if tp > 1:  # rank 0 holds a share of the model: count the whole from the config
            from engine.distributed import kv_head_range

            costs = full_model_costs(config)
            kv_share = kv_head_range(config.num_key_value_heads, 0, tp)[1] / config.num_key_value_heads
            # Per decode step: two all-reduces per layer, one for the embedding (the logits' gather is smaller).
            num_all_reduces = 2 * config.num_hidden_layers + 1
            roof = roofline([len(p) for p in prompts], output_lens, costs, ceil, config.vocab_size,
                            config.hidden_size, num_gpus=tp, kv_share=kv_share,
                            all_reduce_s=all_reduce_time(all_reduce), num_all_reduces=num_all_reduces)
            batch = result["steps"].get("decode_graph", {}).get("mean_batch", 1)
            result["all_reduce_ms_per_decode_step"] = num_all_reduces * all_reduce_time(all_reduce)(batch) * 1e3
            result["all_reduce_s_by_batch"] = all_reduce
        else:
            costs = model_costs(llm.engine.runner.model, config, result["kv_bytes_per_token"])
            roof = roofline([len(p) for p in prompts], output_lens, costs, ceil, config.vocab_size,
                            config.hidden_size, matmul_flops_per_s=ceil.fp8_matmul_flops_per_s
                            if quantization == "fp8" else None)
        result["roofline"] = roof
        result["fraction_of_roofline"] = result["tok_s"] / roof["tok_s"]
        runs.append(result)
        llm.engine.close()
        del llm
        torch.cuda.empty_cache()
    result, roof = runs[0], runs[0]["roofline"]
    results = list(runs)
    if args.peer_requests:
        n = args.peer_requests
        results.append(run_peer(model_dir, prompts[:n], output_lens[:n]))

    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": git_commit(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "shape": args.shape, "workload": workload.__dict__,
              "num_requests": len(prompts), "ceilings": ceil.__dict__, "roofline": roof, "results": results}
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = ("_sync" if args.async_scheduling is False else "") + (f"_tp{tp}" if tp > 1 else "") + \
        (f"_kv{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else "") + \
        (f"_w{args.quantization}" if args.quantization else "") + ("_env" if args.env else "") + \
        (f"_pool{args.kv_pool_fraction}" if args.kv_pool_fraction else "")
    (out_dir / f"gpu_{args.shape}_{workload.name}{suffix}.json").write_text(json.dumps(record, indent=2))
    print(f"\n{args.shape} {workload.name} ({len(prompts)} requests, {sum(output_lens)} output tokens) on "
          f"{record['gpu']}, commit {record['commit']}")
    print(f"  ceilings: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s; roofline {roof['tok_s']:.0f} tok/s "
          f"(prefill {roof['prefill_s']:.2f} s + decode {roof['decode_s']:.2f} s)")
    for run in runs:
        print(f"  {run['name']}: {run['tok_s']:.0f} tok/s in {run['elapsed_s']:.1f} s = "
              f"{run['tok_s'] / roof['tok_s']:.1%} of the bf16 roofline, {run['fraction_of_roofline']:.1%} of its "
              f"own ({run['roofline']['tok_s']:.0f} tok/s); {run['tok_s'] / result['tok_s']:.2f}x bf16; KV pool "
              f"{run['kv_cache_tokens']} tokens ({run['kv_bytes_per_token']} B/token); preemptions "
              f"{run['preemptions']}, steps planned ahead {run['steps_planned_ahead']}")
        if run.get("host_tier"):
            h = run["host_tier"]
            print(f"    host tier: swapped out {h['num_swapped_out_blocks']} blocks, in {h['num_swapped_in_blocks']}; "
                  f"saved {h['blocks_to_host']} blocks ({h['bytes_to_host'] / 1e9:.2f} GB, "
                  f"{h['gb_s_to_host'] or 0:.1f} GB/s), loaded {h['blocks_to_device']} "
                  f"({h['bytes_to_device'] / 1e9:.2f} GB, {h['gb_s_to_device'] or 0:.1f} GB/s); host prefix hits "
                  f"{h['external_prefix_cache_hits']} of {h['external_prefix_cache_queries']} tokens")
        for kind, s in run["steps"].items():
            print(f"    {kind}: {s['steps']} steps, median host {s['host_ms_median']:.2f} ms, device "
                  f"{s['device_ms_median']:.2f} ms, wall {s['wall_ms_median']:.2f} ms (max {s['wall_ms_max']:.1f}, "
                  f"total {s['wall_s_total']:.2f} s), GPU busy "
                  f"{s['gpu_busy_fraction']:.0%}, mean batch {s['mean_batch']:.0f}")
            if "each" in s:
                print("      tokens: wall ms  " + ", ".join(f"{e['tokens']}: {e['wall_ms']:.0f}" for e in s["each"]))
    if tp > 1:
        print(f"  {tp} GPUs: roofline per GPU with {roof['all_reduce_s']:.2f} s of all-reduces measured in this run; "
              f"{result['all_reduce_ms_per_decode_step']:.2f} ms of all-reduce per decode step at the mean batch")
    for peer in results[len(runs):]:
        print(f"  {peer['name']} on the first {peer['requests']} requests: {peer['tok_s']:.0f} tok/s "
              f"({peer['elapsed_s']:.1f} s)")


if __name__ == "__main__":
    main()
