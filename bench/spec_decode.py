"""Speculative decoding with n-gram proposals against none, on an input-grounded workload, same run.

    python bench/spec_decode.py                          # the default model, float32, one stream then 8 at once
    python bench/spec_decode.py --quantization default   # from its Q4_1 blocks
    python bench/spec_decode.py --model DIR --num-prompts 32 --concurrency 1 8 32

The workload asks a chat model to copy or lightly edit a paragraph it is given (paragraphs of
tests/data/apache-2.0.txt, or --text), so its answers repeat spans of its prompt: where prompt lookup has
something to find. Greedy decoding, so both engines produce the same tokens (the script checks it). For each
concurrency: output tok/s, time per output token per request (TPOT), and the proposals' acceptance.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402

TASKS = [
    "Repeat the following paragraph exactly, word for word:\n\n{}",
    "Rewrite the following paragraph with every occurrence of 'License' replaced by 'Agreement', changing nothing "
    "else:\n\n{}",
    "Copy the following text, then stop:\n\n{}",
]


def workload(text: str, num_prompts: int) -> list[list[dict]]:
    paragraphs = [p.strip() for p in text.split("\n\n") if 200 < len(p.strip()) < 900]
    return [[{"role": "user", "content": TASKS[i % len(TASKS)].format(paragraphs[i % len(paragraphs)])}]
            for i in range(num_prompts)]


def run(llm: LLM, conversations, params: SamplingParams, concurrency: int) -> dict:
    """The conversations in waves of ``concurrency`` (each wave runs to its end)."""
    outputs, start = [], time.perf_counter()
    for i in range(0, len(conversations), concurrency):
        outputs += llm.chat(conversations[i:i + concurrency], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [len(o.outputs[0].token_ids) for o in outputs]
    return {"elapsed_s": elapsed, "tokens": [o.outputs[0].token_ids for o in outputs],
            "tok_s": sum(tokens) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model directory (default: the embedded default model)")
    parser.add_argument("--quantization", default="none", help="'none' (float32 on the CPU) or 'default'")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "tests/data/apache-2.0.txt"))
    args = parser.parse_args()

    conversations = workload(Path(args.text).read_text(), args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    quantization = None if args.quantization == "default" else args.quantization
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
                   "prompt_lookup_max": args.lookup_max}
    results = {}
    for name, extra in (("plain", {}), ("ngram", {"speculative_config": spec_config})):
        with LLM(model=args.model, quantization=quantization, max_model_len=2048, **extra) as llm:
            run(llm, conversations[:1], SamplingParams(temperature=0.0, max_tokens=8), 1)  # warm-up
            for concurrency in args.concurrency:
                proposer = llm.engine.proposer
                before = (proposer.num_draft_tokens, proposer.num_accepted_tokens, proposer.num_drafts) \
                    if proposer is not None else None
                result = run(llm, conversations, params, concurrency)
                if proposer is not None:
                    drafted = proposer.num_draft_tokens - before[0]
                    accepted = proposer.num_accepted_tokens - before[1]
                    drafts = proposer.num_drafts - before[2]
                    result["acceptance"] = accepted / drafted if drafted else 0.0
                    result["accepted_per_draft"] = accepted / drafts if drafts else 0.0
                results[name, concurrency] = result
    print(f"{args.num_prompts} prompts, k={args.k}, lookup {args.lookup_min}-{args.lookup_max}, "
          f"quantization={args.quantization}")
    print("| in flight | plain tok/s | ngram tok/s | speed-up | acceptance | accepted per draft |")
    print("|---|---|---|---|---|---|")
    for concurrency in args.concurrency:
        plain, ngram = results["plain", concurrency], results["ngram", concurrency]
        same = plain["tokens"] == ngram["tokens"]
        print(f"| {concurrency} | {plain['tok_s']:.1f} | {ngram['tok_s']:.1f} | {ngram['tok_s'] / plain['tok_s']:.2f}x"
              f" | {ngram['acceptance']:.1%} | {ngram['accepted_per_draft']:.2f} |"
              + ("" if same else " (outputs differ)"))


if __name__ == "__main__":
    main()
