"""What a front end needs to know about the served model, in one frozen object.

The engine core process sends it to the API server once it has loaded the model; the
server reads model facts only from here (and from the tokenizer it loads itself).
Requests are checked against it once, in the front end, before they reach the engine.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.errors import RequestError
from engine.loading.multimodal import check_image_inputs
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelInfo:
    model_path: str
    tokenizer_path: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # The KV pool, for start-up logs and the dashboard.
    num_kv_blocks: int
    kv_block_size: int
    device: str
    # Sampling defaults from the model's generation_config.json (SamplingParams names); requests override them.
    sampling_defaults: dict = field(default_factory=dict)
    max_logprobs: int = 20  # the most logprobs a token may ask for; -1: the whole vocabulary
    max_num_seqs: int = 256
    # What prompts may carry: ("text",) or ("text", "image"). A model that takes images has the token id of
    # its image placeholders, and encodes images of at most max_tokens_per_image tokens.
    input_modalities: tuple[str, ...] = ("text",)
    image_token_id: int | None = None
    max_tokens_per_image: int | None = None
    # The largest structured-output spec a request may give (engine.structured_output.check_structured_outputs).
    structured_outputs_max_bytes: int | None = None
    # "generate", or "pooling" (--runner pooling: requests are pooling requests, SamplingParams.pooling).
    runner: str = "generate"
    hidden_size: int = 0  # a pooling request's output size
    num_labels: int = 0  # a sequence classifier's (a pooling request's output: its logits); 0 for other models
    # A Matryoshka model's output sizes (a request's ``dimensions`` must be one; () any up to hidden_size); None:
    # not a Matryoshka model, whose outputs are not cut.
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def accepts_images(self) -> bool:
        return "image" in self.input_modalities

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      mm_inputs: list | None = None) -> SamplingParams:
        """Check a prompt (and its images, ``engine.loading.multimodal.ImageInput``s) against the vocabulary and the
        context; return params with max_tokens resolved. A structured-output spec is checked once per request,
        not here (``engine.core.structured_output.check_structured_outputs``: it builds the grammar)."""
        if (params.pooling is not None) != (self.runner == "pooling"):
            raise RequestError("this model is served for embeddings (--runner pooling): it does not generate"
                               if params.pooling is None else "this model is served for generation: --runner "
                               "pooling serves embeddings", param="model")
        if params.pooling is not None and params.pooling.dimensions is not None:
            if self.num_labels:
                raise RequestError("dimensions: this model is a classifier: its outputs are its labels' logits",
                                   param="dimensions")
            self.check_dimensions(params.pooling.dimensions)
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty: it must contain at least one token", param="prompt")
        vocab = self.vocab_size
        try:
            ids = np.asarray(prompt_token_ids, dtype=np.int64)
        except OverflowError:
            ids = None
        bad = None if ids is None else (ids < 0) | (ids >= vocab)
        if bad is None or bad.any():
            first = next(t for t in prompt_token_ids if not 0 <= t < vocab) if bad is None else int(ids[bad.argmax()])
            raise RequestError(f"token id {first} is out of vocabulary (out of range: the vocabulary has {vocab} "
                               f"tokens, 0..{vocab - 1})", param="prompt")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError(f"logit_bias: token id {max(params.logit_bias)} is out of range: the vocabulary has "
                               f"{vocab} tokens", param="logit_bias")
        if params.logprob_token_ids and max(params.logprob_token_ids) >= vocab:
            raise RequestError(f"logprob_token_ids: token id {max(params.logprob_token_ids)} is out of vocabulary "
                               f"(the vocabulary has {vocab} tokens)", param="logprob_token_ids")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise RequestError(f"allowed_token_ids: token id {max(params.allowed_token_ids)} is out of range: the "
                               f"vocabulary has {vocab} tokens", param="allowed_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            self.check_num_logprobs(getattr(params, name), name)
        if mm_inputs:
            check_image_inputs(prompt_token_ids, mm_inputs, self.image_token_id, self.max_tokens_per_image)
        room = self.max_model_len - n
        if room < 1:
            images = ""
            if mm_inputs:
                images = (f" ({sum(mm.length for mm in mm_inputs)} of them for {len(mm_inputs)} "
                          f"image{'s' if len(mm_inputs) > 1 else ''})")
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has {n} tokens"
                f"{images} and at least one token must be generated", param="prompt", code="context_length_exceeded")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {n} prompt tokens plus "
                f"max_tokens={params.max_tokens} ask for {n + params.max_tokens}", param="max_tokens",
                code="context_length_exceeded")
        if params.use_beam_search:
            self._check_beam_search(n, params)
        return params

    def _check_beam_search(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """All beams of a search must fit at once: in the batch, and in the KV pool (the prompt's full blocks
        shared, each beam's own blocks from there to max_tokens)."""
        if params.n > self.max_num_seqs:
            raise RequestError(f"beam search of width n={params.n} needs as many sequences in the batch, more than "
                               f"max_num_seqs={self.max_num_seqs}", param="n")
        bs = self.kv_block_size
        shared, rest = divmod(num_prompt_tokens, bs)
        needed = shared + params.n * -(-(rest + params.max_tokens) // bs)
        if needed > self.num_kv_blocks - 1:
            raise RequestError(f"beam search of width n={params.n} over {num_prompt_tokens} prompt tokens and "
                               f"max_tokens={params.max_tokens} needs up to {needed} KV blocks at once; the pool "
                               f"has {self.num_kv_blocks - 1}", param="n")

    def check_dimensions(self, dimensions: int) -> None:
        """A pooling request's ``dimensions``: a Matryoshka model's, else a RequestError."""
        sizes = self.matryoshka_dimensions
        if sizes is None:
            raise RequestError("dimensions: this model is not a Matryoshka model (its config.json has no "
                               "is_matryoshka or matryoshka_dimensions): its embeddings cannot be cut",
                               param="dimensions")
        if not 1 <= dimensions <= self.hidden_size or (sizes and dimensions not in sizes):
            allowed = ", ".join(map(str, sizes)) if sizes else f"1 to {self.hidden_size}"
            raise RequestError(f"dimensions must be one of {allowed}, got {dimensions}", param="dimensions")

    def check_num_logprobs(self, value: int | None, param: str) -> None:
        """-1 asks for the whole vocabulary; no more than ``max_logprobs`` (as vLLM's ``--max-logprobs``)."""
        if value is None:
            return
        wanted = self.vocab_size if value == -1 else value
        limit = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        if wanted > limit:
            kind = "prompt" if param == "prompt_logprobs" else "sample"
            raise RequestError(f"requested {kind} logprobs of {wanted}{' (-1: the whole vocabulary)' if value == -1 else ''}"
                               f", more than the server allows: {limit} (--max-logprobs)", param=param)


def matryoshka_dimensions(model_path: str) -> tuple[int, ...] | None:
    """What a model's config.json says of Matryoshka training: ``matryoshka_dimensions`` (the sizes it was trained
    for), ``is_matryoshka`` (any size: ()), or neither (None)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("matryoshka_dimensions"):
        return tuple(int(d) for d in config["matryoshka_dimensions"])
    return () if config.get("is_matryoshka") else None
