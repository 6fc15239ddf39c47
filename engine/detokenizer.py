"""Incremental detokenization with stop strings.

Text is produced by decoding a short sliding window of tokens and emitting only what
the newest token added, so each step costs the same however long the output gets. A
token that ends inside a multi-byte character decodes to U+FFFD; its text is held
back until a later token completes the character. The window starts a few tokens
into the prompt so the first generated token keeps its leading space.

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
    text: str  # the full output text, cut at the stop string (kept if asked)


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self._hold_back = max((len(s) for s in self.stop), default=1) - 1
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""  # all output text decoded so far
        self._emitted = 0  # characters of self.text already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add_tokens(self, token_ids: list[int]) -> StopMatch | None:
        """Decode new tokens; returns a StopMatch if a stop string now appears in the text."""
        for token_id in token_ids:
            self._ids.append(token_id)
            prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._decode(self._ids[self._prefix_offset :])
            if len(full) > len(prefix) and not full.endswith(_REPLACEMENT_CHAR):
                start = len(self.text)
                self.text += full[len(prefix) :]
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                match = self._find_stop(start)
                if match is not None:
                    return match
        return None

    def _find_stop(self, new_text_start: int) -> StopMatch | None:
        if not self.stop:
            return None
        for stop in self.stop:
            # Only the new text, plus enough before it for a match that spans the boundary.
            idx = self.text.find(stop, max(0, new_text_start - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if self.include_stop else idx
                self.text = self.text[:end]
                return StopMatch(stop, self.text)
        return None

    def next_delta(self, finished: bool) -> str:
        """Text not handed out yet; while running, the stop-string hold-back stays behind."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold_back)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
