"""Offline throughput: minivllm against transformers' continuous batching, same prompts, same run.

    python bench/offline_throughput.py                      # C1 on the default model (CPU, float32)
    python bench/offline_throughput.py --quantization gguf  # then again from its Q4_1 blocks (`make bench`)
    python bench/offline_throughput.py --peer none          # minivllm only
    python bench/offline_throughput.py --peer sequential    # also plain generate, batch 1, one after another

The first run dequantizes the model (``--quantization none``: float32 on the CPU), as this benchmark has always
measured it; ``--quantization gguf`` adds a run from a GGUF model's blocks, which is what the engine serves the
default model from when ``--quantization`` is unset. Prints output tokens/s of each, and their ratio, and writes a
JSON record to bench/out/.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import run_transformers_cb  # noqa: E402
from workloads import WORKLOADS, Workload  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def run_minivllm(model: str | None, prompts, output_lens, **engine_kwargs) -> dict:
    llm = LLM(model=model, **engine_kwargs)
    warm = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * min(2, len(prompts))
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == sum(output_lens), "every request must produce exactly its output length"
    return {"name": "minivllm", "elapsed_s": elapsed, "output_tokens": num_out, "tok_s": num_out / elapsed,
            "preemptions": llm.engine.stats().num_preemptions}


def _hf_model(model_path: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def run_hf_continuous_batching(model_path: str, prompts, output_lens, dtype, device) -> dict:
    return run_transformers_cb(_hf_model(model_path, dtype, device), prompts, output_lens)


def run_hf_sequential(model_path: str, prompts, output_lens, dtype, device) -> dict:
    """Plain ``generate`` at batch 1, one request after another."""
    model = _hf_model(model_path, dtype, device)
    num_out = 0
    start = time.perf_counter()
    for prompt, n in zip(prompts, output_lens):
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        num_out += out.shape[1] - ids.shape[1]
    elapsed = time.perf_counter() - start
    return {"name": "transformers-generate-bs1", "elapsed_s": elapsed, "output_tokens": num_out,
            "tok_s": num_out / elapsed}


def git_commit() -> str:
    """The checkout's short commit, with "-dirty" where tracked files differ from it (the tree measured is then not
    that commit's), or $MINIVLLM_COMMIT where the tree is a copy without .git."""
    if os.environ.get("MINIVLLM_COMMIT"):
        return os.environ["MINIVLLM_COMMIT"]
    here = Path(__file__).parent
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, cwd=here).strip()
        changed = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], text=True,
                                          cwd=here).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}-dirty" if changed else commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="C1", choices=sorted(WORKLOADS))
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded default model)")
    parser.add_argument("--peer", default="cb", choices=["cb", "sequential", "both", "none"])
    parser.add_argument("--num-requests", type=int, default=None, help="override the workload's request count")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--quantization", nargs="*", default=[], choices=["gguf"],
                        help="also run with these --quantization settings, after the dequantized one (gguf: the "
                             "default model's, or a GGUF --model's, Q4/Q8 weights kept quantized, as the engine "
                             "serves them by default)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from engine.config import EngineConfig
    from engine.core.llm_engine import resolve_model_path

    model_path = args.model or resolve_model_path(EngineConfig())
    workload = WORKLOADS[args.workload]
    if args.num_requests:
        workload = Workload(workload.name, args.num_requests, workload.prompt_len, workload.output_len, workload.seed)
    from engine.loading.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_path).vocab_size
    prompts, output_lens = workload.sample(vocab)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    results = [{**run_minivllm(model_path, prompts, output_lens, max_num_batched_tokens=args.max_num_batched_tokens,
                               quantization="none"), "name": "minivllm --quantization none"}]
    for quantization in args.quantization:  # the model as given (None: the default model, its GGUF found again)
        run = run_minivllm(args.model, prompts, output_lens, max_num_batched_tokens=args.max_num_batched_tokens,
                           quantization=quantization)
        results.append({**run, "name": f"minivllm --quantization {quantization}"})
    if args.peer in ("cb", "both"):
        results.append(run_hf_continuous_batching(model_path, prompts, output_lens, dtype, device))
    if args.peer in ("sequential", "both"):
        results.append(run_hf_sequential(model_path, prompts, output_lens, dtype, device))

    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "commit": git_commit(), "workload": workload.__dict__,
        "model": model_path, "device": device, "dtype": str(dtype), "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads" if device == "cpu"
        else torch.cuda.get_device_name(), "results": results,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"offline_{workload.name}_{int(time.time())}.json").write_text(json.dumps(record, indent=2))
    print(f"\nworkload {workload.name}: {workload.num_requests} requests, prompts {workload.prompt_len}, "
          f"outputs {workload.output_len}, {sum(output_lens)} output tokens; {record['machine']}; commit {record['commit']}")
    base = results[0]["tok_s"]
    for r in results:
        ratio = "" if r is results[0] else (f"   {r['tok_s'] / base:.2f}x minivllm" if r["name"].startswith("minivllm")
                                             else f"   minivllm is {base / r['tok_s']:.1f}x")
        print(f"  {r['name']:<28} {r['tok_s']:9.1f} output tok/s  ({r['elapsed_s']:.1f} s){ratio}")


if __name__ == "__main__":
    main()
