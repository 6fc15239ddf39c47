"""Default sampling parameters from a model's ``generation_config.json``, as vLLM applies them.

``--generation-config auto`` (the default) reads the model directory's file, ``vllm`` ignores it
(the engine's own defaults: temperature 1.0, no filters), and a folder reads that folder's. Only
the sampling fields are taken; a request's own values always win.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.config import ConfigError
from engine.sampling_params import SamplingParams, SamplingParamsError

# generation_config.json name -> SamplingParams name
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_sampling_defaults(source: str, model_path: str) -> dict[str, Any]:
    if source == "vllm":
        return {}
    path = Path(model_path if source == "auto" else source) / "generation_config.json"
    if not path.is_file():
        if source == "auto":
            return {}
        raise ConfigError(f"--generation-config {source}: no generation_config.json there")
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    defaults = {ours: raw[theirs] for theirs, ours in _FIELDS.items() if raw.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except (SamplingParamsError, TypeError) as exc:
        raise ConfigError(f"{path} has sampling defaults that cannot be used: {exc}") from exc
    return defaults
