"""How much text can become a prompt: the characters ``max_model_len`` tokens can span at most.

Tokenizing costs time and memory in proportion to the text, so text that could never fit in the
context is refused before the tokenizer sees it. The bound is exact enough never to refuse a text
that would fit: no token stands for more characters than ``chars_per_token`` (the tokenizer's
longest vocabulary entry, raised where a probe shows its normalizer folding more characters than
that into one token), so a text of more than ``max_model_len * chars_per_token`` characters has
more than ``max_model_len`` tokens. A tokenizer whose normalizer drops some characters altogether
(a probe makes no token) gets no bound.

With ``truncate_prompt_tokens`` only the text's end survives (its start, with ``truncation_side`` "right"), so
only the characters the kept tokens can span (and a margin, where the cut may tokenize differently) are tokenized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from server.errors import bad_request

logger = logging.getLogger("minivllm.server")

# Characters normalizers drop, fold or merge (whitespace, controls, format characters, combining marks).
_PROBES = (" ", "\t", "\n", "\r", "\x00", "\x1f", "\u00a0", "\u00ad", "\u200b", "\u2028", "\u0301", "\ufeff")
_PROBE_LEN = 1024
_TAIL_MARGIN_TOKENS = 64  # tokens tokenized beyond those kept, so the cut's own tokens are dropped


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters one token of ``tokenizer`` stands for; None when some text makes no token at all."""
    try:
        longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    except NotImplementedError:  # a tokenizer that cannot list its vocabulary
        logger.info("the tokenizer has no vocabulary to measure, so prompts are not bounded by characters")
        return None
    for probe in _PROBES:
        ids = tokenizer(probe * _PROBE_LEN, add_special_tokens=False)["input_ids"]
        if not ids:
            logger.info("the tokenizer drops %r, so prompts are not bounded by characters before tokenizing", probe)
            return None
        longest = max(longest, -(-_PROBE_LEN // len(ids)))
    return longest


@dataclass(frozen=True)
class TextBound:
    """The characters a prompt of a model may have before it is tokenized."""

    max_model_len: int
    chars_per_token: int | None  # None: no bound (no tokenizer, or one that drops characters)

    @classmethod
    def of(cls, tokenizer, max_model_len: int) -> TextBound:
        return cls(max_model_len, None if tokenizer is None else max_chars_per_token(tokenizer))

    @property
    def max_chars(self) -> int | None:
        return None if self.chars_per_token is None else self.max_model_len * self.chars_per_token

    def check(self, text: str, param: str) -> None:
        """A 400 for text that is longer than the context could hold in any tokenization."""
        self.check_chars(len(text), param)

    def check_chars(self, num_chars: int, param: str) -> None:
        limit = self.max_chars
        if limit is not None and num_chars > limit:
            raise self.too_long(num_chars, param)

    def too_long(self, num_chars: int, param: str):
        return bad_request(f"{param} has {num_chars:,} characters: more than this model's maximum context length "
                           f"of {self.max_model_len} tokens can hold (at most {self.max_chars:,} characters with its "
                           f"tokenizer)", param=param, code="context_length_exceeded")

    def kept_text(self, text: str, keep_tokens: int, side: str | None = None) -> str:
        """The part of ``text`` that holds the ``keep_tokens`` tokens ``truncate_prompt_tokens`` keeps, and more:
        its end, or its start with ``side`` "right" (``truncation_side``)."""
        if self.chars_per_token is None:
            return text
        num_chars = (min(keep_tokens, self.max_model_len) + _TAIL_MARGIN_TOKENS) * self.chars_per_token
        if len(text) <= num_chars:
            return text
        return text[:num_chars] if side == "right" else text[-num_chars:]

    def admit(self, text: str, param: str, keep_tokens: int | None, side: str | None = None) -> str:
        """The part of ``text`` to tokenize: all of it (a 400 when it cannot fit), or with ``keep_tokens`` the part
        the truncation keeps (``kept_text``)."""
        if keep_tokens is None:
            self.check(text, param)
            return text
        return self.kept_text(text, keep_tokens, side)
