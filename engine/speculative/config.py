"""``--speculative-config`` (``LLM(speculative_config=...)``): vLLM's keys, checked once at start-up.

Served:

* ``method: "ngram"`` with ``num_speculative_tokens``, ``prompt_lookup_min`` and ``prompt_lookup_max`` (as vLLM:
  one of the two given sets the other, neither means 5 and 5);
* a draft model: ``model`` (a Hugging Face model directory with the target's vocabulary) with ``method``
  ``"draft_model"`` or none, ``num_speculative_tokens``, and ``draft_tensor_parallel_size`` 1 (the draft runs
  unsharded, on rank 0 beside a sharded target);
* an EAGLE-3 head: ``method: "eagle3"``, ``model`` (the head's directory, in EAGLE's or speculators' layout:
  ``engine.loading.eagle3``), ``num_speculative_tokens`` and ``draft_tensor_parallel_size`` 1; the head reads the
  hidden states of a Llama-family target of one GPU, which then runs eagerly (``engine.worker.eagle3``);
* for all, ``disable_by_batch_size``: no proposals in a step while at least that many requests run.

``eagle``, ``medusa`` and ``mtp`` are refused by name, as is any other key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class SpeculativeConfigError(ValueError):
    """A speculative_config that cannot be served; ``EngineConfig`` reports it as a ConfigError."""


KNOWN_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "mtp")
SERVED_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"),
    "draft_model": ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
                    "disable_by_batch_size"),
    "eagle3": ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "disable_by_batch_size"),
}


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpeculativeConfigError(f"speculative_config: {name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # n-gram only
    prompt_lookup_max: int = 0
    disable_by_batch_size: int | None = None  # no proposals while at least this many requests run
    method: str = "ngram"
    model: str | None = None  # the draft model's or the EAGLE-3 head's directory (method "draft_model", "eagle3")

    @classmethod
    def parse(cls, given: dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """The config from the flag's JSON text or the LLM's dict; None for none."""
        if given is None or given == "" or given == {}:
            return None
        if isinstance(given, str):
            try:
                given = json.loads(given)
            except ValueError as exc:
                raise SpeculativeConfigError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise SpeculativeConfigError(f"speculative_config must be a JSON object, got {type(given).__name__}")
        method = given.get("method", "draft_model" if "model" in given else None)
        if method is None:
            raise SpeculativeConfigError('speculative_config needs a "method" ("ngram") or a draft "model"')
        if method not in KNOWN_METHODS:
            known = ", ".join(KNOWN_METHODS)
            raise SpeculativeConfigError(f'speculative_config: unknown method "{method}"; known: {known}')
        if method not in SERVED_KEYS:
            raise SpeculativeConfigError(f'speculative_config: method "{method}" is not served yet; "ngram", '
                                         'draft models ("draft_model") and "eagle3" are')
        unknown = sorted(set(given) - set(SERVED_KEYS[method]))
        if unknown:
            raise SpeculativeConfigError(f"speculative_config: {', '.join(unknown)} not served with method {method}")
        k = _positive("num_speculative_tokens", given.get("num_speculative_tokens"))
        by_batch = given.get("disable_by_batch_size")
        if by_batch is not None:
            _positive("disable_by_batch_size", by_batch)
        if method in ("draft_model", "eagle3"):
            return cls(k, disable_by_batch_size=by_batch, method=method, model=_draft_directory(given, method))
        lo, hi = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)
        _positive("prompt_lookup_min", lo), _positive("prompt_lookup_max", hi)
        if lo > hi:
            raise SpeculativeConfigError(f"speculative_config: prompt_lookup_min ({lo}) is above prompt_lookup_max "
                                         f"({hi})")
        return cls(k, lo, hi, by_batch)


def _draft_directory(given: dict[str, Any], method: str) -> str:
    model = given.get("model")
    if not isinstance(model, str) or not model:
        raise SpeculativeConfigError(f'speculative_config: method "{method}" needs a "model" directory')
    if not (Path(model) / "config.json").is_file():
        what = "EAGLE-3 head" if method == "eagle3" else "draft model"
        raise SpeculativeConfigError(f"speculative_config: the {what} {model} is not a Hugging Face model "
                                     "directory (no config.json)")
    tp = given.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise SpeculativeConfigError(f"speculative_config: draft_tensor_parallel_size must be 1 (the draft runs "
                                     f"unsharded), got {tp!r}")
    return model
