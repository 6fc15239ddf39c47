"""One stream's time per output token on the CPU, in process: the eager decode step against ``--compile``.

    python bench/cpu_one_stream.py                       # the default model (its Q4_1 blocks), three rounds
    python bench/cpu_one_stream.py --rounds 5 --quantization none

Both engines are built in one process (the start-up of each is reported: ``--compile`` compiles its graphs then,
or reads them from inductor's disk cache), then measured in alternation, round by round, so that a noisy machine
weighs on both alike. One 256-token prompt of random token ids, greedy, EOS ignored; TPOT = (time of a 66-token run
- time of a 2-token run) / 64, so the prompt's prefill and the first token cancel out. Each round takes three such
differences per engine; the medians are reported, and the two engines' tokens are compared.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402


def tpot_ms(llm: LLM, prompt: list[int], runs: int) -> tuple[list[float], list[int]]:
    def timed(n: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start, out[0].outputs[0].token_ids

    timed(66)  # warm-up
    times, tokens = [], []
    for _ in range(runs):
        short, _ = timed(2)
        long, tokens = timed(66)
        times.append(1000 * (long - short) / 64)
    return times, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="differences per engine and round")
    parser.add_argument("--quantization", default=None, help="as the engine's (default: what the model says)")
    args = parser.parse_args()

    engines = {}
    for name, compile_ in (("eager", False), ("--compile", True)):
        start = time.perf_counter()
        engines[name] = LLM(compile=compile_, quantization=args.quantization)
        print(f"{name}: start-up {time.perf_counter() - start:.1f} s", flush=True)
    prompt = torch.randint(1000, 40000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    medians: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    for round_ in range(args.rounds):
        for name, llm in engines.items():
            times, tokens[name] = tpot_ms(llm, prompt, args.runs)
            medians[name].append(statistics.median(times))
            print(f"round {round_ + 1}  {name:10s} TPOT ms {', '.join(f'{t:.2f}' for t in times)}", flush=True)
    eager, compiled = (statistics.median(medians[name]) for name in engines)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads: eager {eager:.2f} ms, --compile "
          f"{compiled:.2f} ms ({eager / compiled:.2f}x); same tokens: {tokens['eager'] == tokens['--compile']}")


if __name__ == "__main__":
    main()
