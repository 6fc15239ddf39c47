"""``POST /v1/embeddings``: one vector per input, from a model served with ``--runner pooling``.

Each input is a pooling request (``SamplingParams.pooling``): the engine runs its prompt through the same scheduler,
paged KV and prefix cache as any prompt, and answers the final hidden state of its last token, L2-normalised
(``engine/worker/pooling.py``). A server that generates answers 400 here, naming ``--runner pooling``.
"""

from __future__ import annotations

import base64
from contextlib import aclosing

import numpy as np
from fastapi import Request

from engine.sampling_params import PoolingParams, SamplingParams
from server.errors import SERVER_ERROR, APIError, bad_request
from server.protocol.embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from server.serving import ServingContext
from server.tokenization import TokenizedPrompt, admit_prompt_text, encode_completion_prompts, has_text


async def create_embedding(body: EmbeddingRequest, raw_request: Request, ctx: ServingContext) -> EmbeddingResponse:
    ctx.check_model(body.model, pooling=True)
    if ctx.model.info.num_labels:
        raise bad_request("this model is a classifier: it scores text pairs (/score, /rerank), it does not embed",
                          param="model")
    prompts = await input_prompts(body.input, ctx)
    vectors = await pool(ctx, "embd", prompts, PoolingParams(dimensions=body.dimensions))
    num_tokens = sum(len(p.token_ids) for p in prompts)
    data = [Embedding(index=i, embedding=_encode(v, body.encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingResponse(data=data, model=ctx.model.name, usage=EmbeddingUsage(prompt_tokens=num_tokens,
                                                                                    total_tokens=num_tokens))


async def input_prompts(given, ctx: ServingContext) -> list[TokenizedPrompt]:
    """An embeddings or pooling request's ``input``: a string, strings, token ids or lists of them."""
    if given in ("", []) or (isinstance(given, list) and any(p in ("", []) for p in given)):
        raise bad_request("input must not be empty (an empty string or list has no token to embed)", param="input")
    if has_text(given):
        text = admit_prompt_text(given, ctx.text_bound, None)
        return await ctx.in_tokenizer_thread(encode_completion_prompts, ctx.tokenizer, text)
    return encode_completion_prompts(ctx.tokenizer, given)


async def pool(ctx: ServingContext, prefix: str, prompts: list[TokenizedPrompt],
               pooling: PoolingParams) -> list[list[float]]:
    """Each prompt's pooled output, in order, through the engine (the base model's: the routes refuse adapters)."""
    generation = ctx.start_generation(prefix, prompts, SamplingParams(pooling=pooling), model=None)
    vectors: list[list[float] | None] = [None] * len(prompts)
    async with aclosing(generation.updates()) as updates:
        async for batch in updates:
            for delta in batch:
                if delta.pooled is not None:
                    vectors[delta.prompt_index] = delta.pooled
    missing = [i for i, v in enumerate(vectors) if v is None]
    if missing:  # aborted (the engine shut down under it)
        raise APIError(503, f"the engine ended input {missing[0]} without its output (it is shutting down)",
                       SERVER_ERROR, code="shutting_down")
    return vectors


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
