"""Speculative decoding at forced acceptance rates: what verification costs when nothing is accepted, and where it
breaks even, against no speculation on the same requests, dummy weights in a real shape, one invocation.

    python bench/spec_forced.py --shape llama-3.1-8b --rates 0 0.25 0.5 0.75 1 --concurrency 1 8 32

As llama.cpp's synthetic draft rates do: the engine first runs the requests without speculation (greedy, EOS
ignored), which gives each request's tokens. Then, with n-gram speculation's machinery (``k`` proposals a step,
verified by the target), the proposer is replaced by one that proposes each request's next true token with
probability ``rate`` and a wrong one otherwise, position by position: a draft is accepted up to its first wrong
proposal, so ``rate`` 0 measures the pure cost of verifying k proposals and 1 the upper bound of k + 1 tokens a
step. The low-acceptance pause is bypassed, so that a rate of 0 keeps proposing. Per run: output tok/s, TPOT (wall time
of a wave over its tokens per request), the measured acceptance, and whether the tokens are the same.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_draft import add_arguments, run, setup  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def force(llm: LLM, truth: dict[tuple[int, ...], list[int]], rate: float, k: int, vocab: int, seed: int) -> None:
    """Replace the engine's proposer's proposals by the true next tokens, each kept with probability ``rate``."""
    proposer = llm.engine.proposer
    rng = random.Random(seed)

    def propose(running) -> None:
        for request in running:
            decoding = request.num_computed_tokens == request.num_tokens - 1 and not request.num_placeholders
            if not decoding:
                request.spec_token_ids = []
                continue
            done = request.num_tokens - request.num_prompt_tokens
            upcoming = truth[tuple(request.prompt_token_ids)][done:done + k]
            request.spec_token_ids = [t if rng.random() < rate else (t + 1) % vocab for t in upcoming]

    proposer.propose = propose  # (the low-acceptance pause lives in the proposer's own propose: not here)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, concurrency=[1, 8, 32], num_prompts=32)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    args = parser.parse_args()
    prompts, params, target, common = setup(args)
    results = {}
    with LLM(str(target), **common) as llm:
        run(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), 1)  # warm-up
        for concurrency in args.concurrency:
            results["none", concurrency] = run(llm, prompts, params, concurrency)
        vocab = llm.engine.model_config.vocab_size
    truth = {tuple(p): t for p, t in zip(prompts, results["none", args.concurrency[0]]["tokens"])}
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    with LLM(str(target), **common, speculative_config=spec) as llm:
        run(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), 1)  # warm-up
        for rate in args.rates:
            force(llm, truth, rate, args.k, vocab, seed=int(rate * 1000))
            for concurrency in args.concurrency:
                proposer = llm.engine.proposer
                before = (proposer.num_draft_tokens, proposer.num_accepted_tokens)
                result = run(llm, prompts, params, concurrency)
                drafted = proposer.num_draft_tokens - before[0]
                result["acceptance"] = (proposer.num_accepted_tokens - before[1]) / max(drafted, 1)
                results[rate, concurrency] = result
                print(f"  rate {rate:.2f} x{concurrency}: {result['tok_s']:.0f} tok/s, TPOT {result['tpot_ms']:.2f} "
                      f"ms, acceptance {result['acceptance']:.1%}", flush=True)
    print(f"{args.shape}, k={args.k}, prompts of {args.prompt_len} tokens, {args.max_tokens} out")
    print("| forced rate | in flight | tok/s | TPOT ms | against none | acceptance | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for (rate, concurrency), r in results.items():
        base = results["none", concurrency]
        label = "none" if rate == "none" else f"{rate:.2f}"
        print(f"| {label} | {concurrency} | {r['tok_s']:.0f} | {r['tpot_ms']:.2f} | {r['tok_s'] / base['tok_s']:.2f}x"
              f" | {r.get('acceptance', 0):.1%} | {r['tokens'] == base['tokens']} |")


if __name__ == "__main__":
    main()
