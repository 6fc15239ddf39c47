"""Throughput with many LoRA adapters: the base model alone against the same requests spread over N adapters.

    python bench/lora_throughput.py --shape llama-3.1-8b                     # N = 1, 4, 16, 64; --max-loras 16
    python bench/lora_throughput.py --shape qwen3-0.6b --adapters 1 16 --rank 16 --num-requests 64

The model is a real shape with dummy weights (``bench/workloads.py``); the adapters are random rank-``--rank``
PEFT adapters on all seven projections of every layer, written once to a temporary directory (A and B of a
magnitude that changes the outputs, as a trained adapter would). Request i runs under adapter i mod N, all of W1's
requests at once. The engine with ``enable_lora`` runs each N on the same requests after the base model without
LoRA, in one invocation; reported per run: output tokens/s, its ratio to the base model's, mean TPOT (time per
output token after the first, per request), and the slots' loads and evictions. Writes a JSON record to bench/out/.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import MODEL_SHAPES, WORKLOADS, Workload, shape_dir  # noqa: E402

from engine import LLM, LoRARequest, SamplingParams  # noqa: E402

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapters(shape: dict, count: int, rank: int, root: Path) -> list[Path]:
    """``count`` random PEFT adapters of ``shape`` (adapter_config.json and adapter_model.safetensors)."""
    from safetensors.torch import save_file

    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape.get("head_dim", hidden // shape["num_attention_heads"])
    kv = shape["num_key_value_heads"] * shape.get("head_dim", hidden // shape["num_attention_heads"])
    dims = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    paths = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for i in range(count):
        gen = torch.Generator(device).manual_seed(i)

        def random(rows: int, cols: int, fan_in: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen, device=device) / fan_in**0.5).bfloat16().cpu()

        tensors = {}
        for layer in range(shape["num_hidden_layers"]):
            for block, names in PROJECTIONS.items():
                for name in names:
                    n_in, n_out = dims[name]
                    prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                    tensors[f"{prefix}.lora_A.weight"] = random(rank, n_in, n_in)
                    tensors[f"{prefix}.lora_B.weight"] = random(n_out, rank, rank)
        path = root / f"adapter{i}"
        path.mkdir()
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(dims), "bias": "none"}))
        paths.append(path)
    return paths


def run(llm: LLM, prompts, output_lens, adapters: list[LoRARequest] | None) -> dict:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    lora = [adapters[i % len(adapters)] for i in range(len(prompts))] if adapters else None
    warm = lora[: len(adapters)] if lora else None  # every adapter read from disk once before the clock starts
    llm.generate([{"prompt_token_ids": p[:32]} for p in prompts[: len(warm or [0])]],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False, lora_request=warm)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    tpots = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
             for o in outputs if len(o.outputs[0].token_ids) > 1]
    stats = llm.engine.stats().lora
    return {"adapters": len(adapters) if adapters else 0, "elapsed_s": elapsed, "output_tokens": num_out,
            "tok_s": num_out / elapsed, "mean_tpot_ms": 1000 * sum(tpots) / len(tpots),
            "loads": stats.num_loads if stats else 0, "evictions": stats.num_evictions if stats else 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=None)
    args = parser.parse_args()

    shape = MODEL_SHAPES[args.shape]
    w1 = WORKLOADS["W1"]
    workload = Workload(w1.name, args.num_requests or w1.num_requests, w1.prompt_len, w1.output_len, w1.seed)
    prompts, output_lens = workload.sample(shape["vocab_size"])
    model = str(shape_dir(args.shape))
    common = dict(load_format="dummy", max_model_len=2048)
    root = Path(tempfile.mkdtemp(prefix="minivllm-lora-"))
    start = time.perf_counter()
    paths = write_adapters(shape, max(args.adapters), args.rank, root)
    print(f"{len(paths)} rank-{args.rank} adapters written in {time.perf_counter() - start:.0f} s", flush=True)
    adapters = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]

    print(f"{torch.cuda.get_device_name()}  {args.shape}  W1 {workload.num_requests} requests  rank {args.rank}  "
          f"max_loras {args.max_loras}", flush=True)
    rows = []

    def report(row: dict) -> None:  # each run as it ends
        rows.append(row)
        row["ratio"] = row["tok_s"] / rows[0]["tok_s"]
        label = "base model (no LoRA)" if not row["adapters"] else f"{row['adapters']:3d} adapters"
        print(f"  {label:22s} {row['tok_s']:8.0f} tok/s  {row['ratio']:.2f}x  TPOT {row['mean_tpot_ms']:6.2f} ms  "
              f"loads {row['loads']}  evictions {row['evictions']}", flush=True)

    llm = LLM(model, **common)
    report(run(llm, prompts, output_lens, None))
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(model, enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank,
              max_cpu_loras=max(args.adapters), **common)
    for n in args.adapters:
        report(run(llm, prompts, output_lens, adapters[:n]))
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / f"lora_throughput_{int(time.time())}.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "shape": args.shape, "rank": args.rank,
         "max_loras": args.max_loras, "rows": rows}, indent=2))
    llm.shutdown()


if __name__ == "__main__":
    main()
