"""How one request is sampled and when it stops: the user-facing knobs, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.lora.request import LoRARequest

_GREEDY_EPS = 1e-5
MAX_LOGPROB_TOKEN_IDS = 128  # as vLLM: the most tokens logprob_token_ids may name


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar: exactly one of these, by vLLM's names.

    ``json`` is a JSON schema (as JSON text), ``json_object`` any JSON object, ``regex`` a
    regular expression, ``choice`` one of a list of strings, ``grammar`` an EBNF grammar
    (xgrammar's dialect, a ``root`` rule), ``structural_tag`` an xgrammar structural tag (as JSON
    text: free text with constrained regions, such as a model's tool-call format). ``strict``: a
    schema's objects take no properties beyond those it lists (OpenAI's ``strict``).

    ``reasoning``: where the constraint starts when the model thinks first (``<think>…</think>``):
    "open" - the output begins inside the thinking (the prompt opened it), "optional" - the output
    may begin with a whole thinking block; the constraint applies after it. None: from the first
    token. (A structural tag says this itself.)

    ``any_whitespace``: False lays JSON out one way only, ``", "`` and ``": "`` between items and no
    other whitespace (tool calls: no tokens spent on layout). ``param``: the request field the
    constraint came from, named by the errors about it.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    strict: bool = True
    reasoning: str | None = None
    any_whitespace: bool = True
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None, self.structural_tag is not None]
        if sum(given) != 1:
            raise SamplingParamsError("structured outputs take exactly one of json, json_object, regex, choice, "
                                      "grammar or structural_tag", "structured_outputs")
        if self.reasoning not in (None, "open", "optional"):
            raise SamplingParamsError("structured outputs: reasoning is 'open', 'optional' or None",
                                      "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("structured outputs: choice must be a list of non-empty strings",
                                      "structured_outputs")


@dataclass
class PoolingParams:
    """A pooling request's output (``LLM.embed``, ``/v1/embeddings``): the final hidden state of the prompt's last
    token (the pooling of decoder embedding models such as Qwen3-Embedding), cut to its first ``dimensions`` where the
    model was trained for it (Matryoshka) and L2-normalised when ``normalize``."""

    dimensions: int | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise SamplingParamsError(f"dimensions must be at least 1, got {self.dimensions}", "dimensions")


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request, with vLLM's names and defaults.

    ``temperature == 0`` means greedy. ``top_k`` of 0 or -1 disables top-k; ``top_p`` of
    1.0 and ``min_p`` of 0.0 disable those filters. ``seed`` makes the sampled tokens of
    this request reproducible whatever else runs in the same batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Top-N logprobs per generated token (the sampled token's own comes too); -1: the whole vocabulary.
    logprobs: int | None = None
    # vLLM's: the logprobs of these tokens at each generated position, in place of the top-N (needs logprobs).
    logprob_token_ids: list[int] | None = None
    # Top-N logprobs per prompt token, computed in the prefill (the prompt token's own comes too); -1: all.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit (OpenAI: -100..100)
    allowed_token_ids: list[int] | None = None  # vLLM: sample only among these
    # Beam search of width n (engine/core/beam_search.py), scored as transformers' generate(num_beams=n):
    # the n best beams come back, ranked by cumulative logprob / generated_len ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # A pooling request: its prompt runs, and its output is the pooled hidden state, not tokens (nothing sampled).
    pooling: PoolingParams | None = None
    # The LoRA adapter the request runs under (``LLM.generate``'s ``lora_request``, a request's ``model``); None:
    # the base model. It travels with the request's other parameters to the scheduler and the model runner.
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        if self.use_beam_search:
            self.temperature = 0.0  # beams are ranked by the model's own logprobs; nothing is sampled
        if self.pooling is not None:  # one step past the prompt, whose token is dropped: greedy, no filters
            self.max_tokens, self.min_tokens, self.temperature = 1, 0, 0.0
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters are meaningless, so normalise them away.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0
        if self.top_k == -1:
            self.top_k = 0

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, "temperature", f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (-1 <= self.top_k < 2**31, "top_k", f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}"),
            (self.seed is None or -(2**63) <= self.seed < 2**63, "seed",
             f"seed must fit in a signed 64-bit integer, got {self.seed}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0, "repetition_penalty",
             f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (self.logprobs is None or self.logprobs >= -1, "logprobs",
             f"logprobs must be non-negative or -1 (the whole vocabulary), got {self.logprobs}"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= -1, "prompt_logprobs",
             f"prompt_logprobs must be non-negative or -1 (the whole vocabulary), got {self.prompt_logprobs}"),
            (all(s for s in self.stop), "stop", "stop strings must not be empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "stop_token_ids must be non-negative"),
            (self.logit_bias is None or all(-100 <= v <= 100 for v in self.logit_bias.values()), "logit_bias",
             "logit_bias values must be between -100 and 100"),
            (self.logit_bias is None or all(t >= 0 for t in self.logit_bias), "logit_bias",
             "logit_bias keys must be non-negative token ids"),
            (self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0
                                                and all(t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids", "allowed_token_ids must be a non-empty list of non-negative token ids"),
            (self.logprob_token_ids is None or (0 < len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS
                                                and all(t >= 0 for t in self.logprob_token_ids)),
             "logprob_token_ids", f"logprob_token_ids must be a list of 1 to {MAX_LOGPROB_TOKEN_IDS} non-negative "
                                  "token ids"),
            (self.logprob_token_ids is None or self.logprobs is not None, "logprob_token_ids",
             "logprob_token_ids needs logprobs (the sampled token's logprob comes with theirs)"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise SamplingParamsError(message, param)
        if self.use_beam_search:
            self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        """What beam search cannot combine with: sampling filters, penalties, constraints, stop strings."""
        if not math.isfinite(self.length_penalty):
            raise SamplingParamsError("length_penalty must be a finite number", "length_penalty")
        unsupported = {
            "top_p": self.top_p != 1.0, "top_k": self.top_k not in (0, -1), "min_p": self.min_p != 0.0,
            "presence_penalty": self.presence_penalty != 0.0, "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0, "min_tokens": self.min_tokens != 0,
            "stop": bool(self.stop), "logprobs": self.logprobs is not None,
            "logprob_token_ids": self.logprob_token_ids is not None,
            "prompt_logprobs": self.prompt_logprobs is not None, "structured_outputs": self.structured_outputs is not None,
            "logit_bias": bool(self.logit_bias), "allowed_token_ids": self.allowed_token_ids is not None,
        }
        for param, given in unsupported.items():
            if given:
                raise SamplingParamsError(f"{param} cannot be combined with use_beam_search", param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; ``param`` names it (the server reports it as the error's param)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
