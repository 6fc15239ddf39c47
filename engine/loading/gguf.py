"""GGUF models (llama.cpp's and Ollama's format): ``--model file.gguf``, converted once into a cache.

transformers reads the GGUF (its ``gguf_file`` loader: metadata, tokenizer, chat template, and every
quantized tensor dequantized), and the result is saved as an ordinary Hugging Face directory of float32
safetensors plus the tokenizer, which the engine then loads like any other (cast to the compute dtype,
sharded over tensor-parallel ranks). Weights are therefore not kept quantized: a Q4 file takes the memory
of its model in the compute dtype under ``--quantization none``. By default (and with ``--quantization gguf``) the
file's quantized linear weights (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) are served in their blocks instead
(``engine.loading.gguf_weights``, which finds the file by ``source_gguf``; ``EngineConfig.resolve_quantization``
decides).

The cache entry is keyed by the file's path, size and modification time, written to a temporary
directory and renamed into place with a marker inside, so an interrupted conversion is never mistaken
for a finished one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("minivllm")

MARKER = ".minivllm-complete"


def gguf_file(model: str | Path) -> Path | None:
    """The GGUF file ``model`` names: the file itself, or the one ``.gguf`` in a directory without a
    ``config.json``; None for anything else (an ordinary Hugging Face directory)."""
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            raise ValueError(f"{path} holds {len(files)} GGUF files; name the one to serve: "
                             + ", ".join(f.name for f in files))
    return None


def source_gguf(directory: str | Path) -> Path | None:
    """The GGUF file a converted directory was made from, where it is still there: a ``.gguf`` kept inside the
    directory (the default model's), else the file its marker names; None for any other directory."""
    directory = Path(directory)
    kept = sorted(directory.glob("*.gguf")) if directory.is_dir() else []
    if len(kept) == 1:
        return kept[0]
    try:
        source = Path(json.loads((directory / MARKER).read_text())["source"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if source.suffix == ".gguf" and source.is_file() else None


def is_gguf_conversion(directory: str | Path) -> bool:
    """Whether ``directory`` is a GGUF file's conversion (``ensure_converted``'s, or the default model) whose GGUF
    file is still there: what ``--quantization``'s default serves in its blocks. A Hugging Face directory that
    ships a GGUF beside its safetensors is not one (no marker): its checkpoint is the safetensors."""
    return (Path(directory) / MARKER).is_file() and source_gguf(directory) is not None


def is_gguf_model(model: str | Path) -> bool:
    """Whether ``model`` is a GGUF file, a directory of one, or a GGUF file's converted directory."""
    return gguf_file(model) is not None or source_gguf(model) is not None


def ensure_converted(gguf_path: Path, cache_dir: Path) -> Path:
    """The converted directory of ``gguf_path`` in ``cache_dir/gguf``, converting it first if needed."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir / "gguf" / f"{gguf_path.stem}-{key}"
    if (target / MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s into %s (one-time: weights dequantized to float32)", gguf_path, target)
    with tempfile.TemporaryDirectory(prefix=f".{gguf_path.stem}-", dir=target.parent) as work:
        staging = Path(work) / "converted"
        convert(gguf_path, staging)
        (staging / MARKER).write_text(json.dumps({"source": str(gguf_path)}) + "\n")
        publish(staging, target, lambda: (target / MARKER).exists())
    return target


def convert(gguf_path: Path, out_dir: Path, fix_tokenizer: Callable | None = None) -> None:
    """Dequantize ``gguf_path`` with transformers; save model (safetensors) and tokenizer to ``out_dir``.
    ``fix_tokenizer(tokenizer, model)`` may adjust the tokenizer before it is saved."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _parse_once():
        logger.info("loading the tokenizer and chat template from %s", gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        logger.info("dequantizing %s to float32", gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     **{_dtype_keyword(): torch.float32})
    if fix_tokenizer is not None:
        fix_tokenizer(tokenizer, model)
    logger.info("saving safetensors and tokenizer")
    save_plain_checkpoint(model, out_dir)
    tokenizer.save_pretrained(str(out_dir))


@contextlib.contextmanager
def _parse_once():
    """Within a conversion, parse each GGUF file once and build each tensor-name map once.

    transformers reads the file's metadata anew for the config, for the tokenizer and for the weights
    (``gguf.GGUFReader`` walks every field in Python: seconds for a 49k-token vocabulary), and builds
    gguf's name map of the architecture once per module of the model. Both are pure functions of their
    arguments here, so the conversion shares one result of each: SmolLM2-135M converts 2-3x faster.
    """
    import gguf

    readers, name_maps = {}, {}
    make_reader, make_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = make_reader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = make_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_name_map


def _dtype_keyword() -> str:
    """``from_pretrained``'s dtype argument: ``dtype`` since transformers 4.56, ``torch_dtype`` before."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def save_plain_checkpoint(model, out_dir: Path) -> None:
    """Write config, generation config and float32 safetensors as an ordinary checkpoint.

    ``model.save_pretrained`` refuses GGUF-loaded models in recent transformers, so the
    pieces are written directly.
    """
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embeddings; stored once
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(out_dir))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out_dir))
    _make_plain_config(out_dir / "config.json", type(model).__name__)


def _make_plain_config(config_path: Path, architecture: str) -> None:
    """Make config.json describe an ordinary float32 checkpoint of ``architecture``, not a GGUF-derived one."""
    config = json.loads(config_path.read_text())
    config["architectures"] = [architecture]
    config.pop("quantization_config", None)
    # transformers 5 writes rope_theta inside rope_parameters; 4.x only reads the top-level key.
    rope_parameters = config.get("rope_parameters") or {}
    if "rope_theta" in rope_parameters:
        config.setdefault("rope_theta", rope_parameters["rope_theta"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def publish(staging: Path, target: Path, is_current: Callable[[], bool]) -> None:
    """Move a finished conversion into place; a leftover incomplete or outdated directory is replaced."""
    if target.exists() and not is_current():
        logger.info("removing incomplete or outdated %s", target)
        shutil.rmtree(target)
    try:
        staging.rename(target)
    except OSError:
        # Another process finished the same conversion first: keep theirs.
        if not is_current():
            raise
