"""Speculative decoding with a draft model against none, dummy weights in real shapes, one invocation.

    python bench/spec_draft.py --shape llama-3.1-8b --draft same llama-3.2-1b --concurrency 1 8

``--draft same`` is the target's own shape, whose dummy weights (same seed) are the target's: every proposal the
target's argmax, so acceptance is ~100% (bfloat16 near-ties aside) and the speed-up is the upper bound of k proposals
a step. A draft of another shape has other random weights: its proposals are almost never accepted, which measures
what speculation costs when it gains nothing. Greedy, EOS ignored, random prompts of ``--prompt-len`` tokens,
``--max-tokens`` each; the requests of each concurrency run in waves of that many. Per run: output tok/s, the time
per output token of a request (TPOT: wall time of a wave over its tokens per request) and the acceptance.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workloads import shape_dir  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict:
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outputs += llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + concurrency]], params,
                                use_tqdm=False)
    elapsed = time.perf_counter() - start
    waves = -(-len(prompts) // concurrency)
    return {"tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
            "tpot_ms": 1000 * elapsed / waves / params.max_tokens, "tokens": [o.outputs[0].token_ids for o in outputs]}


def add_arguments(parser: argparse.ArgumentParser, concurrency: list[int], num_prompts: int) -> None:
    """The options spec_draft.py and spec_forced.py share."""
    parser.add_argument("--shape", default="llama-3.1-8b", help="a shape of bench/workloads.py, or a model directory")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--concurrency", type=int, nargs="+", default=concurrency)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--tokenizer", default=None, help="any tokenizer directory (the prompts are token ids)")


def setup(args: argparse.Namespace) -> tuple[list[list[int]], SamplingParams, Path, dict]:
    """(prompts, their sampling params, the target's directory, the LLM arguments every engine takes)."""
    print(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", f"torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (args.prompt_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    target = Path(args.shape) if Path(args.shape).is_dir() else shape_dir(args.shape)
    common = dict(load_format="dummy", max_model_len=args.prompt_len + args.max_tokens + 64, seed=0,
                  tokenizer=args.tokenizer)
    return prompts, params, target, common


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, concurrency=[1, 8], num_prompts=8)
    parser.add_argument("--draft", nargs="+", default=["same", "llama-3.2-1b"])
    args = parser.parse_args()
    prompts, params, target, common = setup(args)
    results = {}
    for draft in ["none", *args.draft]:
        extra = {}
        if draft != "none":
            draft_dir = target if draft == "same" else Path(draft) if Path(draft).is_dir() else shape_dir(draft)
            extra = {"speculative_config": {"model": str(draft_dir), "num_speculative_tokens": args.k}}
        with LLM(str(target), **common, **extra) as llm:
            run(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), 1)  # warm-up
            for concurrency in args.concurrency:
                proposer = llm.engine.proposer
                before = (proposer.num_draft_tokens, proposer.num_accepted_tokens) if proposer else (0, 0)
                result = run(llm, prompts, params, concurrency)
                if proposer is not None:
                    drafted = proposer.num_draft_tokens - before[0]
                    result["acceptance"] = (proposer.num_accepted_tokens - before[1]) / max(drafted, 1)
                results[draft, concurrency] = result
                print(f"  {draft} x{concurrency}: {result['tok_s']:.0f} tok/s, TPOT {result['tpot_ms']:.2f} ms"
                      + (f", acceptance {result['acceptance']:.1%}" if "acceptance" in result else ""), flush=True)
    print(f"{args.shape}, k={args.k}, prompts of {args.prompt_len} tokens, {args.max_tokens} out")
    print("| draft | in flight | tok/s | TPOT ms | against none | acceptance | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for (draft, concurrency), r in results.items():
        base = results["none", concurrency]
        print(f"| {draft} | {concurrency} | {r['tok_s']:.0f} | {r['tpot_ms']:.2f} | {r['tok_s'] / base['tok_s']:.2f}x"
              f" | {r.get('acceptance', 0):.1%} | {r['tokens'] == base['tokens']} |")


if __name__ == "__main__":
    main()
