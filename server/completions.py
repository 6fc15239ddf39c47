"""``POST /v1/completions``: text in, text out, streamed or whole.

A prompt is a string, a list of strings, a list of token ids, or a list of lists of token
ids; each prompt gets ``n`` choices, indexed ``prompt_idx * n + sample_idx``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from engine.core.structured_output import check_structured_outputs
from engine.frontend.output_processor import ChoiceDelta
from engine.outputs import Logprobs
from server.errors import bad_request
from server.generation import Generation
from server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
)
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
from server.tokenization import (
    admit_prompt_text,
    decode,
    encode_completion_prompts,
    has_text,
    keep_tokens,
    num_prompts,
    token_text,
    truncate_prompt,
)

# OpenAI's and vLLM's default for completions (chat's is the rest of the context).
DEFAULT_MAX_TOKENS = 16


async def create_completion(body: CompletionRequest, raw_request: Request, ctx: ServingContext):
    ctx.check_model(body.model)
    body.check_prompt()
    headers = load_report(raw_request)
    if body.logprobs is not None and body.logprobs < 0:
        raise bad_request("`logprobs` must be a positive value", param="logprobs")
    defaults = ctx.model.info.sampling_defaults
    # echo with logprobs scores the prompt too (how evaluation harnesses compute log-likelihoods).
    echo_logprobs = body.logprobs if body.echo else None
    max_tokens = ctx.limits.apply_max_tokens(body.max_tokens, "max_tokens", defaults.get("max_tokens", DEFAULT_MAX_TOKENS))
    params = body.to_sampling_params(max_tokens, body.logprobs, defaults, prompt_logprobs=echo_logprobs)
    # Counted and measured before anything is tokenized: refusals cost nothing, and only text that can fit is encoded.
    ctx.limits.check_choices(num_prompts(body.prompt), params.n)
    keep = keep_tokens(body.truncate_prompt_tokens, ctx.model.max_model_len)
    if params.structured_outputs is not None:  # once per request, off the event loop: it builds the grammar
        await ctx.in_tokenizer_thread(check_structured_outputs, params.structured_outputs,
                                      ctx.model.info.structured_outputs_max_bytes)
    if has_text(body.prompt):
        text = admit_prompt_text(body.prompt, ctx.text_bound, keep, body.truncation_side)
        prompts = await ctx.in_tokenizer_thread(encode_completion_prompts, ctx.tokenizer, text)
    else:
        prompts = encode_completion_prompts(ctx.tokenizer, body.prompt)
    prompts = [truncate_prompt(p, body.truncate_prompt_tokens, ctx.model.max_model_len, body.truncation_side)
               for p in prompts]
    generation = ctx.start_generation("cmpl", prompts, params, model=body.model)
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
        self.as_id = ctx.tokens_as_ids(body.return_tokens_as_token_ids)  # logprob tokens as "token_id:N"

    def _prompt_ids(self, choice_index: int) -> list[int]:
        return self.generation.prompts[choice_index // self.generation.params.n].token_ids

    def _echo(self, prompt_index: int) -> str:
        if not self.body.echo:
            return ""
        prompt = self.generation.prompts[prompt_index]
        if prompt.text is not None:
            return prompt.text
        return decode(self.ctx.tokenizer, prompt.token_ids) if self.ctx.tokenizer is not None else ""

    def _logprobs(self, entries: list[Logprobs], text_offset: int, prompt: tuple[list[int], list[Logprobs]] | None = None
                  ) -> CompletionLogprobs | None:
        """OpenAI's logprobs of the generated tokens from ``text_offset``; with ``prompt`` (echo: its token ids
        and prompt logprobs) the prompt's tokens first, from offset 0, the first of them without a logprob."""
        if self.body.logprobs is None:
            return None
        tokenizer = self.ctx.tokenizer
        out = CompletionLogprobs()
        as_id = self.as_id
        if prompt is not None:
            prompt_ids, prompt_entries = prompt
            first = token_text(tokenizer, prompt_ids[0], as_id)
            out.tokens.append(first)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(0)
            self._append(out, prompt_entries, len(first), as_id)
        self._append(out, entries, text_offset, as_id)
        return out

    def _append(self, out: CompletionLogprobs, entries: list[Logprobs], text_offset: int, as_id: bool) -> None:
        """Each position's token, its logprob, and its ``top_logprobs`` entry: as vLLM's, the position's own
        token first (sampled, or the prompt's), then the top N (or the ``logprob_token_ids``) not already there,
        so ``logprobs: 0`` still names the chosen token and an entry has N or N + 1 keys."""
        tokenizer = self.ctx.tokenizer
        for entry in entries:
            token = token_text(tokenizer, entry.token_id, as_id)
            logprob = clamp_logprob(entry.logprob)
            out.tokens.append(token)
            out.token_logprobs.append(logprob)
            top = {token: logprob}
            for tid, lp in zip(entry.top_token_ids, entry.top_logprobs):
                top.setdefault(token_text(tokenizer, tid, as_id), clamp_logprob(lp))
            out.top_logprobs.append(top)
            out.text_offset.append(text_offset)
            text_offset += len(token)

    def _echoed(self, index: int, prompt_entries: list[Logprobs] | None) -> tuple[list[int], list[Logprobs]] | None:
        """The prompt part of an echoed choice's logprobs, once its prompt logprobs are there."""
        if not self.body.echo or self.body.logprobs is None or prompt_entries is None:
            return None
        return self._prompt_ids(index), prompt_entries

    def _prompt_logprobs(self, entries: list[Logprobs] | None):
        return prompt_logprobs_view(self.ctx.tokenizer, entries, self.as_id)

    async def response(self) -> CompletionResponse:
        results = await collect(self.generation)
        choices = []
        for index, result in enumerate(results):
            prefix = self._echo(index // self.generation.params.n)
            choice = CompletionChoice(index=index, text=prefix + result.text,
                                      logprobs=self._logprobs(result.logprobs, len(prefix),
                                                              self._echoed(index, result.prompt_logprobs)),
                                      finish_reason=result.finish_reason, stop_reason=result.stop_reason,
                                      prompt_logprobs=self._prompt_logprobs(result.prompt_logprobs))
            if self.body.return_token_ids:
                choice.prompt_token_ids = self._prompt_ids(index)
                choice.token_ids = result.token_ids
            choices.append(choice)
        return CompletionResponse(id=self.id, created=self.created, model=self.generation.model, choices=choices,
                                  usage=usage_info(self.generation.usage(), self.ctx.prompt_tokens_details),
                                  metrics=request_metrics(self.ctx, self.generation))

    async def chunks(self) -> AsyncIterator[CompletionChunk]:
        text_offsets: dict[int, int] = {}  # choice index -> where its next generated text starts
        # --enable-force-include-usage: usage on every chunk and at the end, whatever the request asked (as vLLM).
        continuous = self.body.continuous_usage or self.ctx.force_include_usage
        async with aclosing(self.generation.updates()) as updates:
            async for batch in updates:
                for delta in batch:
                    chunk = self._chunk(delta, text_offsets)
                    if chunk is not None:
                        if continuous:
                            chunk.usage = usage_info(self.generation.usage())
                        yield chunk
        if self.body.include_usage or self.ctx.force_include_usage:
            yield CompletionChunk(id=self.id, created=self.created, model=self.generation.model, choices=[],
                                  usage=usage_info(self.generation.usage(), self.ctx.prompt_tokens_details),
                                  metrics=request_metrics(self.ctx, self.generation))

    def _chunk(self, delta: ChoiceDelta, text_offsets: dict[int, int]) -> CompletionChunk | None:
        text = delta.text
        first = delta.index not in text_offsets
        if first:
            text = self._echo(delta.prompt_index) + text
            text_offsets[delta.index] = len(text) - len(delta.text)
        if not text and not delta.token_ids and delta.finish_reason is None:
            return None  # nothing new (a chunk of a prompt being prefilled)
        # A token that adds no text yet (inside a character, held back for a stop string, or not
        # in the tokenizer) still gets its chunk, as vLLM does: clients see progress and timing.
        logprobs = self._logprobs(delta.logprobs, text_offsets[delta.index],
                                  self._echoed(delta.index, delta.prompt_logprobs) if first else None)
        text_offsets[delta.index] += len(delta.text)
        choice = CompletionStreamChoice(index=delta.index, text=text, logprobs=logprobs,
                                        finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                                        prompt_logprobs=self._prompt_logprobs(delta.prompt_logprobs))
        if self.body.return_token_ids:
            choice.token_ids = list(delta.token_ids)
            if first:
                choice.prompt_token_ids = self._prompt_ids(delta.index)
        return CompletionChunk(id=self.id, created=self.created, model=self.generation.model, choices=[choice])
