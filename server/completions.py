"""``POST /v1/completions``: text in, text out, streamed or whole.

A prompt is a string, a list of strings, a list of token ids, or a list of lists of token
ids; each prompt gets ``n`` choices, indexed ``prompt_idx * n + sample_idx``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from engine.output_processor import ChoiceDelta
from engine.outputs import Logprobs
from server.errors import bad_request
from server.generation import Generation
from server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from server.serving import ServingContext, clamp_logprob, collect, load_report, respond, usage_info
from server.tokenization import decode, encode_completion_prompts, has_text, token_text, truncate_prompt


# OpenAI's and vLLM's default for completions (chat's is the rest of the context).
DEFAULT_MAX_TOKENS = 16


async def create_completion(body: CompletionRequest, raw_request: Request, ctx: ServingContext):
    ctx.check_model(body.model)
    headers = load_report(raw_request)
    if body.echo and body.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported: prompt logprobs are not computed",
                          param="echo")
    defaults = ctx.model.info.sampling_defaults
    max_tokens = body.max_tokens if body.max_tokens is not None else defaults.get("max_tokens", DEFAULT_MAX_TOKENS)
    params = body.to_sampling_params(ctx.limits.apply_max_tokens(max_tokens, "max_tokens"), body.logprobs, defaults)
    if has_text(body.prompt):
        prompts = await ctx.in_tokenizer_thread(encode_completion_prompts, ctx.tokenizer, body.prompt)
    else:
        prompts = encode_completion_prompts(ctx.tokenizer, body.prompt)
    prompts = [truncate_prompt(p, body.truncate_prompt_tokens, ctx.model.max_model_len) for p in prompts]
    generation = ctx.start_generation("cmpl", prompts, params)
    view = _CompletionView(ctx, body, generation)
    return await respond(raw_request, bool(body.stream), view.chunks, view.response, headers)


class _CompletionView:
    """Renders one generation as a completion response or as its stream of chunks."""

    def __init__(self, ctx: ServingContext, body: CompletionRequest, generation: Generation):
        self.ctx = ctx
        self.body = body
        self.generation = generation
        self.created = int(time.time())
        self.id = generation.request_id

    def _prompt_ids(self, choice_index: int) -> list[int]:
        return self.generation.prompts[choice_index // self.generation.params.n].token_ids

    def _echo(self, prompt_index: int) -> str:
        if not self.body.echo:
            return ""
        prompt = self.generation.prompts[prompt_index]
        if prompt.text is not None:
            return prompt.text
        return decode(self.ctx.tokenizer, prompt.token_ids) if self.ctx.tokenizer is not None else ""

    def _logprobs(self, entries: list[Logprobs], text_offset: int) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        tokenizer = self.ctx.tokenizer
        out = CompletionLogprobs()
        as_id = bool(self.body.return_tokens_as_token_ids)
        for entry in entries:
            token = token_text(tokenizer, entry.token_id, as_id)
            out.tokens.append(token)
            out.token_logprobs.append(clamp_logprob(entry.logprob))
            out.top_logprobs.append({
                token_text(tokenizer, tid, as_id): clamp_logprob(lp)
                for tid, lp in zip(entry.top_token_ids, entry.top_logprobs)
            })
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out

    async def response(self) -> CompletionResponse:
        results = await collect(self.generation)
        choices = []
        for index, result in enumerate(results):
            prefix = self._echo(index // self.generation.params.n)
            choice = CompletionChoice(index=index, text=prefix + result.text,
                                      logprobs=self._logprobs(result.logprobs, len(prefix)),
                                      finish_reason=result.finish_reason)
            if self.body.return_token_ids:
                choice.prompt_token_ids = self._prompt_ids(index)
                choice.token_ids = result.token_ids
            choices.append(choice)
        return CompletionResponse(id=self.id, created=self.created, model=self.ctx.model.name,
                                  choices=choices, usage=usage_info(self.generation.usage()))

    async def chunks(self) -> AsyncIterator[CompletionResponse]:
        text_offsets: dict[int, int] = {}  # choice index -> where its next generated text starts
        async with aclosing(self.generation.updates()) as updates:
            async for batch in updates:
                for delta in batch:
                    chunk = self._chunk(delta, text_offsets)
                    if chunk is not None:
                        if self.body.continuous_usage:
                            chunk.usage = usage_info(self.generation.usage())
                        yield chunk
        if self.body.include_usage or self.ctx.force_include_usage:
            yield CompletionResponse(id=self.id, created=self.created, model=self.ctx.model.name,
                                     choices=[], usage=usage_info(self.generation.usage()))

    def _chunk(self, delta: ChoiceDelta, text_offsets: dict[int, int]) -> CompletionResponse | None:
        text = delta.text
        first = delta.index not in text_offsets
        if first:
            text = self._echo(delta.prompt_index) + text
            text_offsets[delta.index] = len(text) - len(delta.text)
        if not text and not delta.token_ids and delta.finish_reason is None:
            return None  # nothing new (a chunk of a prompt being prefilled)
        # A token that adds no text yet (inside a character, held back for a stop string, or not
        # in the tokenizer) still gets its chunk, as vLLM does: clients see progress and timing.
        logprobs = self._logprobs(delta.logprobs, text_offsets[delta.index])
        text_offsets[delta.index] += len(delta.text)
        choice = CompletionChoice(index=delta.index, text=text, logprobs=logprobs, finish_reason=delta.finish_reason)
        if self.body.return_token_ids:
            choice.token_ids = list(delta.token_ids)
            if first:
                choice.prompt_token_ids = self._prompt_ids(delta.index)
        return CompletionResponse(id=self.id, created=self.created, model=self.ctx.model.name, choices=[choice])
