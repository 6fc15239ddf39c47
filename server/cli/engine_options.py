"""The engine's flags, built from ``EngineConfig``'s fields, and the ``EngineConfig`` they give back.

Each field declared with ``engine.config.option`` becomes one flag, declared nowhere else:

    the field                                       its flag                                 taken from it
    max_num_seqs: int = option(256, ...)            --max-num-seqs MAX_NUM_SEQS              type, default, help
    dtype: str = option("auto", ..., choices=...)   --dtype {auto,float32,bfloat16,float16}  choices
    distributed_timeout_s (flag=...)                --distributed-timeout DISTRIBUTED_TIMEOUT  vLLM's name
    enforce_eager: bool = option(False, ...)        --enforce-eager                          a switch
    enable_prefix_caching: bool = option(True, ...) --[no-]enable-prefix-caching             on or off
    overlap_steps: bool | None = option(None, ...)  --[no-]overlap-steps                     None: decided at start-up

A flag's value lands under the field's own name in the parsed arguments, so ``engine_config_from_args`` passes
them on as they are.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

from engine.config import EngineConfig
from engine.loading.default_model import DEFAULT_MODEL_NAME


def option_fields() -> list[dataclasses.Field]:
    """EngineConfig's fields that are command-line options, in declaration order."""
    return [f for f in dataclasses.fields(EngineConfig) if "group" in f.metadata]


def add_engine_options(groups: dict[str, typing.Any]) -> None:
    """Add every option field to its argument group: ``groups`` holds one per heading of
    ``engine.config.OPTION_GROUPS``."""
    hints = typing.get_type_hints(EngineConfig)
    for f in option_fields():
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        kwargs = dict(dest=f.name, default=f.default, help=f.metadata["help"])
        value_type = _value_type(hints[f.name])
        if value_type is bool:
            kwargs["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
        else:
            kwargs["type"] = value_type
            if f.metadata["choices"] is not None:
                kwargs["choices"] = list(f.metadata["choices"])
            elif flag != "--" + f.name.replace("_", "-"):
                kwargs["metavar"] = flag.removeprefix("--").replace("-", "_").upper()  # as argparse names the flag
        groups[f.metadata["group"]].add_argument(flag, *f.metadata["aliases"], **kwargs)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the engine flags give; the served model's name as ``served_model_name`` resolves it."""
    values = {f.name: getattr(args, f.name) for f in option_fields()}
    return EngineConfig(**{**values, "served_model_name": served_model_name(args)})


def served_model_name(args: argparse.Namespace) -> str:
    """``--served-model-name``, else the model directory's name (or the model as given, when it is no directory)."""
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        return DEFAULT_MODEL_NAME
    path = Path(args.model)
    return path.name if path.exists() else args.model


def _value_type(hint: typing.Any) -> typing.Any:
    """What a flag's text converts with: ``int`` for ``int`` and ``int | None``, a JSON object for a dict."""
    members = [t for t in typing.get_args(hint) if t is not type(None)]
    value = members[0] if members else hint
    return _json_object if typing.get_origin(value) is dict else value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value

