"""The HTTP server's flags (listening, authentication, response options, request limits, images, LoRA adapters) and
the checks and objects built from them. The engine's flags come from EngineConfig (``engine_options.py``)."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass

from engine.config import ConfigError
from engine.lora.adapter import LoRAAdapterError
from server.cli.engine_options import served_model_name
from server.limits import ServerLimits
from server.lora import LoRARegistry
from server.reasoning import PARSERS as REASONING_PARSERS
from server.tool_parsers import PARSERS

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def add_model_server_options(group) -> None:
    """How the server reads the model's text: listed with the model's options."""
    group.add_argument("--tool-call-parser", default="auto", choices=["auto", *PARSERS],
                       help="how tool calls are read out of the model's text; auto: from the chat template "
                            "(hermes when it names no format)")
    group.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="split a reasoning model's <think>...</think> off into reasoning_content")


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry (vLLM's ``LoRAModulePath``): the adapter at ``path``, served as model ``name``."""

    name: str
    path: str
    base_model_name: str | None = None


def add_lora_server_options(group) -> None:
    """The adapters served from the start: listed with the engine's LoRA options (``minivllm serve`` only)."""
    group.add_argument("--lora-modules", nargs="+", action="extend", type=_lora_module, default=None,
                       metavar="NAME=PATH",
                       help="LoRA adapters (PEFT's format) to serve, each as name=path or as JSON {\"name\": ..., "
                            "\"path\": ..., \"base_model_name\": ...}; a request names one as its model. Needs "
                            "--enable-lora; each adapter is checked at start-up")


def lora_registry_from_args(args: argparse.Namespace) -> LoRARegistry:
    """The adapters of ``--lora-modules``, each checked now, before the model loads: a bad one fails the start-up
    with the reason."""
    modules = args.lora_modules or []
    if modules and not args.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora (the engine serves adapters only with it)")
    registry = LoRARegistry(served_model_name(args), enabled=args.enable_lora, max_rank=args.max_lora_rank)
    for module in modules:
        try:
            registry.add(module.name, module.path, module.base_model_name)
        except LoRAAdapterError as exc:
            raise ConfigError(f"--lora-modules {module.name}: {exc}") from None
    return registry


def _lora_module(text: str) -> LoRAModule:
    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
        known = {"name", "path", "base_model_name"}
        if not isinstance(fields, dict) or not {"name", "path"} <= set(fields) or set(fields) - known:
            raise argparse.ArgumentTypeError(f"{text!r}: give an object with \"name\" and \"path\" (and optionally "
                                             "\"base_model_name\"), and nothing else")
        if not all(isinstance(value, str) and value for value in fields.values()):
            raise argparse.ArgumentTypeError(f"{text!r}: name, path and base_model_name must be non-empty strings")
        return LoRAModule(**fields)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not name=path (or a JSON object)")
    return LoRAModule(name, path)


def add_server_options(group) -> None:
    """Listening, authentication, what responses carry, request limits, images, shutdown and logs."""
    group.add_argument("--host", default="0.0.0.0", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of host:port")
    group.add_argument("--root-path", default="", help="the path prefix a proxy serves this server under; requests "
                       "may carry it or not (a proxy that strips it); /openapi.json names it")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer <key>' on every route but /health, /version, /load, "
                            "/metrics, /dashboard and the OpenAPI docs; /v1/messages also takes 'x-api-key: <key>' "
                            "(default: $MINIVLLM_API_KEY; none: no authentication)")
    group.add_argument("--metrics-prefix", default="minivllm:", type=_metrics_prefix,
                       help="what every /metrics name starts with; 'vllm:' lets vLLM's Grafana dashboards and "
                            "alerts read this server (the names after it are vLLM's)")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="usage on every stream chunk and a usage chunk at the end, as if stream_options asked "
                            "for include_usage and continuous_usage_stats (vLLM's flag)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat template in a request (chat_template on chat and /tokenize); without it "
                            "such requests are a 400, as in vLLM. Templates render in a bounded sandbox either way")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
                            "cache); left out of usage otherwise, as vLLM does")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="name logprob tokens 'token_id:N' unless a request's return_tokens_as_token_ids says "
                            "otherwise")
    group.add_argument("--enable-prompt-embeds", action="store_true",
                       help="vLLM's flag for prompt embeddings, which minivllm does not take: refused at start-up "
                            "(prompts are text or token ids)")
    group.add_argument("--enable-per-request-metrics", action="store_true",
                       help="timings (time to first token, queue time, ...) in a one-choice response's 'metrics' "
                            "object, or in a stream's usage chunk")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 503 when this many requests already wait to be scheduled; default: no limit")
    _add_limit_args(group)
    _add_media_args(group)
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    group.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                       help="log level of the server and the engine")


def _add_limit_args(group) -> None:
    limits = ServerLimits()
    group.add_argument("--max-request-body-mb", type=float, default=limits.max_request_body_bytes / 2**20,
                       help="largest request body accepted (413 beyond)")
    group.add_argument("--max-choices-per-request", type=int, default=limits.max_choices_per_request,
                       help="most choices one request may ask for: prompts x n (400 beyond)")
    group.add_argument("--max-tokens-limit", type=int, default=None,
                       help="largest max_tokens a request may ask for, and the default for those that give none; "
                            "default: no limit but the context")
    group.add_argument("--max-logprob-entries", type=int, default=limits.max_logprob_entries,
                       help="most logprob entries one response may carry (a whole-vocabulary position counts the "
                            "vocabulary's size): a request that could return more is a 400; 0: no bound, as vLLM")
    group.add_argument("--request-header-timeout", type=float, default=limits.header_timeout_s,
                       help="seconds a connection gets to send a request's headers before it is closed")
    group.add_argument("--request-body-timeout", type=float, default=limits.body_timeout_s,
                       help="seconds a request gets to send its body (408 after)")
    group.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="seconds an idle keep-alive connection stays open")


def _add_media_args(group) -> None:
    # The defaults are server.media.MediaLimits' (not imported here: it brings PIL and httpx; a test keeps them equal).
    group.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="DOMAIN",
                       help="hosts that image URLs in chat requests may be fetched from, space- or comma-separated (a "
                            "domain also allows its subdomains; '*': any host); default: none, remote images are "
                            "refused (data: URLs always work)")
    group.add_argument("--allow-private-media-addresses", action="store_true",
                       help="also fetch images from loopback, private and link-local addresses (refused by default, "
                            "even for allowed domains)")
    group.add_argument("--max-image-mb", type=float, default=20.0,
                       help="largest image accepted, encoded (a data: URL's bytes or a fetched body; 400 beyond)")
    group.add_argument("--max-image-megapixels", type=float, default=50.0,
                       help="most pixels (width x height) an image may have, checked before it is decoded")
    group.add_argument("--max-request-megapixels", type=float, default=100.0,
                       help="most pixels all images of one request may have together, checked from their headers "
                            "before any is decoded")
    group.add_argument("--max-images-per-request", type=int, default=16, help="most images one chat request may carry")
    group.add_argument("--media-fetch-timeout", type=float, default=10.0,
                       help="seconds to fetch one image URL, redirects and body included")


def check_media_args(args: argparse.Namespace) -> None:
    """The image flags' values, checked before the engine starts (MediaLimits itself is built later)."""
    if not (args.max_image_mb > 0 and args.max_image_megapixels > 0 and args.max_request_megapixels > 0
            and args.media_fetch_timeout > 0):
        raise ConfigError("--max-image-mb, --max-image-megapixels, --max-request-megapixels and --media-fetch-timeout "
                          "must be positive")
    if args.max_images_per_request < 0:
        raise ConfigError("--max-images-per-request must be at least 0")
    for domain in _media_domains(args):
        if "/" in domain or "@" in domain or any(c.isspace() for c in domain):
            raise ConfigError(f"--allowed-media-domains: {domain!r} is not a host or a domain (give names like "
                              "'example.com', without scheme or path)")


def media_limits_from_args(args: argparse.Namespace):
    """server.media.MediaLimits from the flags. It imports the HTTP side's image code (PIL, httpx), so
    serve() calls it once the engine core is starting, after check_media_args."""
    from server.media import MediaLimits

    check_media_args(args)
    try:
        return MediaLimits(max_image_bytes=int(args.max_image_mb * 2**20),
                           max_image_pixels=int(args.max_image_megapixels * 1_000_000),
                           max_request_pixels=int(args.max_request_megapixels * 1_000_000),
                           fetch_timeout_s=args.media_fetch_timeout, max_images_per_request=args.max_images_per_request,
                           allowed_domains=_media_domains(args),
                           allow_private=args.allow_private_media_addresses)
    except ValueError as exc:
        raise ConfigError(f"--allowed-media-domains: {exc}") from None


def _media_domains(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(d for entry in args.allowed_media_domains or () for d in entry.split(",") if d.strip())


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    if args.max_request_body_mb <= 0 or args.max_choices_per_request < 1:
        raise ConfigError("--max-request-body-mb must be positive and --max-choices-per-request at least 1")
    if args.max_tokens_limit is not None and args.max_tokens_limit < 1:
        raise ConfigError("--max-tokens-limit must be at least 1")
    if args.max_logprob_entries < 0:
        raise ConfigError("--max-logprob-entries must be at least 0 (0: no bound)")
    return ServerLimits(max_request_body_bytes=int(args.max_request_body_mb * 2**20),
                        max_choices_per_request=args.max_choices_per_request, max_tokens_limit=args.max_tokens_limit,
                        header_timeout_s=args.request_header_timeout, body_timeout_s=args.request_body_timeout,
                        max_logprob_entries=args.max_logprob_entries or None)



def _metrics_prefix(text: str) -> str:
    if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        raise argparse.ArgumentTypeError(f"{text!r} cannot start a Prometheus metric name")
    return text

