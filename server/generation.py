"""One API request fanned out into engine requests, merged back into one stream of choice updates.

    prompts x n samples ──> engine requests "{id}-{index}", index = prompt_idx * n + sample_idx
                              each in its own task: EngineOutput -> detokenize -> ChoiceUpdate
                        <── one queue, in arrival order

Streamed and non-streamed responses both consume ``Generation.updates()``, so their text
is identical by construction. A stop string ends a choice here: its engine request is
aborted (closing the engine iterator frees the KV blocks). Closing ``updates()`` early
(a client that went away) cancels every choice task, which aborts every engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.async_engine import AsyncEngine
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import EngineOutput, Logprobs
from engine.sampling_params import SamplingParams
from server.metrics import ServerMetrics
from server.tokenization import TokenizedPrompt


@dataclass
class ChoiceUpdate:
    """What one choice produced since its last update; ``finish_reason`` is set on its last one."""

    index: int
    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs]
    finish_reason: str | None = None


@dataclass
class _ChoiceUsage:
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


_CHOICE_DONE = object()


@dataclass
class Generation:
    engine: AsyncEngine
    metrics: ServerMetrics
    request_id: str
    prompts: list[TokenizedPrompt]
    params: SamplingParams
    tokenizer: object | None
    _usage: dict[int, _ChoiceUsage] = field(default_factory=dict, init=False)  # choice index -> counts

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    def choice_params(self, sample_index: int) -> SamplingParams:
        """One engine request per sample; seeded samples get seed + i so they differ yet reproduce."""
        seed = None if self.params.seed is None else self.params.seed + sample_index
        return dataclasses.replace(self.params, n=1, seed=seed)

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        """Merge every choice's updates. Raises the first error any choice hits (the others are cancelled)."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = []
        for prompt_index, prompt in enumerate(self.prompts):
            for sample_index in range(self.params.n):
                index = prompt_index * self.params.n + sample_index
                coro = self._run_choice(index, prompt_index, prompt, self.choice_params(sample_index), queue)
                tasks.append(asyncio.create_task(coro))
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is _CHOICE_DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def usage(self) -> Usage:
        """Prompt tokens count once per prompt; cached tokens are those every sample of a prompt found cached."""
        n = self.params.n
        cached = 0
        for prompt_index in range(len(self.prompts)):
            samples = [self._usage.get(prompt_index * n + i, _ChoiceUsage()) for i in range(n)]
            cached += min(s.num_cached_tokens for s in samples)
        return Usage(
            prompt_tokens=sum(len(p.token_ids) for p in self.prompts),
            completion_tokens=sum(u.num_output_tokens for u in self._usage.values()),
            cached_tokens=cached,
        )

    # ------------------------------------------------------------------ one choice

    async def _run_choice(self, index: int, prompt_index: int, prompt: TokenizedPrompt, params: SamplingParams,
                          queue: asyncio.Queue) -> None:
        try:
            await self._generate_choice(index, prompt_index, prompt, params, queue)
            queue.put_nowait(_CHOICE_DONE)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which answers it
            queue.put_nowait(exc)

    async def _generate_choice(self, index: int, prompt_index: int, prompt: TokenizedPrompt,
                               params: SamplingParams, queue: asyncio.Queue) -> None:
        detokenizer = self._detokenizer(prompt, params)
        usage = self._usage.setdefault(index, _ChoiceUsage())
        timer = self.metrics.request_timer()
        outputs = self.engine.generate(f"{self.request_id}-{index}", prompt.token_ids, params)
        # aclosing: leaving early (stop string, cancellation) closes the iterator, which aborts the request.
        async with contextlib.aclosing(outputs):
            try:
                async for out in outputs:
                    timer.on_output(out)
                    usage.num_output_tokens += len(out.new_token_ids)
                    usage.num_cached_tokens = out.num_cached_tokens
                    finish_reason, text = _decode(detokenizer, out, params)
                    queue.put_nowait(ChoiceUpdate(index, prompt_index, text, out.new_token_ids, out.new_logprobs,
                                                  finish_reason))
                    if finish_reason is not None:
                        timer.on_finish(finish_reason)
                        return
            except asyncio.CancelledError:
                timer.on_finish("abort")  # the client went away
                raise

    def _detokenizer(self, prompt: TokenizedPrompt, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt.token_ids, params.skip_special_tokens, params.stop,
                                      params.include_stop_str_in_output)


def _decode(detokenizer: IncrementalDetokenizer | None, out: EngineOutput,
            params: SamplingParams) -> tuple[str | None, str]:
    """The choice's finish reason (None while it runs) and its new text."""
    if detokenizer is None:
        return (out.finish_reason if out.finished else None), ""
    token_ids = out.new_token_ids
    if out.finished and out.stop_token_id is not None and not params.include_stop_str_in_output:
        token_ids = token_ids[:-1]  # the stop token (EOS or a stop_token_id) is not part of the text
    match = detokenizer.add_tokens(token_ids)
    if match is not None:
        finish_reason = "stop"
    else:
        finish_reason = out.finish_reason if out.finished else None
    return finish_reason, detokenizer.next_delta(finished=finish_reason is not None)
