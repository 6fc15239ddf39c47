"""``POST /score``, ``/rerank`` (``/v1/rerank``) and ``/pooling`` on a server started with ``--runner pooling``.

Scores follow ``engine.frontend.scores``: a classifier (cross-encoder reranker) reads each (query, document) pair
as one prompt and scores its logits; an embedding model embeds every text once and scores the cosine. Rerank is the
same scores of one query against its documents, best first, cut to ``top_n``.
"""

from __future__ import annotations

import uuid

from fastapi import Request

from engine.errors import RequestError
from engine.frontend.scores import classifier_score, cosine, pair_token_ids, pairs
from engine.sampling_params import PoolingParams
from server.embeddings import input_prompts, pool
from server.errors import bad_request
from server.protocol.scoring import (
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)
from server.serving import ServingContext
from server.tokenization import TokenizedPrompt, check_unicode, encode


async def _scores(ctx: ServingContext, text_pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens it took."""
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer, so texts cannot be scored", param="model")
    text_pairs = [(ctx.text_bound.admit(a, "text_1", None), ctx.text_bound.admit(b, "text_2", None))
                  for a, b in text_pairs]
    for a, b in text_pairs:
        check_unicode(a, "text_1"), check_unicode(b, "text_2")
    if ctx.model.info.num_labels:
        prompts = [TokenizedPrompt(await ctx.in_tokenizer_thread(pair_token_ids, ctx.tokenizer, a, b))
                   for a, b in text_pairs]
        logits = await pool(ctx, "score", prompts, PoolingParams())
        return [classifier_score(v) for v in logits], sum(len(p.token_ids) for p in prompts)
    texts = sorted({text for pair in text_pairs for text in pair})  # each text embedded once
    prompts = [TokenizedPrompt(await ctx.in_tokenizer_thread(encode, ctx.tokenizer, t), t) for t in texts]
    vectors = dict(zip(texts, await pool(ctx, "score", prompts, PoolingParams())))
    return [cosine(vectors[a], vectors[b]) for a, b in text_pairs], sum(len(p.token_ids) for p in prompts)


async def create_score(body: ScoreRequest, raw_request: Request, ctx: ServingContext) -> ScoreResponse:
    ctx.check_model(body.model, pooling=True)
    try:
        text_pairs = pairs(body.text_1, body.text_2)
    except RequestError as exc:
        raise bad_request(str(exc), param=exc.param) from None
    scores, num_tokens = await _scores(ctx, text_pairs)
    return ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=ctx.model.name,
                         data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                         usage=ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


async def create_rerank(body: RerankRequest, raw_request: Request, ctx: ServingContext) -> RerankResponse:
    ctx.check_model(body.model, pooling=True)
    if not body.documents:
        raise bad_request("documents must not be empty", param="documents")
    scores, num_tokens = await _scores(ctx, [(body.query, d) for d in body.documents])
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=body.documents[i]) if body.return_documents else None)
               for i in order]
    return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=ctx.model.name,
                          usage=RerankUsage(total_tokens=num_tokens), results=results)


async def create_pooling(body: PoolingRequest, raw_request: Request, ctx: ServingContext) -> PoolingResponse:
    ctx.check_model(body.model, pooling=True)
    prompts = await input_prompts(body.input, ctx)
    vectors = await pool(ctx, "pool", prompts, PoolingParams())
    num_tokens = sum(len(p.token_ids) for p in prompts)
    return PoolingResponse(id=f"pool-{uuid.uuid4().hex}", model=ctx.model.name,
                           data=[PoolingData(index=i, data=v) for i, v in enumerate(vectors)],
                           usage=ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
