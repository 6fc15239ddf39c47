"""A reasoning model's thinking, apart from its answer (``--reasoning-parser``).

    qwen3, deepseek_r1   <think> thinking </think> answer

Both write their thinking between ``<think>`` and ``</think>``; they differ in who opens the
block. DeepSeek-R1's chat template ends the prompt with ``<think>``, Qwen3's lets the model write
it, and Qwen3 with ``enable_thinking: false`` puts an empty block in the prompt. So where the
output starts is read from the end of the rendered prompt, not from the parser's name:

    "open"      the prompt opened the block: the output is thinking until </think>
    "optional"  the model may open a block (or answer at once)
    "closed"    the prompt closed the block: the output is all answer

The thinking goes to ``reasoning_content``, the rest to ``content``; tool calls and structured
output apply to the answer only (the grammar starts after the block: StructuredOutputsParams.reasoning).
"""

from __future__ import annotations

from dataclasses import dataclass

from server.tool_parsers import marker_prefix_length

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")
_PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens, where a template opens or closes the block


def thinking_state(tokenizer, prompt_ids: list[int]) -> str:
    """"open", "optional" or "closed": how the output starts, from the end of the rendered prompt."""
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False).rstrip()
    if tail.endswith(START):
        return "open"
    if tail.endswith(END):
        return "closed"
    return "optional"


def split_reasoning(text: str, state: str) -> tuple[str | None, str]:
    """A finished output's (reasoning, answer). An output cut off inside the block is all reasoning."""
    if state == "closed":
        return None, text
    body = text
    if state == "optional":
        stripped = text.lstrip()
        if not stripped.startswith(START):
            return None, text
        body = stripped[len(START):]
    elif body.lstrip().startswith(START):  # a model that writes the opener the prompt already has
        body = body.lstrip()[len(START):]
    reasoning, end, answer = body.partition(END)
    if not end:
        return reasoning, ""
    return reasoning, answer.lstrip("\n")


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One streamed choice: text deltas in, reasoning and answer deltas out. Text that may be the
    beginning of a tag is held back until the next delta says what it is."""

    def __init__(self, state: str):
        self.state = state
        # "start": until it is known whether the output writes an opener (the prompt's one may be repeated)
        self.phase = "answer" if state == "closed" else "start"
        self._after_start = "thinking" if state == "open" else "answer"
        self._pending = ""
        self._answer_started = state == "closed"

    def feed(self, delta: str, finished: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        text = self._pending + delta
        self._pending = ""
        while text:
            if self.phase == "answer":
                if not self._answer_started:  # the newlines between the block and the answer are not content
                    text = text.lstrip("\n")
                    if not text:
                        break
                    self._answer_started = True
                out.content += text
                break
            if self.phase == "start":  # does the output open a block?
                stripped = text.lstrip()
                if stripped.startswith(START):
                    text, self.phase = stripped[len(START):], "thinking"
                    continue
                if not finished and (not stripped or START.startswith(stripped)):
                    self._pending = text
                    break
                self.phase = self._after_start
                self._answer_started = self.phase == "answer"  # an answer with no block keeps its text
                continue
            # thinking
            idx = text.find(END)
            if idx >= 0:
                out.reasoning += text[:idx]
                text, self.phase = text[idx + len(END):], "answer"
                continue
            keep = 0 if finished else marker_prefix_length(text, END)
            out.reasoning += text[:len(text) - keep]
            self._pending = text[len(text) - keep:]
            break
        return out

