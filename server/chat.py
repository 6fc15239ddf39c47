"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template.

A stream opens with one role delta per choice, then content deltas; each choice's
``finish_reason`` comes in its last chunk. A choice's text goes through two readers, each
optional: the reasoning parser splits off the thinking (``reasoning``, which vLLM also names
``reasoning_content``), then the tool plan reads tool calls out of the answer
(server/reasoning.py, server/tools.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from engine.core.structured_output import check_structured_outputs
from engine.outputs import Logprobs
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
from server.serving import (
    ServingContext,
    clamp_logprob,
    collect,
    load_report,
    prompt_logprobs_view,
    request_metrics,
    respond,
    usage_info,
)
from server.streaming import ClientDisconnected, client_closed_response
from server.tokenization import (
    ChatTemplateOptions,
    RenderedChat,
    TokenizedPrompt,
    chat_image_parts,
    check_chat,
    encode,
    keep_tokens,
    message_chars,
    render_chat_text,
    token_text,
    truncate_prompt,
)
from server.tool_parsers import get_parser
from server.tools import ToolPlan


async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request, ctx: ServingContext):
    ctx.check_model(body.model)
    headers = load_report(raw_request)
    try:
        view = await start_chat(body, raw_request, ctx)
    except ClientDisconnected:
        return client_closed_response()
    return await respond(raw_request, bool(body.stream), view.chunks, view.response, headers)


async def start_chat(body: ChatCompletionRequest, raw_request: Request, ctx: ServingContext,
                     id_prefix: str = "chatcmpl") -> ChatView:
    """A chat request checked, rendered and admitted (the model is the caller's to check): the view that answers
    it, as one response or as its chunks; its request id is ``{id_prefix}-{hex}``. Raises ``ClientDisconnected``
    when the client leaves during the render."""
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
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    ctx.limits.check_choices(1, body.n or 1)  # before anything is rendered
    tools = ToolPlan.of(body, get_parser(ctx.model.tool_parser))
    prompt_ids, mm_inputs = await chat_prompt(ctx, body, tools, raw_request)
    thinking = thinking_state(ctx.tokenizer, prompt_ids) if ctx.model.reasoning_parser else "closed"
    reasoning = None if thinking == "closed" else thinking  # where constraints start (after the thinking)
    tool_grammar = tools.grammar(parallel=body.parallel_tool_calls is not False, reasoning=reasoning)
    max_tokens = ctx.limits.apply_max_tokens(max_tokens, given, defaults.get("max_tokens"))
    params = body.to_sampling_params(max_tokens, logprobs, defaults,
                                     tool_grammar=tool_grammar, skip_special_tokens=tools.skip_special_tokens,
                                     reasoning=reasoning)
    if params.structured_outputs is not None:  # once per request, off the event loop: it builds the grammar
        await ctx.in_tokenizer_thread(check_structured_outputs, params.structured_outputs,
                                      ctx.model.info.structured_outputs_max_bytes)
    prompt = truncate_prompt(TokenizedPrompt(prompt_ids), body.truncate_prompt_tokens, ctx.model.max_model_len,
                             body.truncation_side)
    generation = ctx.start_generation(id_prefix, [prompt], params, mm_inputs, model=body.model)
    return ChatView(ctx, body, generation, tools, thinking)


async def chat_prompt(ctx: ServingContext, body: ChatCompletionRequest, tools: ToolPlan,
                      raw_request: Request | None = None) -> tuple[list[int], list[list] | None]:
    """A chat request's prompt as the engine takes it: its token ids (each image's placeholder expanded to the
    image's tokens) and, when it has images, their inputs (``mm_inputs`` of ``start_generation``)."""
    options = ChatTemplateOptions(body.add_generation_prompt, body.continue_final_message, body.chat_template,
                                  body.chat_template_kwargs)
    rendered = await render_chat_request(ctx, body.messages, options, tools.template_tools,
                                         keep_tokens(body.truncate_prompt_tokens, ctx.model.max_model_len),
                                         raw_request, body.truncation_side)
    if not rendered.images:
        return rendered.prompt_token_ids, None
    # The model's processor: each image's pixels, its placeholder expanded to its tokens.
    if body.truncate_prompt_tokens is not None:
        raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", param="truncate_prompt_tokens")
    prompt_ids, images = await ctx.in_tokenizer_thread(ctx.model.image_processor.process_text, rendered.prompt,
                                                       [image.image for image in rendered.images], False)
    return prompt_ids, [images]


UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template.")  # vLLM's words


async def render_chat_request(ctx: ServingContext, messages: list[ChatMessageParam], options: ChatTemplateOptions,
                              tools: list[dict] | None, keep_tokens: int | None = None,
                              raw_request: Request | None = None, truncation_side: str | None = None) -> RenderedChat:
    """A request's conversation rendered, with its images: everything that can be refused without
    I/O is (a template of the request's own without --trust-request-chat-template, the conversation, text longer
    than the context can hold, then each part, and images for a model that does not take them), then the images
    are fetched and decoded (server/media.py), then the template runs in a thread of its own, within its bounds,
    and its text is tokenized in the tokenizer thread. A request that gives no template of its own gets the
    model's (``ServedModel.chat_template``). ``keep_tokens``: only the prompt's last tokens are kept
    (``truncate_prompt_tokens``; its first ones with ``truncation_side`` "right"), so only that part of the text is
    tokenized. With ``raw_request``, a client that
    goes away stops the render (``ClientDisconnected``)."""
    request_template = options.chat_template is not None
    if request_template and not ctx.trust_request_chat_template:
        raise bad_request(UNTRUSTED_TEMPLATE, param="chat_template")
    if options.chat_template is None and ctx.model.chat_template is not None:
        options = dataclasses.replace(options, chat_template=ctx.model.chat_template)
    check_chat(ctx.tokenizer, messages, options)
    if keep_tokens is None:
        ctx.text_bound.check_chars(message_chars(messages), "messages")
    refs = chat_image_parts(messages, ctx.model.name, ctx.model.accepts_images, ctx.media.max_images_per_request)
    images = await fetch_images(refs, ctx.media) if refs else []
    limits = ctx.template_limits(truncating=keep_tokens is not None)
    text = await ctx.in_template_thread(limits, render_chat_text, ctx.tokenizer, messages, options, tools,
                                        ctx.model.accepts_images, limits, request_template=request_template,
                                        raw_request=raw_request)
    if keep_tokens is not None and not images:
        text = ctx.text_bound.kept_text(text, keep_tokens, truncation_side)
    token_ids = await ctx.in_tokenizer_thread(encode, ctx.tokenizer, text, False, "messages")
    return RenderedChat(token_ids, text, images if ctx.model.accepts_images else [])


class ChatView:
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
        self.as_id = ctx.tokens_as_ids(body.return_tokens_as_token_ids)  # logprob tokens as "token_id:N"
        # --enable-force-include-usage: usage on every chunk and at the end, whatever the request asked (as vLLM).
        self.continuous_usage = body.continuous_usage or ctx.force_include_usage

    def _logprobs(self, entries: list[Logprobs]) -> ChatLogprobs | None:
        if not self.body.logprobs:
            return None
        return ChatLogprobs(content=[self._token_logprob(entry) for entry in entries])

    def _token_logprob(self, entry: Logprobs) -> ChatLogprobToken:
        tokenizer, as_id = self.ctx.tokenizer, self.as_id
        top = []
        pairs = list(zip(entry.top_token_ids, entry.top_logprobs))
        if self.body.logprob_token_ids:  # as vLLM: the sampled token first, then the named ones
            pairs = [(entry.token_id, entry.logprob)] + [p for p in pairs if p[0] != entry.token_id]
        for token_id, logprob in pairs:
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
        return prompt_logprobs_view(self.ctx.tokenizer, entries, self.as_id)

    def _chunk(self, choices: list[ChatStreamChoice], usage=None, first: bool = False,
               prompt_logprobs: list[Logprobs] | None = None, metrics=None) -> ChatCompletionChunk:
        if usage is None and choices and self.continuous_usage:
            usage = usage_info(self.generation.usage())
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.generation.model,
                                   choices=choices, usage=usage, prompt_token_ids=self._prompt_ids() if first
                                   else None, prompt_logprobs=self._prompt_logprobs(prompt_logprobs), metrics=metrics)

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
            message = ChatMessage(content=content, reasoning=reasoning, reasoning_content=reasoning, tool_calls=calls)
            choices.append(ChatChoice(index=index, message=message, logprobs=self._logprobs(result.logprobs),
                                      finish_reason=finish_reason, stop_reason=result.stop_reason,
                                      token_ids=result.token_ids if self.body.return_token_ids else None))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.generation.model, choices=choices,
                                      usage=usage_info(self.generation.usage(), self.ctx.prompt_tokens_details),
                                      prompt_token_ids=self._prompt_ids(),
                                      prompt_logprobs=self._prompt_logprobs(results[0].prompt_logprobs),
                                      metrics=request_metrics(self.ctx, self.generation))

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
            yield self._chunk([], usage=usage_info(self.generation.usage(), self.ctx.prompt_tokens_details),
                              metrics=request_metrics(self.ctx, self.generation))

    def _choice(self, delta, message: DeltaMessage, final: bool = True, finish: str | None = None) -> ChatStreamChoice:
        """One delta's chunk choice; ``final``: the last of the chunks it becomes (logprobs, finish
        reason and token ids go there)."""
        return ChatStreamChoice(index=delta.index, delta=message, logprobs=self._logprobs(delta.logprobs) if final
                                else None, finish_reason=(finish or delta.finish_reason) if final else None,
                                stop_reason=delta.stop_reason if final else None,
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
                messages.append(DeltaMessage(reasoning=split.reasoning, reasoning_content=split.reasoning))
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
