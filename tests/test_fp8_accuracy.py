"""What FP8 costs in accuracy, measured on the real default model (SmolLM2-135M-Instruct, float32 on the CPU).

The perplexity of a fixed text (the Apache License 2.0, 2,224 tokens, in ``tests/data``) is computed from the
engine's prompt logprobs in float32, with an FP8 KV cache, with FP8 weights, and with both; greedy
continuations of 8 prompts x 64 tokens are compared with float32's. The CPU runs the same rounding the GPU
does (K/V and activations through float8_e4m3 with the same scales), so these numbers are the GPU's too.
The README's table of options quotes them.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers import LICENSE_TEXT, prompt_perplexity

TEXT = LICENSE_TEXT.read_text()
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a bicycle stays upright.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a compiler do?",
    "Describe the water cycle in simple terms.",
]
# Float32 is the default model dequantized (``quantization="none"``; unset, its Q4_1 blocks would be served).
VARIANTS = {
    "float32": {"quantization": "none"},
    "fp8 KV cache": {"quantization": "none", "kv_cache_dtype": "fp8"},
    "fp8 weights": {"quantization": "fp8"},
    "fp8 weights + KV cache": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
# Perplexity may rise by at most this fraction over float32's: the issue's +2% for the KV cache and +3% for the
# weights, and their sum for both. Measured on the same code and packages: -0.1% / +2.7% / +2.7% on one CPU host,
# -0.2% / +2.5% / +3.8% on another (an AMD EPYC). The likely cause: float32 sums in another order there, which
# moves values across FP8 rounding boundaries; the default model's weights come from a 4-bit GGUF (16 levels per
# 32 values), so the pattern of those roundings, not their size, moves the perplexity. float8_e4m3 keeps 3
# mantissa bits, so each value is off by up to 6% (2.6% RMS on this model's weights, whatever the scale): weight
# rounding alone, with unquantized activations, already costs +2.0% here. Activations take one scale per token and
# 128 columns; one per token cost +3.7%. The cache stores K rotated by a Hadamard matrix (kvcache.paged_cache);
# unrotated it cost +2.3%.
PERPLEXITY_BUDGET = {"fp8 KV cache": 0.02, "fp8 weights": 0.03, "fp8 weights + KV cache": 0.05}


def greedy_tokens(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate([llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                           add_generation_prompt=True) for p in PROMPTS],
                        greedy, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of positions with the reference's token, mean length of the common prefix over 64)."""
    same = sum(a == b for x, y in zip(ours, reference) for a, b in zip(x, y))
    prefixes = []
    for x, y in zip(ours, reference):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n / len(y))
    return same / sum(len(y) for y in reference), sum(prefixes) / len(prefixes)


@pytest.fixture(scope="module")
def results(default_model_path, float32_license_perplexity):
    """{variant: (perplexity of TEXT, greedy tokens of PROMPTS)}; float32's perplexity is the session's (conftest),
    computed by an LLM with the same options."""
    out = {}
    for name, options in VARIANTS.items():
        llm = LLM(str(default_model_path), max_model_len=4096, max_num_batched_tokens=4096, num_kvcache_blocks=400,
                  **options)
        perplexity = float32_license_perplexity if name == "float32" else prompt_perplexity(llm, TEXT)
        out[name] = (perplexity, greedy_tokens(llm))
        llm.engine.close()
    return out


def test_fp8_perplexity_and_greedy_agreement(results):
    """FP8's perplexity stays within its budget over float32's, and greedy continuations keep float32's tokens
    for a while (tiny models drift apart soon after a first different token)."""
    base_ppl, base_tokens = results["float32"]
    assert 1.0 < base_ppl < 20.0, f"float32 perplexity {base_ppl}: the text or the scoring is wrong"
    lines = [f"{'variant':<24} {'perplexity':>10} {'vs float32':>10} {'same tokens':>11} {'common prefix':>13}"]
    for name, (ppl, tokens) in results.items():
        same, prefix = agreement(tokens, base_tokens)
        lines.append(f"{name:<24} {ppl:>10.4f} {100 * (ppl / base_ppl - 1):>+9.2f}% {100 * same:>10.1f}% "
                     f"{100 * prefix:>12.1f}%")
    print("\n" + "\n".join(lines))
    for name, budget in PERPLEXITY_BUDGET.items():
        ppl, tokens = results[name]
        assert ppl != base_ppl, f"{name}: the same perplexity as float32, so nothing was quantized"
        assert ppl <= base_ppl * (1 + budget), f"{name}: perplexity {ppl:.4f} is more than {budget:.0%} over " \
                                               f"float32's {base_ppl:.4f}"
        same, prefix = agreement(tokens, base_tokens)
        assert prefix >= 0.1, (f"{name}: greedy continuations keep only {prefix:.0%} of float32's tokens before "
                               "they differ")
