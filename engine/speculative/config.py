"""``--speculative-config`` (``LLM(speculative_config=...)``): vLLM's keys, checked once at start-up.

Served here: ``method: "ngram"`` with ``num_speculative_tokens``, ``prompt_lookup_min`` and ``prompt_lookup_max``
(as vLLM: one of the two given sets the other, neither means 5 and 5), and ``disable_by_batch_size``: no proposals
in a step while at least that many requests run. A draft ``model`` and ``method`` ``draft_model``, ``eagle``,
``eagle3``, ``medusa`` and ``mtp`` are refused by name, as is any other key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class SpeculativeConfigError(ValueError):
    """A speculative_config that cannot be served; ``EngineConfig`` reports it as a ConfigError."""


KNOWN_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "mtp")
SERVED_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None = None  # no proposals while at least this many requests run
    method: str = "ngram"

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
        method = given.get("method")
        if method is None and "model" not in given:
            raise SpeculativeConfigError('speculative_config needs a "method" (this server serves "ngram")')
        if "model" in given or method != "ngram":
            what = f'method "{method}"' if method is not None else "a draft model"
            if method is not None and method not in KNOWN_METHODS:
                raise SpeculativeConfigError(f'speculative_config: unknown method "{method}"; known: {", ".join(KNOWN_METHODS)}')
            raise SpeculativeConfigError(f'speculative_config: {what} is not served yet; "ngram" is')
        unknown = sorted(set(given) - set(SERVED_KEYS))
        if unknown:
            raise SpeculativeConfigError(f"speculative_config: {', '.join(unknown)} not served with method ngram")
        k = given.get("num_speculative_tokens")
        lo, hi = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)
        by_batch = given.get("disable_by_batch_size")
        for name, value in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpeculativeConfigError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if lo > hi:
            raise SpeculativeConfigError(f"speculative_config: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})")
        if by_batch is not None and (not isinstance(by_batch, int) or isinstance(by_batch, bool) or by_batch < 1):
            raise SpeculativeConfigError(f"speculative_config: disable_by_batch_size must be a positive integer, got {by_batch!r}")
        return cls(k, lo, hi, by_batch)
