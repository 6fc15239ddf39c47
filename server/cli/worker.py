"""``minivllm worker``: this machine's tensor-parallel ranks of an engine served from another machine."""

from __future__ import annotations

import argparse
import logging
import sys

from engine.config import ConfigError
from server.cli.engine_options import engine_config_from_args


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
