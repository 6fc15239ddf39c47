"""The cost of scoring (prompt logprobs) and of beam search, each against the plain run of the same requests.

    python bench/scoring_and_beams.py --shape qwen3-0.6b --tokenizer DIR   # GPU, dummy weights
    python bench/scoring_and_beams.py --num-requests 16                    # CPU, the default model

Scoring: W1's prompts (C1's on the CPU) with one new token each, as lm-evaluation-harness scores a
log-likelihood (``echo`` with ``logprobs=1``): plain, then with ``prompt_logprobs=1``; prompt tokens per
second of both and their ratio. Beams: a quarter of the prompts with 128 new tokens (EOS ignored), as
4 sampled choices each, then as beam search of width 4; returned tokens per second of both and their
ratio. Writes a JSON record to $OUT or bench/out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from workloads import model_and_workload  # noqa: E402

BEAM_WIDTH = 4
BEAM_TOKENS = 128


def timed(llm, prompts, params) -> tuple[float, list]:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", BENCH / "out")))
    args = parser.parse_args()

    import torch
    from offline_throughput import git_commit

    from engine import LLM, SamplingParams

    on_cuda = torch.cuda.is_available()
    model, kwargs, workload = model_and_workload(args.shape, args.tokenizer, args.num_requests, on_cuda)
    # No prefix caching in either run: a scored request computes its whole prompt, so the plain run does too.
    llm = LLM(model, max_model_len=4096, enable_prefix_caching=False, **kwargs)
    prompts, _ = workload.sample(min(llm.engine.model_config.vocab_size, len(llm.tokenizer)))
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(max_tokens=2), use_tqdm=False)

    num_prompt_tokens = sum(len(p) for p in prompts)
    plain_s, _ = timed(llm, prompts, SamplingParams(temperature=0.0, max_tokens=1))
    scored_s, scored = timed(llm, prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(scored, prompts))

    few = prompts[: max(1, len(prompts) // 4)]
    sampled_s, sampled = timed(llm, few, SamplingParams(n=BEAM_WIDTH, temperature=1.0, seed=0,
                                                        max_tokens=BEAM_TOKENS, ignore_eos=True))
    beams_s, beams = timed(llm, few, SamplingParams(n=BEAM_WIDTH, use_beam_search=True, max_tokens=BEAM_TOKENS,
                                                    ignore_eos=True))
    sampled_tokens = sum(len(c.token_ids) for o in sampled for c in o.outputs)
    beam_tokens = sum(len(c.token_ids) for o in beams for c in o.outputs)

    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "commit": git_commit(), "model": args.shape or Path(model).name,
        "machine": torch.cuda.get_device_name() if on_cuda else "cpu", "workload": workload.name,
        "scoring": {"num_requests": len(prompts), "prompt_tokens": num_prompt_tokens,
                    "plain_tok_s": num_prompt_tokens / plain_s, "prompt_logprobs_tok_s": num_prompt_tokens / scored_s},
        "beams": {"num_requests": len(few), "width": BEAM_WIDTH, "max_tokens": BEAM_TOKENS,
                  "sampled_tok_s": sampled_tokens / sampled_s, "beam_search_tok_s": beam_tokens / beams_s,
                  "preemptions": llm.engine.scheduler.num_preemptions_total},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"scoring_and_beams_{record['model']}.json").write_text(json.dumps(record, indent=2))
    s, b = record["scoring"], record["beams"]
    print(f"\n{record['model']} on {record['machine']}, commit {record['commit']}")
    print(f"  scoring, {s['num_requests']} prompts ({s['prompt_tokens']} tokens), one new token each: plain "
          f"{s['plain_tok_s']:.0f} prompt tok/s, with prompt_logprobs=1 {s['prompt_logprobs_tok_s']:.0f} "
          f"= {s['prompt_logprobs_tok_s'] / s['plain_tok_s']:.1%} of plain")
    print(f"  beams, {b['num_requests']} prompts x {BEAM_WIDTH} x {BEAM_TOKENS} tokens: {BEAM_WIDTH} sampled choices "
          f"{b['sampled_tok_s']:.0f} tok/s, beam search {b['beam_search_tok_s']:.0f} tok/s = "
          f"{b['beam_search_tok_s'] / b['sampled_tok_s']:.1%} of sampled")


if __name__ == "__main__":
    main()
