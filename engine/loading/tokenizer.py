"""Loading what a model directory holds through transformers' Auto classes: its tokenizer, config and processor."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.config import ConfigError

logger = logging.getLogger("minivllm")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def from_pretrained(auto_class, path: str | Path, trust_remote_code: bool, what: str, **kwargs):
    """``auto_class.from_pretrained(path)`` (``AutoConfig``, ``AutoTokenizer``, ``AutoProcessor``) with
    ``trust_remote_code`` always given, so that transformers never stops to ask on the terminal. A directory whose
    ``what`` needs its own Python code (an ``auto_map`` entry) is a ConfigError naming the option, unless it is
    trusted: that code then runs in this process, as vLLM's ``--trust-remote-code`` lets it."""
    try:
        return auto_class.from_pretrained(str(path), trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise ConfigError(f"{path} ships its own Python code for its {what}, which runs only with "
                          f"trust_remote_code=True (`--trust-remote-code`); read that code first") from None


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The Hugging Face tokenizer in ``path``, or None when the directory has none.

    Without a tokenizer the engine still serves prompts given as token ids. ``trust_remote_code``: see
    ``from_pretrained``.
    """
    path = Path(path)
    if path.is_dir() and not any((path / name).exists() for name in _TOKENIZER_FILES):
        logger.warning("no tokenizer in %s: only token-id prompts can be served", path)
        return None
    from transformers import AutoTokenizer

    return from_pretrained(AutoTokenizer, path, trust_remote_code, "tokenizer")
