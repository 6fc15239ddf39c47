"""Loading a model's tokenizer, when its directory has one."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger("minivllm")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer in ``path``, or None when the directory has none.

    Without a tokenizer the engine still serves prompts given as token ids.
    """
    path = Path(path)
    if path.is_dir() and not any((path / name).exists() for name in _TOKENIZER_FILES):
        logger.warning("no tokenizer in %s: only token-id prompts can be served", path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
