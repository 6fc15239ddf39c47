"""Incremental detokenization with stop strings.

Each new token adds only the text it completes, so a step costs the same however long
the output gets. A token that ends inside a multi-byte character adds nothing until a
later token completes the character. The decoder first sees a few prompt tokens, so
the first generated token keeps its leading space.

Two ways to turn tokens into text, with the same results:
- a fast (Rust) tokenizer's ``DecodeStream``: ~1.7 us per token;
- any tokenizer: decode a short sliding window and keep what the newest token added
  (two ``decode`` calls per token, ~15 us).

When stop strings are set, the last ``len(longest stop) - 1`` characters are held back
while the request runs, so a stop string that spans tokens is never emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class StopMatch:
    stop_string: str


class _StreamDecoder:
    """Text per token from ``tokenizers.decoders.DecodeStream``."""

    def __init__(self, backend, prompt_context: list[int], skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in prompt_context:  # context only: its text is not output
            self._step(token_id)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode adds no text
            return None

    def add(self, token_id: int) -> str:
        return self._step(token_id) or ""


class _WindowDecoder:
    """Text per token by decoding a sliding window (tokenizers without a Rust backend)."""

    def __init__(self, tokenizer, prompt_context: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_context)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens,
                                      clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or the newest token ends inside a character
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]


class IncrementalDetokenizer:
    """Text deltas of one output. Only text not handed out yet is kept: a stop string can only
    match there, because the hold-back keeps its possible start from being emitted."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self._hold_back = max((len(s) for s in self.stop), default=1) - 1
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decoder = _StreamDecoder(backend, context, skip_special_tokens)
        else:
            self._decoder = _WindowDecoder(tokenizer, context, skip_special_tokens)
        self._unemitted = ""  # decoded, not handed out yet: at most the hold-back plus the newest text

    def add_tokens(self, token_ids: list[int]) -> StopMatch | None:
        """Decode new tokens; returns a StopMatch if a stop string now appears in the text."""
        for token_id in token_ids:
            new_text = self._decoder.add(token_id)
            if new_text:
                start = len(self._unemitted)
                self._unemitted += new_text
                if self.stop:
                    match = self._find_stop(start)
                    if match is not None:
                        return match
        return None

    def _find_stop(self, new_text_start: int) -> StopMatch | None:
        for stop in self.stop:
            # Only the new text, plus enough before it for a match that spans the boundary.
            idx = self._unemitted.find(stop, max(0, new_text_start - len(stop) + 1))
            if idx != -1:
                self._unemitted = self._unemitted[: idx + len(stop) if self.include_stop else idx]
                return StopMatch(stop)
        return None

    def next_delta(self, finished: bool) -> str:
        """Text not handed out yet; while running, the stop-string hold-back stays behind."""
        text = self._unemitted
        if finished or not self._hold_back:
            self._unemitted = ""
            return text
        cut = len(text) - self._hold_back
        if cut <= 0:
            return ""
        self._unemitted = text[cut:]
        return text[:cut]
