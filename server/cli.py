"""``minivllm serve``: load a model, then serve the OpenAI API on uvicorn until SIGTERM.

Shutdown is graceful: the first SIGTERM (or Ctrl-C) stops admitting requests (503),
lets those in flight finish for up to ``--shutdown-timeout`` seconds, aborts the rest
(their streams end with ``finish_reason: "abort"``), and only then lets uvicorn close
its connections and exit with status 0. A second signal skips the wait: the streams still
open end with an error event and ``[DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib
import ipaddress
import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from engine import settings
from engine.config import ConfigError, EngineConfig
from engine.frontend.async_engine import AsyncEngine, EngineStartupError
from engine.loading.default_model import DEFAULT_MODEL_NAME, default_cache_dir
from server import __version__
from server.limits import ServerLimits, guarded_http_protocol
from server.listeners import bind_tcp, bind_unix, close_all, remove_unix_socket
from server.reasoning import PARSERS as REASONING_PARSERS
from server.tool_parsers import PARSERS, parser_for_template

if TYPE_CHECKING:
    from server.serving import ServingContext

# The HTTP side, imported while the engine core process loads the model (FastAPI, pydantic, the routes, the
# metrics: seconds of imports that would otherwise come before the core is even started). This module stays
# light because the core process imports it too (multiprocessing's spawn re-imports the main module).
_SERVER_MODULES = ("server.app", "server.metrics", "server.serving")

logger = logging.getLogger("minivllm.server")

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_AFTER_DRAIN_GRACE_S = 5  # uvicorn's wait for connections once every request has finished or been aborted


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only when it says something (not None, not a plain off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="A small, readable LLM inference server.")
    parser.add_argument("--version", action="version", version=f"minivllm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /tokenize, /detokenize, /health, /version, /metrics).",
        formatter_class=_HelpFormatter,
    )
    _add_model_args(serve.add_argument_group("model"))
    _add_kvcache_args(serve.add_argument_group("KV cache"))
    _add_scheduler_args(serve.add_argument_group("scheduling and execution"))
    _add_parallel_args(serve.add_argument_group("tensor parallelism"))
    _add_server_args(serve.add_argument_group("HTTP server"))
    worker = commands.add_parser(
        "worker", help="run this machine's tensor-parallel ranks of an engine served from another machine",
        description="Run the tensor-parallel ranks of this node (--node-rank N > 0) for a `minivllm serve` on node "
                    "0. Give the same model, KV cache, scheduling and parallel options as the server.",
        formatter_class=_HelpFormatter,
    )
    _add_model_args(worker.add_argument_group("model"))
    _add_kvcache_args(worker.add_argument_group("KV cache"))
    _add_scheduler_args(worker.add_argument_group("scheduling and execution"))
    _add_parallel_args(worker.add_argument_group("tensor parallelism"))
    worker.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def _add_parallel_args(group) -> None:
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=_DEFAULTS["tensor_parallel_size"],
                       help="split every layer over this many ranks (GPUs, or CPU processes), one process each")
    group.add_argument("--nnodes", type=int, default=_DEFAULTS["nnodes"],
                       help="machines the ranks are spread over (tensor-parallel-size / nnodes on each)")
    group.add_argument("--node-rank", type=int, default=_DEFAULTS["node_rank"],
                       help="this machine's index: 0 runs the server and rank 0, the others `minivllm worker`")
    group.add_argument("--master-addr", default=_DEFAULTS["master_addr"],
                       help="address of node 0, where the ranks meet (torch.distributed's rendezvous)")
    group.add_argument("--master-port", type=int, default=_DEFAULTS["master_port"],
                       help="port on node 0 where the ranks meet; 0: a free one (one machine only)")
    group.add_argument("--distributed-timeout", type=float, default=_DEFAULTS["distributed_timeout_s"],
                       help="seconds a collective may wait before the engine fails (a rank died or hangs)")


def _add_model_args(group) -> None:
    group.add_argument("--model", default=None,
                       help="Hugging Face model directory; default: the embedded SmolLM2-135M-Instruct "
                            "(converted into ~/.cache/minivllm on first use)")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory; default: the model directory")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="run the Python code a model directory ships for its config, tokenizer or processor "
                            "(transformers' auto_map); the model itself always runs on this engine's own code")
    group.add_argument("--served-model-name", default=None,
                       help="the model name clients send; default: the model directory's name "
                            f"({DEFAULT_MODEL_NAME} for the default model)")
    group.add_argument("--dtype", default=_DEFAULTS["dtype"], choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights and activations; auto: bfloat16 on CUDA, float32 on CPU")
    group.add_argument("--device", default=_DEFAULTS["device"], help="auto, cpu, cuda or cuda:N")
    group.add_argument("--load-format", default=_DEFAULTS["load_format"], choices=["auto", "safetensors", "dummy"],
                       help="dummy: random weights (for benchmarks and tests)")
    group.add_argument("--quantization", "-q", default=_DEFAULTS["quantization"], choices=["fp8"],
                       help="fp8: quantize the linear layers' weights to float8_e4m3 at load time (a scale per output "
                            "channel, activations per token at run time); checkpoints stored in FP8 need no flag")
    group.add_argument("--tool-call-parser", default="auto", choices=["auto", *PARSERS],
                       help="how tool calls are read out of the model's text; auto: from the chat template "
                            "(hermes when it names no format)")
    group.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                       help="split a reasoning model's <think>...</think> off into reasoning_content")
    group.add_argument("--generation-config", default=_DEFAULTS["generation_config"],
                       help="request defaults for temperature, top_p, top_k, min_p, repetition_penalty and "
                            "max_tokens: 'auto' reads the model's generation_config.json, 'vllm' ignores it, or a "
                            "folder holding one")
    group.add_argument("--seed", type=int, default=_DEFAULTS["seed"], help="random seed of the engine")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length (prompt + output) in tokens; default: the model's maximum")


def _add_kvcache_args(group) -> None:
    group.add_argument("--kvcache-block-size", type=int, default=_DEFAULTS["kvcache_block_size"],
                       help="tokens per KV cache block (a multiple of 8)")
    group.add_argument("--kv-cache-dtype", default=_DEFAULTS["kv_cache_dtype"], choices=["auto", "fp8", "fp8_e4m3"],
                       help="auto: K/V in the model's dtype; fp8 (= fp8_e4m3): float8_e4m3 with a float32 scale per "
                            "token and KV head, about twice the tokens in the same memory")
    group.add_argument("--num-kvcache-blocks", type=int, default=_DEFAULTS["num_kvcache_blocks"],
                       help="KV cache blocks in the pool; -1: size the pool from the memory budget")
    group.add_argument("--gpu-memory-utilization", type=float, default=_DEFAULTS["gpu_memory_utilization"],
                       help="fraction of GPU memory the engine may use (weights, activations and KV cache)")
    group.add_argument("--cpu-kvcache-space-gib", type=float, default=_DEFAULTS["cpu_kvcache_space_gib"],
                       help="KV cache size in GiB when running on the CPU")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=_DEFAULTS["enable_prefix_caching"],
                       help="share the KV cache blocks of common prompt prefixes between requests")


def _add_scheduler_args(group) -> None:
    group.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"],
                       help="most requests in one running batch")
    group.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS["max_num_batched_tokens"],
                       help="token budget of one engine step")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=_DEFAULTS["enable_chunked_prefill"],
                       help="split long prompts across steps so they share steps with decodes")
    group.add_argument("--max-logprobs", type=int, default=_DEFAULTS["max_logprobs"],
                       help="the most logprobs a request may ask for per token (logprobs, top_logprobs, "
                            "prompt_logprobs); -1: the whole vocabulary, which -1 in a request asks for")
    group.add_argument("--attention-backend", default=_DEFAULTS["attention_backend"],
                       choices=["auto", "torch", "triton"], help="auto: triton on CUDA, torch elsewhere")
    group.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    group.add_argument("--cuda-graph-max-tokens", type=int, default=_DEFAULTS["cuda_graph_max_tokens"],
                       help="steps that mix decodes with prefill chunks replay a CUDA graph up to this many tokens "
                            "(padded to the next captured size); larger steps run eagerly; 0: all of them do")
    group.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=None,
                       help="queue the next step on the device before handing out this step's tokens; "
                            "default: on with CUDA, off on the CPU")
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="also plan each step before the previous step's tokens are known, so the device "
                            "does not wait for the host between decode steps; default: on with CUDA")
    group.add_argument("--structured-outputs-max-bytes", type=int, default=_DEFAULTS["structured_outputs_max_bytes"],
                       help="largest structured-output spec a request may give (its JSON schema, regex, EBNF "
                            "grammar, structural tag or choices, in UTF-8 bytes; 400 beyond)")
    group.add_argument("--structured-outputs-compile-timeout", type=float,
                       default=_DEFAULTS["structured_outputs_compile_timeout_s"],
                       help="seconds a grammar may take to compile; past it its request fails with a 400 (or its "
                            "stream's error event) and the server goes on")
    group.add_argument("--xgrammar-cache-mb", type=int, default=_DEFAULTS["xgrammar_cache_mb"],
                       help="memory xgrammar's cache of compiled grammars may hold, least recently used out first "
                            "(vLLM's VLLM_XGRAMMAR_CACHE_MB); 0: no cache")


def _add_server_args(group) -> None:
    group.add_argument("--host", default="0.0.0.0", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of host:port")
    group.add_argument("--root-path", default="", help="the path prefix a proxy serves this server under; requests "
                       "may carry it or not (a proxy that strips it); /openapi.json names it")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer <key>' on every route but /health, /version, /load, "
                            "/metrics, /dashboard and the OpenAPI docs (default: $MINIVLLM_API_KEY; none: no "
                            "authentication)")
    group.add_argument("--metrics-prefix", default="minivllm:", type=_metrics_prefix,
                       help="what every /metrics name starts with; 'vllm:' lets vLLM's Grafana dashboards and "
                            "alerts read this server (the names after it are vLLM's)")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="usage on every stream chunk and a usage chunk at the end, as if stream_options asked "
                            "for include_usage and continuous_usage_stats (vLLM's flag)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat template in a request (chat_template on chat and /tokenize); without it such "
                            "requests are a 400, as in vLLM. Templates render in a bounded sandbox either way")
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
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
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


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, served_model_name=served_model_name(args), dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        generation_config=args.generation_config,
        device=args.device, load_format=args.load_format, seed=args.seed, max_model_len=args.max_model_len,
        kvcache_block_size=args.kvcache_block_size, num_kvcache_blocks=args.num_kvcache_blocks,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
        gpu_memory_utilization=args.gpu_memory_utilization, cpu_kvcache_space_gib=args.cpu_kvcache_space_gib,
        enable_prefix_caching=args.enable_prefix_caching, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=args.enable_chunked_prefill,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        overlap_steps=args.overlap_steps, async_scheduling=args.async_scheduling, max_logprobs=args.max_logprobs,
        tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, distributed_timeout_s=args.distributed_timeout,
        structured_outputs_max_bytes=args.structured_outputs_max_bytes,
        structured_outputs_compile_timeout_s=args.structured_outputs_compile_timeout,
        xgrammar_cache_mb=args.xgrammar_cache_mb,
    )


def served_model_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(args.model)
    return path.name if path.exists() else args.model


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first exit signal drains the engine before uvicorn shuts down.

    uvicorn closes its listening sockets as soon as it starts shutting down; draining first
    keeps them open, so a client arriving during the drain gets a 503 rather than a refused
    connection. A second signal ends the drain at once: the app's shutdown stops the engine, so
    every open stream ends with an error event and ``[DONE]`` before uvicorn closes the
    connections (rather than uvicorn cancelling them mid-stream). A third one stops waiting for
    anything. Signals are not re-raised after shutdown, so the process exits with 0.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout_s: float,
                 ready_line: str = ""):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.ready_line = ready_line
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None
        self._num_signals = 0

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)  # exits the process if the app's start-up fails
        if self.started and self.ready_line:
            logger.info("%s", self.ready_line)

    def handle_exit(self, sig, frame) -> None:
        self._num_signals += 1
        if self._loop is None or self._num_signals > 2:
            self.force_exit = self.should_exit  # a signal while uvicorn already shuts down: stop waiting
            self.should_exit = True
            return
        start = self._start_drain if self._num_signals == 1 else self._start_stop
        self._loop.call_soon_threadsafe(start)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    def _start_stop(self) -> None:
        self._stop_task = asyncio.get_running_loop().create_task(self._stop_now())

    async def _drain(self) -> None:
        try:
            logger.info("shutting down: no new requests; %d in flight get up to %.1f s to finish (signal again to "
                        "stop them now)", self.engine.num_in_flight, self.shutdown_timeout_s)
            num_aborted = await self.engine.drain(self.shutdown_timeout_s)
            if num_aborted:
                logger.info("aborted %d requests that did not finish in time", num_aborted)
        finally:
            self.should_exit = True

    async def _stop_now(self) -> None:
        """The second signal: no more waiting for the requests in flight."""
        logger.info("stopping now: %d requests in flight end with an error", self.engine.num_in_flight)
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
            await asyncio.gather(self._drain_task, return_exceptions=True)
        try:
            # The app's shutdown stops the engine, which fails every open stream (an error event, then [DONE]);
            # uvicorn's own call to it later finds it done.
            await self.lifespan.shutdown()
        finally:
            self.should_exit = True


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sockets = []
    try:
        if args.enable_prompt_embeds:
            raise ConfigError("--enable-prompt-embeds: minivllm does not take prompt embeddings; send prompts as text "
                              "or token ids")
        limits = limits_from_args(args)
        check_media_args(args)
        # Listening before the model loads: a port in use is an error now, not once the model is loaded.
        sockets = bind_unix(args.uds) if args.uds else bind_tcp(args.host, args.port)
        engine = AsyncEngine.launch(engine_config_from_args(args), args.max_waiting_requests, args.log_level,
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
        ctx = ServingContext(engine, model, metrics, limits, media=media_limits_from_args(args),
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
    key = "required (Authorization: Bearer)" if ctx.api_key else "not required"
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


def _metrics_prefix(text: str) -> str:
    if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        raise argparse.ArgumentTypeError(f"{text!r} cannot start a Prometheus metric name")
    return text


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def worker(args: argparse.Namespace) -> int:
    """This node's ranks (``--node-rank`` > 0) of an engine whose rank 0 is a `minivllm serve` elsewhere."""
    from engine.worker.ranks import run_node

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        if config.node_rank == 0:
            raise ConfigError("node 0 runs `minivllm serve`; `minivllm worker` is for --node-rank 1 and up")
    except (ConfigError, ValueError) as exc:
        print(f"minivllm worker: error: {exc}", file=sys.stderr)
        return 2
    return run_node(config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "worker":
        return worker(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
