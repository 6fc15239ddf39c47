"""The ``minivllm`` command line: ``serve`` and ``worker``, their options grouped as ``--help`` lists them.

    group                       serve                                       worker
    model                       EngineConfig's + --tool-call-parser,        the same
                                --reasoning-parser
    KV cache                    EngineConfig's                              the same
    scheduling and execution    EngineConfig's                              the same
    tensor parallelism          EngineConfig's                              the same
    LoRA adapters               EngineConfig's + --lora-modules             EngineConfig's
    HTTP server                 server_options.add_server_options           --log-level only

A worker takes the same model, KV cache, scheduling and parallel options as the server it joins, so one command
line serves both.
"""

from __future__ import annotations

import argparse

from engine.config import LORA, MODEL, OPTION_GROUPS
from server import __version__
from server.cli.engine_options import add_engine_options
from server.cli.server_options import LOG_LEVELS, add_lora_server_options, add_model_server_options, add_server_options


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
    add_lora_server_options(_add_engine_groups(serve)[LORA])
    add_server_options(serve.add_argument_group("HTTP server"))
    worker = commands.add_parser(
        "worker", help="run this machine's tensor-parallel ranks of an engine served from another machine",
        description="Run the tensor-parallel ranks of this node (--node-rank N > 0) for a `minivllm serve` on node "
                    "0. Give the same model, KV cache, scheduling and parallel options as the server.",
        formatter_class=_HelpFormatter,
    )
    _add_engine_groups(worker)
    worker.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    return parser


def _add_engine_groups(command: argparse.ArgumentParser) -> dict:
    groups = {heading: command.add_argument_group(heading) for heading in OPTION_GROUPS}
    add_engine_options(groups)
    add_model_server_options(groups[MODEL])
    return groups
