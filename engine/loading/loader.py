"""Build a model for a ModelConfig on a device and fill its weights (safetensors or dummy)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from engine.loading import fp8_weights, gguf_weights, int_weights
from engine.loading.gguf import source_gguf
from engine.loading.model_config import ModelConfig
from engine.models import fp8, get_model_class
from engine.models.linear import process_weights_after_loading, use_decode_k_split
from engine.models.norm import RMSNorm
from kvcache.paged_cache import FP8_DTYPE

logger = logging.getLogger("minivllm")

LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DUMMY_STD = 0.02  # like Hugging Face's initializer_range: activations stay O(1), so no NaNs


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
) -> nn.Module:
    """Instantiate ``config``'s architecture directly on ``device`` in ``dtype`` and load its weights.

    ``load_format``: "safetensors" reads every shard in ``config.model_path``; "dummy" fills random
    weights of the real shapes, deterministic in ``seed`` (for benchmarks without a checkpoint);
    "auto" means safetensors. ``quantization="fp8"`` quantizes the linear layers to FP8 after loading;
    a checkpoint stored in FP8 (its ``quantization_config``) is loaded in FP8 as it is, and an AWQ, GPTQ or
    compressed-tensors one in its integer layout (``engine.loading.int_weights``). ``quantization="gguf"``
    (a GGUF file's converted directory) loads the file's Q4_0, Q4_1 and Q8_0 linear weights in their blocks. Each linear layer gets
    its weight method before loading (``_set_linear_methods``) and processes its weights after. Returns the
    model in eval mode.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    model_class = get_model_class(config.architecture)
    device = torch.device(device)
    files = [] if load_format == "dummy" else safetensors_files(config.model_path)
    logger.info(
        "building %s from %s on %s in %s (%s weights)", config.architecture, config.model_path, device, dtype, load_format
    )
    start_s = time.perf_counter()
    # Parameters are created where and how they will live: no CPU copy, no float32 copy.
    with torch.device(device), _default_dtype(dtype), _without_default_init():
        model = model_class(config)
        quantized = _set_linear_methods(model, config, quantization)
        gguf = _use_gguf_methods(model, config) if quantization == "gguf" else None
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        weights = _base_model_names(iter_safetensors(files))
        model.load_weights(weights if gguf is None else gguf.stream(weights))
    before = fp8_weights.weight_bytes(model)
    process_weights_after_loading(model)
    if gguf is not None:
        gguf_weights.log_weight_bytes(model, gguf, gguf_weights.keep_lm_head(model, gguf))
    if _int_checkpoint(config):
        int_weights.log_weight_bytes(model)
    if quantized:
        logger.info("quantized %d linear layers to FP8 (a scale per output channel): weights %.2f -> %.2f GiB",
                    quantized, before / 2**30, fp8_weights.weight_bytes(model) / 2**30)
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s: %.1fM parameters in %.2f s", config.architecture, num_params / 1e6, time.perf_counter() - start_s
    )
    return model


def _base_model_names(weights):
    """A base model's checkpoint (saved without its LM head, as embedding models are: Qwen3-Embedding's
    ``layers.0...``) names its tensors without the causal LM's ``model.`` prefix: given it here."""
    for name, tensor in weights:
        yield ("model." + name if name.startswith(("layers.", "embed_tokens.", "norm.")) else name), tensor


def _set_linear_methods(model: nn.Module, config: ModelConfig, quantization: str | None) -> int:
    """Each linear layer's weight method, before loading: an integer (AWQ, GPTQ, compressed-tensors) or FP8
    checkpoint's layout, ``--quantization fp8``'s, or 16-bit weights cut along K at decode sizes
    (``MINIVLLM_DECODE_KSPLIT``). Returns how many layers are quantized after loading."""
    quantized = 0
    if _int_checkpoint(config):
        int_weights.use_int_methods(model, config.quantization_config, config.moe is not None, quantization)
    elif config.quantization_config is not None:
        layers = fp8_weights.use_fp8_methods(model, fp8.Fp8Scheme.from_hf(config.quantization_config))
        logger.info("FP8 checkpoint (weight blocks %s): %d linear layers load in FP8",
                    config.quantization_config.get("weight_block_size"), layers)
    elif quantization == "fp8":
        quantized = fp8_weights.use_fp8_methods(model, None)
    use_decode_k_split(model)
    return quantized


def _int_checkpoint(config: ModelConfig) -> bool:
    quant = config.quantization_config
    return quant is not None and quant.get("quant_method") in int_weights.INT_QUANT_METHODS


def _use_gguf_methods(model: nn.Module, config: ModelConfig) -> gguf_weights.GgufWeights:
    source = source_gguf(config.model_path)
    if source is None:
        raise ValueError(f"quantization='gguf' needs a GGUF file's converted directory; {config.model_path} is not "
                         "one, or its GGUF file is gone")
    return gguf_weights.use_gguf_methods(model, source, config.num_attention_heads, config.num_key_value_heads)


@contextlib.contextmanager
def _without_default_init() -> Iterator[None]:
    """Build modules without torch's default initialisation of linear and embedding weights (random fills that
    take seconds on a CPU for a 135M model): every weight is loaded from the checkpoint or dummy-filled after,
    and a tensor the checkpoint lacks is an error (``load_checkpoint_weights``)."""
    classes = (nn.Linear, nn.Embedding)
    saved = [cls.__dict__["reset_parameters"] for cls in classes]
    for cls in classes:
        cls.reset_parameters = _no_init
    try:
        yield
    finally:
        for cls, method in zip(classes, saved):
            cls.reset_parameters = method


def _no_init(module: nn.Module) -> None:
    return None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def safetensors_files(model_path: str | Path) -> list[Path]:
    """The checkpoint shards of a model directory.

    When ``model.safetensors.index.json`` exists only the files it names are used, so a
    directory that also ships another format's single file (e.g. ``consolidated.safetensors``)
    is read correctly.
    """
    directory = Path(model_path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {directory}; convert the checkpoint to safetensors "
            "or use load_format='dummy'"
        )
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, LazyTensor) for every tensor of every shard, with a progress bar.

    Tensors keep their stored dtype; the copy into the model's parameters casts them.
    """
    from safetensors import safe_open
    from tqdm.auto import tqdm

    num_tensors = 0
    for path in files:  # headers only: cheap, and gives the progress bar its total
        with safe_open(str(path), framework="pt", device="cpu") as f:
            num_tensors += len(f.keys())
    logger.info("reading %d tensors from %d safetensors file(s)", num_tensors, len(files))
    with tqdm(total=num_tensors, desc="Loading weights", unit="tensor") as progress:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, LazyTensor(f, name)
                    progress.update(1)


class LazyTensor:
    """A checkpoint tensor read when its consumer says how much of it: ``load()`` all of it, or ``narrow``
    to one tensor-parallel rank's slice (only those bytes are read from the file)."""

    def __init__(self, handle, name: str):
        self._handle, self._name = handle, name

    def load(self) -> torch.Tensor:
        return self._handle.get_tensor(self._name)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        part = self._handle.get_slice(self._name)
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        return part[index]


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the real shapes: norms at 1.0, everything else N(0, 0.02) (an integer checkpoint's
    layers: random codes, with scales and zero points that make them about as large).

    One generator on the model's device, seeded once and visited in parameter order,
    so the same seed gives the same weights on the same device.
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    seen: set[int] = set()  # tied parameters are filled once
    for module in model.modules():
        fill = getattr(getattr(module, "method", None), "fill_dummy", None)
        if fill is not None:  # a checkpoint layout's codes, scales and zero points: its method fills them
            fill(module, generator)
            seen.update(id(p) for name, p in module.named_parameters(recurse=False) if name != "bias")
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, RMSNorm):
                param.fill_(1.0)
            elif param.dtype == FP8_DTYPE:  # an FP8 checkpoint's layout: N(0, 1) values times scales of 0.02
                values = torch.empty(param.shape, dtype=torch.float32, device=device)
                param.copy_(values.normal_(0.0, 1.0, generator=generator))
            elif name == "weight_scale_inv":
                param.fill_(_DUMMY_STD)
            else:
                param.normal_(0.0, _DUMMY_STD, generator=generator)
