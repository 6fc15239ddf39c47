"""Scores of text pairs (``LLM.score``, the server's ``/score`` and ``/rerank``), vLLM's way:

* a sequence classifier (a cross-encoder reranker, ``engine.models.classification``) reads the pair as one prompt
  (the tokenizer's pair encoding: for a decoder, the two texts' tokens one after the other with its special tokens)
  and scores it from its logits: the sigmoid of its one label's, or the softmax's second label of two;
* an embedding model embeds each text on its own; the score is the cosine of the two embeddings.
"""

from __future__ import annotations

import math

from engine.errors import RequestError


def pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """One text against many (1:N), or texts paired in order (N:N)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise RequestError("text_1 and text_2 must not be empty", param="text_1" if not first else "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise RequestError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as "
                           "text_2", param="text_1")
    return list(zip(first, second))


def pair_token_ids(tokenizer, text_1: str, text_2: str) -> list[int]:
    """A cross-encoder's prompt for a pair: the tokenizer's pair encoding."""
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so text pairs cannot be encoded", param="text_1")
    return list(tokenizer(text_1, text_2)["input_ids"])


def classifier_score(logits: list[float]) -> float:
    """A cross-encoder's relevance from its labels' logits: the sigmoid of one, the softmax's second of two."""
    if len(logits) == 1:
        return 1.0 / (1.0 + math.exp(-logits[0]))
    if len(logits) == 2:
        return 1.0 / (1.0 + math.exp(logits[0] - logits[1]))
    raise RequestError(f"scores need a classifier of one or two labels; this one has {len(logits)}", param="model")


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
