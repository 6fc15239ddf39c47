"""Requests for the serving benchmark: random token-id prompts, or ShareGPT conversations.

A ``SampleRequest`` is what the client sends: a prompt (token ids or text) and ``max_tokens``.
Its ``prompt_len`` is only what the dataset expects; the benchmark counts tokens from the
server's ``usage`` instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_RANDOM_VOCAB_SIZE = 256  # every model has at least this many ids; used when no tokenizer is given


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int | None  # None: a text prompt and no tokenizer to count it
    output_len: int  # sent as max_tokens


def load_tokenizer(name_or_path: str | None):
    """A Hugging Face tokenizer, or None. Imported lazily: the benchmark itself needs no transformers."""
    if name_or_path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


# ---------------------------------------------------------------------------- random


def random_lengths(mean_len: int, range_ratio: float, num: int, rng: np.random.Generator) -> np.ndarray:
    """``num`` lengths drawn uniformly from [mean * (1 - r), mean * (1 + r)], inclusive, at least 0."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(0, int(np.floor(mean_len * (1.0 - range_ratio))))
    high = int(np.ceil(mean_len * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, num)


def allowed_token_ids(tokenizer, vocab_size: int | None) -> np.ndarray:
    """Ids a random prompt may use: the vocabulary, less the tokenizer's special tokens."""
    if tokenizer is None:
        return np.arange(vocab_size or DEFAULT_RANDOM_VOCAB_SIZE)
    size = vocab_size or len(tokenizer)
    return np.setdiff1d(np.arange(size), np.asarray(tokenizer.all_special_ids, dtype=np.int64))


def sample_random(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    token_ids: np.ndarray,
    rng: np.random.Generator,
) -> list[SampleRequest]:
    """Prompts of ``prefix_len`` shared tokens followed by a random part of about ``input_len`` tokens.

    Every prompt has at least one token of its own, so no two are identical by construction.
    """
    prefix = rng.choice(token_ids, prefix_len).tolist()
    input_lens = np.maximum(random_lengths(input_len, range_ratio, num_prompts, rng), 1)
    output_lens = np.maximum(random_lengths(output_len, range_ratio, num_prompts, rng), 1)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        prompt = prefix + rng.choice(token_ids, int(n_in)).tolist()
        requests.append(SampleRequest(prompt=prompt, prompt_len=len(prompt), output_len=int(n_out)))
    return requests


# -------------------------------------------------------------------------- ShareGPT


def sharegpt_pairs(data: list[dict]) -> list[tuple[str, str]]:
    """(first human turn, the gpt reply after it) of every conversation that has both."""
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        first, reply = turns[0], turns[1]
        if first.get("from") == "human" and reply.get("from") == "gpt" and first.get("value") and reply.get("value"):
            pairs.append((first["value"], reply["value"]))
    return pairs


def count_tokens(text: str, tokenizer) -> int:
    """Tokens by the tokenizer when there is one, else whitespace-separated words."""
    if tokenizer is None:
        return len(text.split())
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def sample_sharegpt(path: str | Path, num_prompts: int, tokenizer, rng: np.random.Generator,
                    output_len: int | None = None) -> list[SampleRequest]:
    """``num_prompts`` conversations in a seeded random order, cycling through the file if it has fewer.

    The output length is the reply's length (or ``output_len`` when given), so a run asks the
    server for as many tokens as the recorded answer had.
    """
    with open(path, encoding="utf-8") as f:
        pairs = sharegpt_pairs(json.load(f))
    if not pairs:
        raise ValueError(f"{path} has no conversation that starts with a human turn followed by a gpt turn")
    order = rng.permutation(len(pairs))
    requests = []
    for i in range(num_prompts):
        prompt, reply = pairs[order[i % len(pairs)]]
        prompt_len = count_tokens(prompt, tokenizer) if tokenizer is not None else None
        n_out = output_len if output_len is not None else max(1, count_tokens(reply, tokenizer))
        requests.append(SampleRequest(prompt=prompt, prompt_len=prompt_len, output_len=n_out))
    return requests
