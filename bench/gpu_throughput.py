"""GPU throughput on a real model shape with dummy weights, against the roofline and a peer.

    python bench/gpu_throughput.py --shape qwen3-0.6b --workload W1 --peer-requests 64
    python bench/gpu_throughput.py --shape llama-3.1-8b --workload W1 --peer-requests 0

Measures copy bandwidth and matmul rate in the same run, computes the workload's
roofline from them, runs minivllm (bf16, Triton attention, CUDA graphs), reports the
fraction of the roofline achieved and the per-step host/device time, then runs
transformers' continuous batching on the first N requests as the peer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import git_commit  # noqa: E402
from peers import run_transformers_cb  # noqa: E402
from roofline import measure_ceilings, model_costs, roofline  # noqa: E402
from workloads import WORKLOADS, shape_dir  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def run_minivllm(model_dir: Path, prompts, output_lens, args) -> tuple[dict, LLM]:
    llm = LLM(str(model_dir), load_format="dummy", max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling)
    warm = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 4
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.engine.measure_steps(True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == sum(output_lens)
    return {"name": "minivllm", "elapsed_s": elapsed, "output_tokens": num_out, "tok_s": num_out / elapsed,
            "preemptions": llm.engine.stats().num_preemptions, "async_scheduling": llm.engine.async_scheduling,
            "steps_planned_ahead": llm.engine.num_steps_planned_ahead,
            "steps": step_summary(llm)}, llm


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
    return out


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
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    model_dir = shape_dir(args.shape)
    workload = WORKLOADS[args.workload]
    from engine.model_config import ModelConfig

    config = ModelConfig.from_pretrained(model_dir)
    prompts, output_lens = workload.sample(config.vocab_size)
    if args.num_requests:
        prompts, output_lens = prompts[: args.num_requests], output_lens[: args.num_requests]

    ceil = measure_ceilings(torch.device("cuda"))
    result, llm = run_minivllm(model_dir, prompts, output_lens, args)
    costs = model_costs(llm.engine.runner.model, config)
    roof = roofline([len(p) for p in prompts], output_lens, costs, ceil, config.vocab_size, config.hidden_size)
    del llm
    torch.cuda.empty_cache()
    results = [result]
    if args.peer_requests:
        n = args.peer_requests
        results.append(run_peer(model_dir, prompts[:n], output_lens[:n]))

    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": git_commit(), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "shape": args.shape, "workload": workload.__dict__,
              "num_requests": len(prompts), "ceilings": ceil.__dict__, "roofline": roof, "results": results}
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "_sync" if args.async_scheduling is False else ""
    (out_dir / f"gpu_{args.shape}_{workload.name}{suffix}.json").write_text(json.dumps(record, indent=2))
    print(f"\n{args.shape} {workload.name} ({len(prompts)} requests, {sum(output_lens)} output tokens) on "
          f"{record['gpu']}, commit {record['commit']}")
    print(f"  ceilings: copy {ceil.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s; roofline {roof['tok_s']:.0f} tok/s "
          f"(prefill {roof['prefill_s']:.2f} s + decode {roof['decode_s']:.2f} s)")
    print(f"  minivllm: {result['tok_s']:.0f} tok/s in {result['elapsed_s']:.1f} s = "
          f"{result['tok_s'] / roof['tok_s']:.1%} of the roofline; preemptions {result['preemptions']}, "
          f"steps planned ahead {result['steps_planned_ahead']}")
    for kind, s in result["steps"].items():
        print(f"    {kind}: {s['steps']} steps, median host {s['host_ms_median']:.2f} ms, device "
              f"{s['device_ms_median']:.2f} ms, wall {s['wall_ms_median']:.2f} ms (max {s['wall_ms_max']:.1f}, "
              f"total {s['wall_s_total']:.2f} s), GPU busy "
              f"{s['gpu_busy_fraction']:.0%}, mean batch {s['mean_batch']:.0f}")
    for peer in results[1:]:
        print(f"  {peer['name']} on the first {peer['requests']} requests: {peer['tok_s']:.0f} tok/s "
              f"({peer['elapsed_s']:.1f} s)")


if __name__ == "__main__":
    main()
