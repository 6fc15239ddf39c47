"""A LoRA adapter in PEFT's format, read and checked: ``adapter_config.json`` and ``adapter_model.safetensors``.

PEFT stores, for each adapted module ``m`` (a linear layer of the base model), ``base_model.model.<m>.lora_A.weight``
[r, in_features] and ``base_model.model.<m>.lora_B.weight`` [out_features, r]; the module computes
``x W^T + (x A^T) B^T * scaling`` with ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA,
``use_rslora``). ``rank_pattern`` and ``alpha_pattern`` give some modules their own rank and alpha: the rank is read
from the tensors' shapes, the alpha from the pattern that names the module.

Served here: the attention and MLP projections of the decoder layers (``TARGETS``). Refused, with the reason:
another PEFT method, DoRA, trained biases, ``modules_to_save`` (whole copies of layers such as the LM head),
embedding-layer and LM-head LoRA, a rank above the engine's ``max_lora_rank``. ``read_adapter_config`` reads and
checks only the JSON and the tensors' shapes (the API server does, before it accepts an adapter);
``load_adapter`` reads the tensors too.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."
_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message says why (a 400 at the API)."""


@dataclass
class AdapterConfig:
    """What the engine needs of ``adapter_config.json``, and each adapted module's rank and scaling."""

    path: Path
    modules: dict[str, tuple[int, float]] = field(default_factory=dict)  # module name -> (rank, scaling)
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)  # module name -> (in, out) features


def _weights_file(path: Path) -> Path:
    file = path / "adapter_model.safetensors"
    if file.is_file():
        return file
    if (path / "adapter_model.bin").is_file():
        raise LoRAAdapterError(f"LoRA adapter {path}: adapter_model.bin (a pickle) is not read; save the adapter "
                               f"with safetensors (PEFT's default)")
    raise LoRAAdapterError(f"LoRA adapter {path}: no adapter_model.safetensors")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's per-module rank or alpha: a pattern names a module by the end of its name (or matches it as a
    regular expression)."""
    for pattern, value in (patterns or {}).items():
        if module == pattern or module.endswith("." + pattern) or re.fullmatch(rf"(.*\.)?{pattern}", module):
            return value
    return default


def read_adapter_config(path: str | Path, max_rank: int | None = None) -> AdapterConfig:
    """Read and check an adapter's configuration and its tensors' names and shapes (not their values)."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {path}: no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise LoRAAdapterError(f"LoRA adapter {path}: adapter_config.json is not JSON ({e})") from None
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (only LORA is served)")
    if config.get("use_dora"):
        problems.append("use_dora (DoRA's magnitude vectors are not served)")
    if config.get("bias", "none") != "none":
        problems.append(f"bias {config.get('bias')!r} (trained biases are not served; 'none' is)")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']} (whole trained copies of layers are not served)")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out (Conv1D layers are not served)")
    if problems:
        raise LoRAAdapterError(f"LoRA adapter {path}: " + "; ".join(problems))

    file = _weights_file(path)
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    with safe_open(file, framework="numpy") as f:
        for name in f.keys():
            match = _NAME.match(name)
            if match is None:
                raise LoRAAdapterError(f"LoRA adapter {path}: tensor {name!r} is not a LoRA A or B weight (embedding "
                                       f"and LM-head adapters, and other trained tensors, are not served)")
            module = match["module"].removeprefix(_PREFIX)
            shapes.setdefault(module, {})[match["ab"]] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise LoRAAdapterError(f"LoRA adapter {path}: {file.name} holds no LoRA weights")
    result = AdapterConfig(path)
    use_rslora = bool(config.get("use_rslora"))
    for module, ab in sorted(shapes.items()):
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in TARGETS:
            raise LoRAAdapterError(f"LoRA adapter {path}: module {module!r} is not served (adapted modules must be "
                                   f"among {', '.join(TARGETS)})")
        if set(ab) != {"A", "B"} or len(ab["A"]) != 2 or len(ab["B"]) != 2 or ab["A"][0] != ab["B"][1]:
            raise LoRAAdapterError(f"LoRA adapter {path}: module {module!r} needs lora_A [r, in] and lora_B "
                                   f"[out, r], has {ab}")
        rank = ab["A"][0]
        if max_rank is not None and rank > max_rank:
            raise LoRAAdapterError(f"LoRA adapter {path}: rank {rank} of {module!r} is above max_lora_rank "
                                   f"({max_rank}); start the engine with a larger --max-lora-rank")
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
        scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        result.modules[module] = (rank, scaling)
        result.shapes[module] = (ab["A"][1], ab["B"][0])
    return result


def load_adapter(path: str | Path, max_rank: int | None, dtype) -> dict[str, tuple]:
    """Read a checked adapter's tensors in ``dtype``: module name -> (A [r, in], B [out, r] times the module's
    scaling). B is multiplied once (in float32, then rounded), so that the product needs no scaling of its own."""
    import torch
    from safetensors.torch import load_file

    config = read_adapter_config(path, max_rank)
    tensors = load_file(_weights_file(config.path))
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        by_module.setdefault(match["module"].removeprefix(_PREFIX), {})[match["ab"]] = tensor
    modules = {}
    for module, (_, scaling) in config.modules.items():
        a, b = by_module[module]["A"], by_module[module]["B"]
        modules[module] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return modules
