"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template.

A stream opens with one role delta per choice, then content deltas; each choice's
``finish_reason`` comes in its last chunk.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from engine.outputs import Logprobs
from server.errors import bad_request
from server.generation import Generation
from server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
)
from server.serving import ServingContext, clamp_logprob, collect, respond, usage_info
from server.tokenization import TokenizedPrompt, render_chat, token_text


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request, ctx: ServingContext):
    ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    defaults = ctx.model.info.sampling_defaults
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = body.to_sampling_params(ctx.limits.apply_max_tokens(max_tokens, given), logprobs, defaults)
    prompt_ids = await ctx.in_tokenizer_thread(render_chat, ctx.tokenizer, body.messages, body.add_generation_prompt)
    generation = ctx.start_generation("chatcmpl", [TokenizedPrompt(prompt_ids)], params)
    view = _ChatView(ctx, body, generation)
    return await respond(raw_request, bool(body.stream), view.chunks, view.response)


class _ChatView:
    """Renders one generation as a chat completion or as its stream of chunks."""

    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, generation: Generation):
        self.ctx = ctx
        self.body = body
        self.generation = generation
        self.created = int(time.time())
        self.id = generation.request_id

    def _logprobs(self, entries: list[Logprobs]) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return ChatLogprobs(content=[self._token_logprob(entry) for entry in entries])

    def _token_logprob(self, entry: Logprobs) -> ChatLogprobToken:
        tokenizer = self.ctx.tokenizer
        top = []
        for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs):
            text = token_text(tokenizer, token_id)
            top.append(TopLogprob(token=text, logprob=clamp_logprob(logprob), bytes=list(text.encode())))
        text = token_text(tokenizer, entry.token_id)
        return ChatLogprobToken(token=text, logprob=clamp_logprob(entry.logprob), bytes=list(text.encode()),
                                top_logprobs=top)

    def _chunk(self, choices: list[ChatStreamChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.ctx.model.name,
                                   choices=choices, usage=usage)

    async def response(self) -> ChatCompletionResponse:
        results = await collect(self.generation)
        choices = [
            ChatChoice(index=index, message=ChatMessage(content=result.text), logprobs=self._logprobs(result.logprobs),
                       finish_reason=result.finish_reason)
            for index, result in enumerate(results)
        ]
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.ctx.model.name,
                                      choices=choices, usage=usage_info(self.generation.usage()))

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        for index in range(self.generation.num_choices):
            yield self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async with aclosing(self.generation.updates()) as updates:
            async for batch in updates:
                for delta in batch:
                    if not delta.text and not delta.token_ids and delta.finish_reason is None:
                        continue  # nothing new; a token without text yet still gets its chunk
                    choice = ChatStreamChoice(index=delta.index, delta=DeltaMessage(content=delta.text or None),
                                              logprobs=self._logprobs(delta.logprobs),
                                              finish_reason=delta.finish_reason)
                    yield self._chunk([choice])
        if self.body.include_usage:
            yield self._chunk([], usage=usage_info(self.generation.usage()))
