"""The FastAPI app: OpenAI's routes (the Responses API among them), Anthropic's Messages API, plus health,
version, metrics, (de)tokenization and the KV dashboard.

The engine client starts receiving outputs with the app, and the engine core process is shut
down with it (the app's lifespan). Every route defined on the app itself is protected: with an
API key it needs ``Authorization: Bearer <key>``, checked by the route (server/routing.py) before
its body is read, whatever prefix or proxy the request came through. The Anthropic routes
(server/anthropic_messages.py) are protected too, and also take the key as ``x-api-key``.
``/health``, ``/version``, ``/load`` and ``/metrics`` (the ops router), ``/dashboard`` and the
OpenAPI document stay open for probes, scrapers and people. The routes that load and unload LoRA
adapters exist only with ``MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING`` (as vLLM's), and are protected too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from pydantic import ValidationError

from engine import settings
from engine.lora.adapter import LoRAAdapterError
from engine.lora.request import LoRARequest
from server import __version__
from server.anthropic_messages import add_anthropic_routes
from server.chat import create_chat_completion, render_chat_request
from server.completions import create_completion
from server.dashboard import dashboard_router
from server.embeddings import create_embedding
from server.errors import SERVER_ERROR, APIError, bad_request, install_error_handlers
from server.limits import BodyLimit
from server.lora import LoRANameError, UnknownAdapterError
from server.openapi import (
    CHAT_RESPONSES,
    COMPLETION_RESPONSES,
    INVOCATION_RESPONSES,
    error_responses,
    install_openapi,
)
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from server.protocol.embeddings import EmbeddingRequest, EmbeddingResponse
from server.protocol.models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from server.protocol.scoring import (
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from server.responses import add_responses_routes
from server.routing import RootPath, guarded_route_class
from server.scoring import create_pooling, create_rerank, create_score
from server.serving import ServingContext
from server.streaming import ClientDisconnected, client_closed_response
from server.tokenization import ChatTemplateOptions, check_token_ids, decode, encode, require_tokenizer

logger = logging.getLogger("minivllm.server")


def build_app(ctx: ServingContext, root_path: str = "") -> FastAPI:
    """The app, served under ``root_path`` (a proxy's prefix, which requests may carry or not)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.engine.start()
        try:
            yield
        finally:
            await ctx.engine.stop()

    app = FastAPI(title="minivllm", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    if root_path:
        app.add_middleware(RootPath, root_path=root_path)
    body_limit = BodyLimit(ctx.limits.max_request_body_bytes, ctx.limits.body_timeout_s)
    # Protected unless said otherwise: a route added to the app later needs the key too.
    app.router.route_class = guarded_route_class(ctx.api_key or None, body_limit)
    _add_openai_routes(app, ctx)
    _add_tokenizer_routes(app, ctx)
    add_anthropic_routes(app, ctx, body_limit)
    add_responses_routes(app, ctx)
    if settings.allow_runtime_lora_updating():
        _add_lora_routes(app, ctx)
    ops = APIRouter(route_class=guarded_route_class(None, body_limit))
    _add_ops_routes(ops, ctx)
    app.include_router(ops)
    app.include_router(dashboard_router(ctx))
    install_openapi(app)
    return app


def _add_openai_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/completions", response_model=None, responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(body, raw_request, ctx)

    @app.post("/v1/chat/completions", response_model=None, responses=CHAT_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(body, raw_request, ctx)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=error_responses(400, 401, 404, 408, 413,
                                                                                           503))
    async def embeddings(body: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
        """One vector per input, from a model served with ``--runner pooling``."""
        return await create_embedding(body, raw_request, ctx)

    errors = error_responses(400, 401, 404, 408, 413, 503)

    @app.post("/score", response_model=ScoreResponse, responses=errors)
    async def score(body: ScoreRequest, raw_request: Request) -> ScoreResponse:
        """vLLM's: scores of text pairs, from a classifier (cross-encoder) or an embedding model's cosine."""
        return await create_score(body, raw_request, ctx)

    @app.post("/rerank", response_model=RerankResponse, responses=errors)
    @app.post("/v1/rerank", response_model=RerankResponse, responses=errors)
    async def rerank(body: RerankRequest, raw_request: Request) -> RerankResponse:
        """Jina's and Cohere's: a query's documents, most relevant first."""
        return await create_rerank(body, raw_request, ctx)

    @app.post("/pooling", response_model=PoolingResponse, responses=errors)
    async def pooling(body: PoolingRequest, raw_request: Request) -> PoolingResponse:
        """vLLM's: each input's pooled output (an embedding, or a classifier's logits)."""
        return await create_pooling(body, raw_request, ctx)

    @app.post("/invocations", response_model=None, responses=INVOCATION_RESPONSES,
              openapi_extra={"requestBody": {"content": {"application/json": {"schema": {"oneOf": [
                  {"$ref": "#/components/schemas/ChatCompletionRequest"},
                  {"$ref": "#/components/schemas/CompletionRequest"}]}}}, "required": True}})
    async def invocations(raw_request: Request) -> Response:
        """SageMaker's endpoint: a chat completion when the body has ``messages``, else a completion."""
        try:
            body = json.loads(await raw_request.body())
        except ValueError as exc:
            raise bad_request(f"the body is not JSON: {exc}", param=None) from None
        except RecursionError:  # json.loads recurses once per nesting level
            raise bad_request("the body's JSON is nested too deeply", param=None) from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object", param=None)
        try:
            if "messages" in body:
                return await create_chat_completion(ChatCompletionRequest.model_validate(body), raw_request, ctx)
            if "prompt" in body:
                return await create_completion(CompletionRequest.model_validate(body), raw_request, ctx)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        raise bad_request("give 'messages' (a chat completion) or 'prompt' (a completion)", param="messages")

    def card(adapter: LoRARequest | None = None) -> ModelCard:
        # vLLM's root is the model it was given, a Hugging Face name; here that is a local directory, whose path
        # would tell every client how the host is laid out, so the root is the name clients use. An adapter's
        # root is its path, as vLLM's (the operator or a client chose it), and its parent the model it adapts.
        base = ModelCard(id=ctx.model.name, root=ctx.model.name, max_model_len=ctx.model.max_model_len,
                         input_modalities=list(ctx.model.input_modalities), runner=ctx.model.info.runner)
        if adapter is None:
            return base
        return base.model_copy(update={"id": adapter.lora_name, "root": adapter.lora_path,
                                       "parent": adapter.base_model_name or ctx.model.name})

    @app.get("/v1/models", responses=error_responses(401))
    async def models() -> ModelList:
        return ModelList(data=[card(), *(card(adapter) for adapter in ctx.loras)])

    @app.get("/v1/models/{model_id:path}", responses=error_responses(401, 404))
    async def model(model_id: str) -> ModelCard:
        return card(ctx.check_model(model_id))


def _add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    """vLLM's routes that load and unload LoRA adapters while serving, answered in plain text as vLLM's. Defined on
    the app, so that they check the API key as its other routes (and the OpenAPI document says so)."""
    text = {200: {"description": "What was done, in plain text.", "content": {"text/plain": {"schema": {
        "type": "string"}}}}}

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
              responses={**text, **error_responses(400, 401, 408, 413)})
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Serve the PEFT adapter at ``lora_path`` (a directory on the server's host) as model ``lora_name``,
        once its files are checked (a 400 says what is wrong with them)."""
        if not ctx.loras.enabled:
            raise bad_request("LoRA adapters are not enabled on this server: start it with --enable-lora",
                              param="lora_name", code="lora_not_enabled")
        try:
            adapter = await asyncio.to_thread(ctx.loras.add, body.lora_name, body.lora_path)  # reads files
        except LoRAAdapterError as exc:
            param = "lora_name" if isinstance(exc, LoRANameError) else "lora_path"
            raise bad_request(str(exc), param=param, code="invalid_lora_adapter") from None
        logger.info("loaded LoRA adapter %r (lora_int_id %d) from %s", adapter.lora_name, adapter.lora_int_id,
                    adapter.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              responses={**text, **error_responses(400, 401, 404, 408, 413)})
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Stop serving an adapter: new requests that name it are a 404, those running finish under it."""
        try:
            adapter = ctx.loras.remove(body.lora_name, body.lora_int_id)
        except LoRAAdapterError as exc:
            raise bad_request(str(exc), param="lora_name") from None
        except UnknownAdapterError as exc:
            raise APIError(404, str(exc), param="lora_name", code="lora_adapter_not_found") from None
        logger.info("unloaded LoRA adapter %r (lora_int_id %d)", adapter.lora_name, adapter.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.lora_name}' removed successfully.")


def _add_tokenizer_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 401, 404, 408, 413))
    async def tokenize(body: TokenizeRequest, raw_request: Request) -> TokenizeResponse | Response:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
        chat_only = {"tools": body.tools, "chat_template_kwargs": body.chat_template_kwargs,
                     "chat_template": body.chat_template, "continue_final_message": body.continue_final_message or None}
        given = [name for name, value in chat_only.items() if value is not None]
        if body.messages is None and given:
            raise bad_request(f"{given[0]} goes with 'messages'", param=given[0])
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
            options = ChatTemplateOptions(body.add_generation_prompt, body.continue_final_message,
                                          body.chat_template, body.chat_template_kwargs)
            try:
                rendered = await render_chat_request(ctx, body.messages, options, tools, raw_request=raw_request)
            except ClientDisconnected:
                return client_closed_response()
            token_ids = rendered.prompt_token_ids
        else:
            tokenizer = require_tokenizer(ctx.tokenizer, "prompt", "text cannot be tokenized")
            ctx.text_bound.check(body.prompt, "prompt")  # before the tokenizer thread: what cannot be a prompt
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            token_ids = await ctx.in_tokenizer_thread(encode, tokenizer, body.prompt, add_special)
        strs = None
        if body.return_token_strs:
            if ctx.tokenizer is None:
                raise bad_request("this model has no tokenizer, so its tokens have no strings",
                                  param="return_token_strs")
            strs = await ctx.in_tokenizer_thread(ctx.tokenizer.convert_ids_to_tokens, token_ids)
        return TokenizeResponse(count=len(token_ids), max_model_len=ctx.model.max_model_len, tokens=token_ids,
                                token_strs=strs)

    @app.get("/tokenizer_info", responses=error_responses(400, 401))
    async def tokenizer_info() -> dict:
        """The tokenizer's configuration (its class, special tokens, chat template), as vLLM reports it."""
        tokenizer = require_tokenizer(ctx.tokenizer, "model", "it has no tokenizer to describe")
        info = {key: value for key, value in tokenizer.init_kwargs.items() if _json_value(value)}
        info.update(tokenizer_class=type(tokenizer).__name__, vocab_size=len(tokenizer),
                    chat_template=getattr(tokenizer, "chat_template", None),
                    special_tokens={k: str(v) for k, v in tokenizer.special_tokens_map.items()})
        return info

    @app.post("/detokenize", responses=error_responses(400, 401, 404, 408, 413))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """Token ids to text: at most a context's worth of them (``max_model_len``), decoded off the event loop."""
        ctx.check_model(body.model)
        tokenizer = require_tokenizer(ctx.tokenizer, "tokens", "token ids cannot be turned into text")
        if len(body.tokens) > ctx.model.max_model_len:
            raise bad_request(f"{len(body.tokens)} token ids: /detokenize takes at most {ctx.model.max_model_len} "
                              "(max_model_len, what one context holds)", param="tokens")
        check_token_ids(body.tokens, ctx.model.vocab_size, "tokens")
        try:
            text = await ctx.in_tokenizer_thread(decode, tokenizer, body.tokens)
        except Exception as exc:  # noqa: BLE001 - ids past the tokenizer's own vocabulary (padded embeddings)
            raise bad_request(f"these token ids cannot be decoded: {exc}", param="tokens") from exc
        return DetokenizeResponse(prompt=text)


def _add_ops_routes(app: APIRouter, ctx: ServingContext) -> None:
    @app.head("/health", include_in_schema=False)
    @app.get("/health", responses=error_responses(503))
    async def health() -> dict:
        engine = ctx.engine
        if engine.dead_error is not None:
            raise APIError(503, f"the engine stopped after an error: {engine.dead_error}", SERVER_ERROR,
                           code="engine_dead")
        if engine.draining:
            raise APIError(503, "the server is shutting down", SERVER_ERROR, code="shutting_down")
        if not engine.healthy:
            raise APIError(503, "the engine is not running", SERVER_ERROR, code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/load")
    async def load() -> dict:
        """Requests this server is handling now (vLLM's server load), for load balancers."""
        return {"server_load": ctx.engine.num_in_flight}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def metrics() -> Response:
        content, content_type = ctx.metrics.render()
        return Response(content=content, media_type=content_type)


def _json_value(value) -> bool:
    """Plain JSON data (a tokenizer's init kwargs also hold paths' objects and token objects)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
