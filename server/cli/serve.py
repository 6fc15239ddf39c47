"""``minivllm serve``: load a model, then serve the OpenAI API on uvicorn until SIGTERM (drained first:
``draining_server.py``)."""

from __future__ import annotations

import argparse
import gc
import importlib
import ipaddress
import logging
import sys
from typing import TYPE_CHECKING

import uvicorn

from engine import settings
from engine.config import ConfigError
from engine.frontend.async_engine import AsyncEngine, EngineStartupError
from engine.loading.default_model import default_cache_dir
from server.cli.draining_server import DrainingServer
from server.cli.engine_options import engine_config_from_args, served_model_name
from server.cli.server_options import (
    check_media_args,
    limits_from_args,
    lora_registry_from_args,
    media_limits_from_args,
)
from server.limits import guarded_http_protocol
from server.listeners import bind_tcp, bind_unix, close_all, remove_unix_socket
from server.tool_parsers import parser_for_template

if TYPE_CHECKING:
    from server.serving import ServingContext

# The HTTP side, imported while the engine core process loads the model (FastAPI, pydantic, the routes, the
# metrics: seconds of imports that would otherwise come before the core is even started).
_SERVER_MODULES = ("server.app", "server.metrics", "server.serving")

logger = logging.getLogger("minivllm.server")
_AFTER_DRAIN_GRACE_S = 5  # uvicorn's wait for connections once every request has finished or been aborted


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sockets = []
    try:
        if args.enable_prompt_embeds:
            raise ConfigError("--enable-prompt-embeds: minivllm does not take prompt embeddings; send prompts as text "
                              "or token ids")
        limits = limits_from_args(args)
        check_media_args(args)
        config = engine_config_from_args(args)
        loras = lora_registry_from_args(args)  # the adapters' files checked before the model loads
        # Listening before the model loads: a port in use is an error now, not once the model is loaded.
        sockets = bind_unix(args.uds) if args.uds else bind_tcp(args.host, args.port)
        engine = AsyncEngine.launch(config, args.max_waiting_requests, args.log_level,
                                    while_loading=_import_server_modules)
    except (ConfigError, EngineStartupError, OSError, ValueError) as exc:  # a bad flag or model: say so, no traceback
        logger.debug("the engine could not start", exc_info=True)
        close_all(sockets)
        print(f"minivllm serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        from server.app import build_app
        from server.metrics import ServerMetrics
        from server.serving import ServedModel, ServingContext

        parser = args.tool_call_parser
        if parser == "auto":
            parser = parser_for_template(getattr(engine.tokenizer, "chat_template", None))
        modalities = engine.model.input_modalities  # ("text", "image") for a model that takes images
        image_processor = None
        if engine.model.accepts_images:
            from engine.loading.multimodal import MultiModalProcessor

            image_processor = MultiModalProcessor.from_pretrained(engine.model.model_path, engine.model.image_token_id,
                                                                  args.trust_remote_code)
        model = ServedModel(served_model_name(args), engine.model, engine.tokenizer, tool_parser=parser,
                            reasoning_parser=args.reasoning_parser, input_modalities=modalities,
                            image_processor=image_processor)
        metrics = ServerMetrics(engine, prefix=args.metrics_prefix)
        engine.attach_metrics(metrics)
        ctx = ServingContext(engine, model, metrics, limits, loras=loras, media=media_limits_from_args(args),
                             force_include_usage=args.enable_force_include_usage,
                             trust_request_chat_template=args.trust_request_chat_template,
                             prompt_tokens_details=args.enable_prompt_tokens_details,
                             return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                             per_request_metrics=args.enable_per_request_metrics,
                             api_key=args.api_key or settings.api_key())
        # The prefix is the app's (server.routing.RootPath), not uvicorn's: uvicorn would add it to every path.
        uvicorn_config = uvicorn.Config(build_app(ctx, args.root_path), host=args.host, port=args.port,
                                        uds=args.uds, log_level=args.log_level,
                                        http=guarded_http_protocol(limits.header_timeout_s),
                                        timeout_keep_alive=args.timeout_keep_alive,
                                        timeout_graceful_shutdown=_AFTER_DRAIN_GRACE_S)
        port = sockets[0].getsockname()[1] if not args.uds else args.port  # --port 0: the one the system chose
        server = DrainingServer(uvicorn_config, engine, args.shutdown_timeout, ready_line(args, ctx, engine, port))
        if engine.model.max_logprobs == -1 or engine.model.max_logprobs >= engine.model.vocab_size:
            _warn_whole_vocabulary_logprobs(engine.model.vocab_size, limits.max_logprob_entries)
        if ctx.api_key is None and not args.uds and not _is_loopback(args.host):
            logger.warning("listening on %s without an API key: anyone who can reach this host can use the model "
                           "(set --api-key or MINIVLLM_API_KEY, or --host 127.0.0.1)", args.host)
        gc.collect()
        gc.freeze()  # start-up objects (tokenizer, app, modules) stay out of the collections made while serving
        server.run(sockets)
        return 0 if server.started else 1
    finally:
        close_all(sockets)
        if args.uds:
            remove_unix_socket(args.uds)
        engine.shutdown()


def _warn_whole_vocabulary_logprobs(vocab_size: int, max_entries: int | None) -> None:
    """Requests may ask for every token's logprob at every position: say what one response may then cost."""
    if max_entries is None:
        logger.warning("--max-logprobs allows the logprobs of all %d tokens of the vocabulary at each position, and "
                       "--max-logprob-entries 0 puts no bound on a response: one prompt token's worth is some %.0f MB "
                       "of JSON", vocab_size, vocab_size * 50 / 1e6)
        return
    logger.warning("--max-logprobs allows the logprobs of all %d tokens of the vocabulary at each position; a response "
                   "carries at most %d logprob entries (%d such positions, --max-logprob-entries), a request that "
                   "could return more is a 400", vocab_size, max_entries, max_entries // (vocab_size + 1))


def _import_server_modules() -> None:
    for name in _SERVER_MODULES:
        importlib.import_module(name)


def ready_line(args: argparse.Namespace, ctx: ServingContext, engine: AsyncEngine, port: int) -> str:
    """The one line that says what is served where, and how to reach it."""
    from server.routing import normalize_root_path

    host = "localhost" if args.host in ("0.0.0.0", "::", "127.0.0.1", "::1") else args.host
    root_path = normalize_root_path(args.root_path)
    base = f"http://{host}:{port}{root_path}"
    if args.uds:
        base = f"http+unix://{args.uds}{root_path}"
    key = "required (Authorization: Bearer, or x-api-key on /v1/messages)" if ctx.api_key else "not required"
    cache = f"; model cache {default_cache_dir()}" if args.model is None else ""
    return (f"ready: {ctx.model.name!r} ({ctx.model.path}) at {base}/v1; dashboard {base}/dashboard, metrics "
            f"{base}/metrics; API key {key}; {chat_default_limit(ctx)}; engine core process {engine.engine_pid}"
            f"{cache}")


def chat_default_limit(ctx: ServingContext) -> str:
    """How long a chat request without max_tokens may generate (vLLM's default: to the end of the context)."""
    limit = ctx.limits.max_tokens_limit
    configured = ctx.model.info.sampling_defaults.get("max_tokens")  # the generation config's max_new_tokens
    if configured is not None:
        if limit is not None and limit < configured:
            return f"chat requests without max_tokens: {limit} tokens (--max-tokens-limit, below the generation config's)"
        cap = f"at most {limit}" if limit is not None else "no cap"
        return f"chat requests without max_tokens: {configured} tokens (generation config; --max-tokens-limit: {cap})"
    if limit is not None:
        return f"chat requests without max_tokens: {limit} tokens (--max-tokens-limit)"
    return (f"chat requests without max_tokens: up to the end of the context ({ctx.model.max_model_len} tokens with "
            "the prompt; --max-tokens-limit N sets a default)")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
