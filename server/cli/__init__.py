"""The ``minivllm`` command line.

    parser.py           the commands and their option groups (``build_parser``)
    engine_options.py   the engine's options, built from EngineConfig's fields, and the EngineConfig they give
    server_options.py   the HTTP server's options, and the limits built from them
    serve.py            ``minivllm serve``: the model on uvicorn      draining_server.py  its graceful shutdown
    worker.py           ``minivllm worker``: the ranks of another machine's engine
"""

from __future__ import annotations

from server.cli.engine_options import engine_config_from_args, served_model_name
from server.cli.parser import build_parser
from server.cli.serve import serve
from server.cli.server_options import check_media_args, limits_from_args, media_limits_from_args
from server.cli.worker import worker

__all__ = ["build_parser", "check_media_args", "engine_config_from_args", "limits_from_args", "main",
           "media_limits_from_args", "serve", "served_model_name", "worker"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "worker":
        return worker(args)
    return 2
