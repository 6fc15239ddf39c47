"""Structured output's cost: the same requests unconstrained, then with half of them under a JSON schema.

    python bench/structured_output.py --shape qwen3-0.6b --tokenizer DIR     # GPU, dummy weights
    python bench/structured_output.py --num-requests 32                      # CPU, the default model

Greedy, EOS ignored; the schema's one string property is unbounded, so the constrained requests run
to their max_tokens like the others (their JSON is then cut off: finish "length"). Prints output
tok/s of both runs and their ratio, the unconstrained half's TPOT in both, and grammar compile
times (the first compile, then the cached ones). Writes a JSON record to $OUT or bench/out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from workloads import model_and_workload  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def run(llm, prompts, params) -> tuple[float, list]:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def step_medians(llm) -> dict:
    """Median host, device and wall time (ms) of the run's decode steps, with the wall time's mean and
    p99 and the number of steps (a few slow steps hide from a median)."""
    timings = llm.engine.step_timings
    steps = [t for t in timings if t.num_tokens == t.num_reqs]
    out = {k: float(np.median([getattr(t, f"{k}_s") for t in steps]) * 1e3) for k in ("host", "device", "wall")}
    walls = np.array([t.wall_s for t in steps]) * 1e3
    out.update(wall_mean=float(walls.mean()), wall_p99=float(np.percentile(walls, 99)), decode_steps=len(steps),
               all_steps=len(timings), all_steps_wall_s=float(sum(t.wall_s for t in timings)))
    return out


def tpot_ms(outputs, rows) -> float:
    values = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
              for i, o in enumerate(outputs) if i in rows and len(o.outputs[0].token_ids) > 1]
    return float(np.median(values) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", BENCH / "out")))
    parser.add_argument("--profile", action="store_true", help="cProfile the constrained run (host time): "
                        "prints the top functions and writes structured_output.pstats beside the record")
    args = parser.parse_args()

    import torch
    from offline_throughput import git_commit

    from engine import LLM, SamplingParams
    from engine.sampling_params import StructuredOutputsParams

    on_cuda = torch.cuda.is_available()
    model, kwargs, workload = model_and_workload(args.shape, args.tokenizer, args.num_requests, on_cuda)
    llm = LLM(model, max_model_len=4096, **kwargs)
    prompts, output_lens = workload.sample(min(llm.engine.model_config.vocab_size, len(llm.tokenizer)))
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    half = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, structured_outputs=spec if i % 2 == 0
                           else None) for i, n in enumerate(output_lens)]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], free[:4], use_tqdm=False)  # warm-up

    llm.engine.measure_steps(True)
    free_s, free_out = run(llm, prompts, free)
    free_steps = step_medians(llm)
    llm.engine.measure_steps(True)
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
    half_s, half_out = run(llm, prompts, half)
    if args.profile:
        profiler.disable()
        args.out.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(args.out / "structured_output.pstats"))
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    half_steps = step_medians(llm)
    constrained, unconstrained = set(range(0, len(prompts), 2)), set(range(1, len(prompts), 2))
    tokens = [sum(len(o.outputs[0].token_ids) for o in outs) for outs in (free_out, half_out)]
    valid_prefix = sum(half_out[i].outputs[0].text.startswith('{"text"') or half_out[i].outputs[0].text.startswith("{")
                       for i in constrained)
    compile_s = list(llm.engine.grammars.compile_seconds)
    # The same tokens fed again into fresh matchers, alone: what an accept costs outside the engine's step.
    import xgrammar as xgr

    compiled = llm.engine.grammars.compiler.compile_json_schema(spec.json, strict_mode=spec.strict,
                                                                 max_whitespace_cnt=32)
    replay = [half_out[i].outputs[0].token_ids for i in sorted(constrained)]
    matchers = [xgr.GrammarMatcher(compiled) for _ in replay]
    buckets = {"0-127": [0.0, 0], "128-511": [0.0, 0], "512+": [0.0, 0]}  # by position in the output
    start, fed = time.perf_counter(), 0
    for position in range(max(len(r) for r in replay)):
        bucket = buckets["0-127" if position < 128 else "128-511" if position < 512 else "512+"]
        t0 = time.perf_counter()
        for matcher, token_ids in zip(matchers, replay):
            if position < len(token_ids) and not matcher.is_terminated():
                matcher.accept_token(token_ids[position])
                fed += 1
                bucket[1] += 1
        bucket[0] += time.perf_counter() - t0
    replay_us = (time.perf_counter() - start) / max(fed, 1) * 1e6
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "commit": git_commit(), "model": args.shape or Path(model).name,
        "machine": torch.cuda.get_device_name() if on_cuda else "cpu", "num_requests": len(prompts),
        "unconstrained": {"elapsed_s": free_s, "tokens": tokens[0], "tok_s": tokens[0] / free_s,
                          "tpot_ms_odd_half": tpot_ms(free_out, unconstrained)},
        "half_json_schema": {"elapsed_s": half_s, "tokens": tokens[1], "tok_s": tokens[1] / half_s,
                             "tpot_ms_unconstrained_half": tpot_ms(half_out, unconstrained),
                             "tpot_ms_constrained_half": tpot_ms(half_out, constrained),
                             "constrained_outputs_opening_json": valid_prefix},
        "decode_step_ms": {"unconstrained": free_steps, "half_json_schema": half_steps},
        "mask_fill_ms_median": float(np.median(llm.engine.grammars.fill_seconds) * 1e3),
        "grammar_accept_ms_median": float(np.median(llm.engine.grammars.accept_seconds) * 1e3),
        "accept_us_replayed_alone": replay_us,
        "accept_us_replayed_by_position": {k: t / max(n, 1) * 1e6 for k, (t, n) in buckets.items()},
        "sample_constrained_output": half_out[0].outputs[0].text[:300],
        "compile_ms": {"first": compile_s[0] * 1e3, "cached_median": float(np.median(compile_s[1:]) * 1e3)
                       if len(compile_s) > 1 else None, "count": len(compile_s)},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"structured_output_{record['model']}.json").write_text(json.dumps(record, indent=2))
    u, h = record["unconstrained"], record["half_json_schema"]
    print(f"\n{record['model']} {workload.name} ({len(prompts)} requests) on {record['machine']}, commit {record['commit']}")
    print(f"  unconstrained:        {u['tok_s']:8.0f} tok/s ({u['tokens']} tokens in {u['elapsed_s']:.2f} s)")
    print(f"  half with JSON schema:{h['tok_s']:8.0f} tok/s ({h['tokens']} tokens in {h['elapsed_s']:.2f} s) = "
          f"{h['tok_s'] / u['tok_s']:.1%} of unconstrained")
    print(f"  TPOT p50 of the unconstrained half: {u['tpot_ms_odd_half']:.2f} ms alone, "
          f"{h['tpot_ms_unconstrained_half']:.2f} ms beside constrained requests; constrained half "
          f"{h['tpot_ms_constrained_half']:.2f} ms")
    print(f"  decode step (median ms host/device/wall): unconstrained {free_steps}, half {half_steps}; "
          f"mask fill {record['mask_fill_ms_median']:.2f} ms, tokens into grammars "
          f"{record['grammar_accept_ms_median']:.2f} ms per step (medians)")
    by_position = ", ".join(f"{k}: {v:.1f}" for k, v in record["accept_us_replayed_by_position"].items())
    print(f"  the constrained outputs' tokens replayed into fresh matchers: {replay_us:.1f} us per accept "
          f"(by position {by_position}); a sample: "
          f"{record['sample_constrained_output'][:160]!r}")
    print(f"  grammar compile: first {record['compile_ms']['first']:.1f} ms, cached "
          f"{record['compile_ms']['cached_median']} ms (x{record['compile_ms']['count']})")


if __name__ == "__main__":
    main()
