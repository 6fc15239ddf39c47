"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template.

A stream opens with one role delta per choice, then content deltas; each choice's
``finish_reason`` comes in its last chunk. A choice's text goes through two readers, each
optional: the reasoning parser splits off the thinking (``reasoning_content``), then the tool
plan reads tool calls out of the answer (server/reasoning.py, server/tools.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from engine.outputs import Logprobs
from engine.structured_output import check_structured_outputs
from server.errors import bad_request
from server.generation import Generation
from server.media import fetch_images
from server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatMessageParam,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    TopLogprob,
)
from server.reasoning import ReasoningStream, split_reasoning, thinking_state
from server.tool_parsers import get_parser
from server.tools import ToolPlan
from server.serving import (
    ServingContext,
    clamp_logprob,
    collect,
    load_report,
    prompt_logprobs_view,
    respond,
    usage_info,
)
from server.tokenization import (
    ChatTemplateOptions,
    RenderedChat,
    TokenizedPrompt,
    chat_image_parts,
    check_chat,
    render_chat,
    token_text,
    truncate_prompt,
)


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request, ctx: ServingContext):
    ctx.check_model(body.model)
    headers = load_report(raw_request)
    if body.top_logprobs is not None and body.top_logprobs < -1:
        raise bad_request("`top_logprobs` must be a positive value or -1 (the whole vocabulary)",
                          param="top_logprobs")
    if body.top_logprobs not in (None, 0) and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.logprobs:
        ctx.model.info.check_num_logprobs(body.top_logprobs, "top_logprobs")
    given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    defaults = ctx.model.info.sampling_defaults
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    tools = ToolPlan.of(body, get_parser(ctx.model.tool_parser))
    options = ChatTemplateOptions(body.add_generation_prompt, body.continue_final_message, body.chat_template,
                                  body.chat_template_kwargs)
    rendered = await render_chat_request(ctx, body.messages, options, tools.template_tools)
    prompt_ids, mm_inputs = rendered.prompt_token_ids, None
    if rendered.images:  # the model's processor: each image's pixels, its placeholder expanded to its tokens
        if body.truncate_prompt_tokens is not None:
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", param="truncate_prompt_tokens")
        prompt_ids, images = await ctx.in_tokenizer_thread(ctx.model.image_processor.process_text, rendered.prompt,
                                                           [image.image for image in rendered.images], False)
        mm_inputs = [images]
    thinking = thinking_state(ctx.tokenizer, prompt_ids) if ctx.model.reasoning_parser else "closed"
    reasoning = None if thinking == "closed" else thinking  # where constraints start (after the thinking)
    tool_grammar = tools.grammar(parallel=body.parallel_tool_calls is not False, reasoning=reasoning)
    params = body.to_sampling_params(ctx.limits.apply_max_tokens(max_tokens, given), logprobs, defaults,
                                     tool_grammar=tool_grammar, skip_special_tokens=tools.skip_special_tokens,
                                     reasoning=reasoning)
    if params.structured_outputs is not None:  # once per request, off the event loop: it builds the grammar
        await ctx.in_tokenizer_thread(check_structured_outputs, params.structured_outputs,
                                      ctx.model.info.structured_outputs_max_bytes)
    prompt = truncate_prompt(TokenizedPrompt(prompt_ids), body.truncate_prompt_tokens, ctx.model.max_model_len)
    generation = ctx.start_generation("chatcmpl", [prompt], params, mm_inputs)
    view = _ChatView(ctx, body, generation, tools, thinking)
    return await respond(raw_request, bool(body.stream), view.chunks, view.response, headers)


async def render_chat_request(ctx: ServingContext, messages: list[ChatMessageParam], options: ChatTemplateOptions,
                              tools: list[dict] | None) -> RenderedChat:
    """A request's conversation rendered, with its images: everything that can be refused without
    I/O is (the conversation, then each part, and images for a model that does not take them), then
    the images are fetched and decoded (server/media.py), then the template runs in the tokenizer thread.
    A request that gives no template of its own gets the model's (``ServedModel.chat_template``)."""
    if options.chat_template is None and ctx.model.chat_template is not None:
        options = dataclasses.replace(options, chat_template=ctx.model.chat_template)
    check_chat(ctx.tokenizer, messages, options)
    refs = chat_image_parts(messages, ctx.model.name, ctx.model.accepts_images, ctx.media.max_images_per_request)
    images = await fetch_images(refs, ctx.media) if refs else []
    return await ctx.in_tokenizer_thread(render_chat, ctx.tokenizer, messages, options, tools, images,
                                         ctx.model.accepts_images)


class _ChatView:
    """Renders one generation as a chat completion or as its stream of chunks."""

    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, generation: Generation, tools: ToolPlan,
                 thinking: str):
        self.ctx = ctx
        self.body = body
        self.generation = generation
        self.tools = tools
        self.thinking = thinking  # server/reasoning.py: "open", "optional" or "closed" (no reasoning parser)
        self.created = int(time.time())
        self.id = generation.request_id

    def _logprobs(self, entries: list[Logprobs]) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return ChatLogprobs(content=[self._token_logprob(entry) for entry in entries])

    def _token_logprob(self, entry: Logprobs) -> ChatLogprobToken:
        tokenizer, as_id = self.ctx.tokenizer, bool(self.body.return_tokens_as_token_ids)
        top = []
        for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs):
            text = token_text(tokenizer, token_id, as_id)
            top.append(TopLogprob(token=text, logprob=clamp_logprob(logprob), bytes=list(text.encode())))
        text = token_text(tokenizer, entry.token_id, as_id)
        return ChatLogprobToken(token=text, logprob=clamp_logprob(entry.logprob), bytes=list(text.encode()),
                                top_logprobs=top)

    @property
    def _echo(self) -> str:
        """With ``echo``: the last message's text, when the reply continues its role (the assistant's)."""
        last = self.body.messages[-1]
        if not self.body.echo or last.role != "assistant":
            return ""
        if isinstance(last.content, list):
            return "".join(part.text or "" for part in last.content)
        return last.content or ""

    def _prompt_ids(self) -> list[int] | None:
        return self.generation.prompts[0].token_ids if self.body.return_token_ids else None

    def _prompt_logprobs(self, entries: list[Logprobs] | None):
        return prompt_logprobs_view(self.ctx.tokenizer, entries, bool(self.body.return_tokens_as_token_ids))

    def _chunk(self, choices: list[ChatStreamChoice], usage=None, first: bool = False,
               prompt_logprobs: list[Logprobs] | None = None) -> ChatCompletionChunk:
        if usage is None and choices and self.body.continuous_usage:
            usage = usage_info(self.generation.usage())
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.ctx.model.name,
                                   choices=choices, usage=usage, prompt_token_ids=self._prompt_ids() if first
                                   else None, prompt_logprobs=self._prompt_logprobs(prompt_logprobs))

    async def response(self) -> ChatCompletionResponse:
        results = await collect(self.generation)
        choices = []
        for index, result in enumerate(results):
            reasoning, answer = split_reasoning(result.text, self.thinking)
            content, calls = self.tools.extract(answer, result.finish_reason)
            if reasoning is not None and not content:
                content = None  # all thinking (cut off) or all calls: no answer text
            if self._echo:
                content = self._echo + (content or "")
            finish_reason = self.tools.finish_reason(result.finish_reason, bool(calls))
            message = ChatMessage(content=content, reasoning_content=reasoning, tool_calls=calls)
            choices.append(ChatChoice(index=index, message=message, logprobs=self._logprobs(result.logprobs),
                                      finish_reason=finish_reason,
                                      token_ids=result.token_ids if self.body.return_token_ids else None))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.ctx.model.name,
                                      choices=choices, usage=usage_info(self.generation.usage()),
                                      prompt_token_ids=self._prompt_ids(),
                                      prompt_logprobs=self._prompt_logprobs(results[0].prompt_logprobs))

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        for index in range(self.generation.num_choices):
            yield self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))],
                              first=True)
            if self._echo:
                yield self._chunk([ChatStreamChoice(index=index, delta=DeltaMessage(content=self._echo))])
        readers = {}  # choice index -> (its ReasoningStream, its ChoiceToolStream), each or None
        plain = self.tools.mode == "none" and self.thinking == "closed"
        async with aclosing(self.generation.updates()) as updates:
            async for batch in updates:
                for delta in batch:
                    if not delta.text and not delta.token_ids and delta.finish_reason is None:
                        continue  # nothing new; a token without text yet still gets its chunk
                    # The prompt's logprobs (prompt_logprobs=0) come once, with the first choice's first token.
                    prompt_logprobs = delta.prompt_logprobs if delta.index == 0 else None
                    if plain:
                        yield self._chunk([self._choice(delta, DeltaMessage(content=delta.text or None))],
                                          prompt_logprobs=prompt_logprobs)
                        continue
                    if delta.index not in readers:
                        readers[delta.index] = (ReasoningStream(self.thinking) if self.thinking != "closed" else None,
                                                self.tools.stream())
                    thoughts, calls = readers[delta.index]
                    messages = self._deltas(thoughts, calls, delta) or [DeltaMessage()]
                    for message in messages[:-1]:
                        yield self._chunk([self._choice(delta, message, final=False)], prompt_logprobs=prompt_logprobs)
                        prompt_logprobs = None
                    finish = self.tools.finish_reason(delta.finish_reason, bool(calls and calls.num_calls))
                    yield self._chunk([self._choice(delta, messages[-1], finish=finish)],
                                      prompt_logprobs=prompt_logprobs)
        if self.body.include_usage or self.ctx.force_include_usage:
            yield self._chunk([], usage=usage_info(self.generation.usage()))

    def _choice(self, delta, message: DeltaMessage, final: bool = True, finish: str | None = None) -> ChatStreamChoice:
        """One delta's chunk choice; ``final``: the last of the chunks it becomes (logprobs, finish
        reason and token ids go there)."""
        return ChatStreamChoice(index=delta.index, delta=message, logprobs=self._logprobs(delta.logprobs) if final
                                else None, finish_reason=(finish or delta.finish_reason) if final else None,
                                token_ids=list(delta.token_ids) if final and self.body.return_token_ids else None)

    @staticmethod
    def _deltas(thoughts: ReasoningStream | None, calls, delta) -> list[DeltaMessage]:
        """Reasoning first, then content, then each tool-call piece, one message each (OpenAI sends
        tool-call pieces apart)."""
        finished = delta.finish_reason is not None
        messages, text = [], delta.text
        if thoughts is not None:
            split = thoughts.feed(text, finished)
            if split.reasoning:
                messages.append(DeltaMessage(reasoning_content=split.reasoning))
            text = split.content
        if calls is None:
            return messages + ([DeltaMessage(content=text)] if text else [])
        out = calls.feed(text, delta.finish_reason)
        if out.content:
            messages.append(DeltaMessage(content=out.content))
        for index, call_id, name, arguments in out.calls:
            function = DeltaFunctionCall(name=name, arguments=arguments)
            messages.append(DeltaMessage(tool_calls=[DeltaToolCall(index=index, id=call_id, type="function" if call_id
                                                                   else None, function=function)]))
        return messages
