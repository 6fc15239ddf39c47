"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``.

A model that takes images (``LLM.accepts_images``) takes them as vLLM does, per prompt::

    llm.generate({"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": image}})
    llm.chat([{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "..."}]}])

The model's Hugging Face processor resizes each image and expands its ``<image>`` placeholder into the
model's number of image tokens (``engine/loading/multimodal.py``).

An ``LLM`` holds a model, its KV cache and, with ``tensor_parallel_size`` > 1, rank processes and a process
group. ``llm.shutdown()``, the end of a ``with LLM(...) as llm:`` block, ``del llm`` (once nothing else refers
to it) and interpreter exit all release them, so another ``LLM`` can be made in the same process::

    with LLM(model, tensor_parallel_size=2) as llm:
        outputs = llm.generate(prompts)
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.errors import RequestError
from engine.frontend.output_processor import ChoiceDelta, OutputProcessor
from engine.frontend.scores import classifier_score, cosine, pair_token_ids, pairs
from engine.lora.request import LoRARequest
from engine.outputs import FinishReason, Logprobs
from engine.sampling_params import PoolingParams, SamplingParams

PromptType = str | dict


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop_token_ids entry that ended it (None for EOS)
    logprobs: list[Logprobs] | None = None


@dataclass
class RequestMetrics:
    """When a request arrived and got its first and last tokens (``time.monotonic()`` seconds)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    metrics: RequestMetrics | None = None
    # With SamplingParams(prompt_logprobs=N): one entry per prompt token, None for the first (nothing
    # precedes it), as vLLM's; each has the prompt token's logprob, its rank and the top-N.
    prompt_logprobs: list[Logprobs | None] | None = None
    pooled: list[float] | None = None  # a pooling request's output (``LLM.embed`` reads it)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s result for one prompt, as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s result for one pair, as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


class LLM:
    """Load a model and generate for many prompts at once with continuous batching.

    ``LLM()`` with no model serves the embedded default model (SmolLM2-135M-Instruct).
    Keyword arguments are ``EngineConfig`` fields.
    """

    def __init__(self, model: str | None = None, **kwargs):
        engine = LLMEngine(EngineConfig(model=model, **kwargs))
        # The engine's only strong reference: the finalizer empties it, and the engine, with its model, KV
        # cache and CUDA graphs, goes. The finalizer holds the list, not the LLM, so that it runs as soon as the
        # LLM is unreachable (and at interpreter exit, for one still alive then).
        self._held: list[LLMEngine] = [engine]
        self._release = weakref.finalize(self, _release_engine, self._held)
        self.tokenizer = engine.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self._mm_processor = None  # the model's HF processor (MultiModalProcessor), loaded with the first image

    @property
    def engine(self) -> LLMEngine:
        """The ``LLMEngine`` this LLM drives; a RuntimeError once the LLM is shut down."""
        self._check_not_shut_down()
        return self._held[0]

    def _check_not_shut_down(self) -> None:
        if not self._held:
            raise RuntimeError("this LLM has been shut down (shutdown() or the end of its `with` block): it has "
                               "no model any more; create a new LLM")

    def shutdown(self) -> None:
        """Release everything the LLM holds, at once: the tensor-parallel rank processes (stopped and joined),
        the process group, the grammar threads, the model, KV cache and CUDA graphs (with the CUDA allocator's
        cache). Calling it again does nothing; generating afterwards raises a RuntimeError. ``del llm`` does the
        same once nothing else refers to the LLM, and so does interpreter exit."""
        self._release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (None for a model given without one), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    @property
    def accepts_images(self) -> bool:
        return self.engine.model_info.accepts_images

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order.

        Prompts are strings, ``{"prompt_token_ids": [...]}`` or ``{"prompt": text}``; with a model that takes
        images, either dict may have ``"multi_modal_data": {"image": image or [images]}`` (PIL images or data
        URLs), one ``<image>`` placeholder per image in the prompt, in order. ``lora_request``: the LoRA adapter
        (an engine made with ``enable_lora=True``) of every prompt, or one per prompt (None: the base model).
        """
        self._check_not_shut_down()  # before any work
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        sampling_params = _with_adapters(sampling_params or self.get_default_sampling_params(), lora_request,
                                         len(prompts))
        return self._generate([self._tokenize(prompt) for prompt in prompts], sampling_params, use_tqdm)

    def _generate(self, prompts: list[tuple[str | None, list[int], list | None]],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool
                  ) -> list[RequestOutput]:
        """Generate for tokenized prompts: (text, token ids, images)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")

        # Every prompt is checked before any request starts, so a bad one leaves nothing behind.
        checked = []
        for (text, token_ids, mm_inputs), params in zip(prompts, params_list):
            checked.append((text, token_ids, self.engine.validate_request(token_ids, params, mm_inputs), mm_inputs))
        bar = tqdm(total=sum(params.n for params in params_list), desc="generating", unit="req",
                   disable=not use_tqdm)
        results: list[RequestOutput] = []
        states = []
        for text, token_ids, params, mm_inputs in checked:
            result = RequestOutput(str(next(self._ids)), text, token_ids, outputs=[
                CompletionOutput(index=j, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None)
                for j in range(params.n)])
            results.append(result)
            state, children = self.processor.add_request(result.request_id, [token_ids], params,
                                                         _ResultBuilder(result, bar))
            result.metrics = RequestMetrics(arrival_time=state.arrival_s)
            states.append(state)
            for child in children:
                self.engine.add_request(child.request_id, child.prompt_token_ids, child.params, checked=True,
                                        mm_inputs=mm_inputs)
        try:
            while self.engine.has_unfinished_requests():
                to_abort = self.processor.process(self.engine.step())
                if to_abort:  # ended by a stop string
                    self.engine.abort_requests(to_abort)
                # A grammar that failed to compile in time ended its request ("abort", logged); the list is the
                # server's, for its 400s: nothing reads it here.
                self.engine.grammar_failures.clear()
        finally:
            bar.close()
        if self.engine.config.check_invariants_when_idle:
            self.engine.check_invariants()
        for result, state in zip(results, states):
            result.num_cached_tokens = state.usage().cached_tokens
            result.finished = True
        return results

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (an engine made with ``runner="pooling"``): the final hidden state of
        each prompt's last token, L2-normalised unless ``PoolingParams(normalize=False)``."""
        self._check_not_shut_down()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        pooling = pooling_params if pooling_params is not None else PoolingParams()
        params = ([SamplingParams(pooling=p) for p in pooling] if not isinstance(pooling, PoolingParams)
                  else SamplingParams(pooling=pooling))
        results = self._generate([self._tokenize(prompt) for prompt in prompts], params, use_tqdm)
        return [EmbeddingRequestOutput(r.request_id, r.prompt_token_ids, EmbeddingOutput(r.pooled)) for r in results]

    def score(self, text_1: str | list[str], text_2: str | list[str],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """One score per pair (``text_1`` against each ``text_2``, or paired in order), as vLLM's: a classifier
        (cross-encoder) reads each pair as one prompt, an embedding model compares the texts' embeddings
        (``engine.frontend.scores``)."""
        self._check_not_shut_down()
        text_pairs = pairs(text_1, text_2)
        if self.engine.model_info.num_labels:
            prompts = [{"prompt_token_ids": pair_token_ids(self.tokenizer, a, b)} for a, b in text_pairs]
            outs = self.embed(prompts, use_tqdm=use_tqdm)
            return [ScoringRequestOutput(o.request_id, o.prompt_token_ids,
                                         ScoringOutput(classifier_score(o.outputs.embedding))) for o in outs]
        texts = [text for pair in text_pairs for text in pair]
        outs = self.embed(texts, use_tqdm=use_tqdm)
        return [ScoringRequestOutput(a.request_id, a.prompt_token_ids + b.prompt_token_ids,
                                     ScoringOutput(cosine(a.outputs.embedding, b.outputs.embedding)))
                for a, b in zip(outs[::2], outs[1::2])]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (see ``generation_config``)."""
        return SamplingParams(**self.engine.model_info.sampling_defaults)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], list | None]:
        """(text, token ids, images as ImageInputs or None) of one prompt."""
        if isinstance(prompt, dict):
            images = (prompt.get("multi_modal_data") or {}).get("image")
            if images is not None:
                images = list(images) if isinstance(images, (list, tuple)) else [images]
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
                if not images:
                    return prompt.get("prompt"), ids, None
                ids, mm_inputs = self._images().process_token_ids(ids, images)
                return prompt.get("prompt"), ids, mm_inputs
            if "prompt" not in prompt:
                raise RequestError("a dict prompt needs 'prompt_token_ids' or 'prompt'", param="prompt")
            if images:
                ids, mm_inputs = self._images().process_text(prompt["prompt"], images)
                return prompt["prompt"], ids, mm_inputs
            prompt = prompt["prompt"]
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: give prompts as {'prompt_token_ids': [...]}",
                               param="prompt")
        return prompt, self.tokenizer.encode(prompt), None

    def _images(self):
        """The model's processor for prompts with images (RequestError for a model that takes none)."""
        if not self.accepts_images:
            raise RequestError(f"{self.engine.model_info.architecture} does not take images",
                               param="multi_modal_data")
        if self._mm_processor is None:
            from engine.loading.multimodal import MultiModalProcessor

            info = self.engine.model_info
            self._mm_processor = MultiModalProcessor.from_pretrained(info.model_path, info.image_token_id,
                                                                     self.engine.config.trust_remote_code)
        return self._mm_processor

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Render each conversation with the tokenizer's chat template and generate the replies, as vLLM's
        ``LLM.chat``: ``messages`` is one conversation (a list of message dicts) or a list of conversations, and the
        result is one ``RequestOutput`` per conversation, in order (a list either way); ``sampling_params`` as in
        ``generate``, one for all or one per conversation.

        With images (content parts ``{"type": "image", "image": PIL image}`` or ``{"type": "image_url",
        "image_url": {"url": "data:..."}}``), the model's processor renders a conversation with its own chat template.
        ``lora_request`` as in ``generate``.
        """
        self._check_not_shut_down()  # before any work
        if not messages:
            raise RequestError("messages is empty: give a conversation or a list of conversations", param="messages")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for i, conversation in enumerate(conversations):
            if not conversation or not all(isinstance(m, dict) for m in conversation):
                raise RequestError(f"conversation {i} must be a non-empty list of message dicts", param="messages")
            if any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in (
                    "image", "image_url", "image_pil") for p in m["content"]) for m in conversation):
                ids, mm_inputs = self._images().process_chat(conversation)
                prompts.append((None, ids, mm_inputs))
                continue
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer, so it has no chat template", param="messages")
            ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                ids = list(ids["input_ids"])
            prompts.append((None, ids, None))
        sampling_params = _with_adapters(sampling_params or self.get_default_sampling_params(), lora_request,
                                         len(prompts))
        return self._generate(prompts, sampling_params, use_tqdm)


def _release_engine(held: list[LLMEngine]) -> None:
    """An LLM's finalizer: close its engine (ranks, process group, threads), then drop it and give its device
    memory back."""
    if not held:
        return
    engine = held.pop()
    try:
        engine.close()
    finally:
        del engine
        gc.collect()  # the engine's objects may hold each other (close() unfroze them)
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


class _ResultBuilder:
    """The offline sink: appends each choice's deltas to its ``CompletionOutput``."""

    def __init__(self, result: RequestOutput, bar: tqdm):
        self.result = result
        self.bar = bar
        self._texts: list[list[str]] = [[] for _ in result.outputs]  # joined once a choice finishes

    def put(self, delta: ChoiceDelta) -> None:
        completion = self.result.outputs[delta.index]
        if delta.token_ids:
            metrics, now = self.result.metrics, time.monotonic()
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
        if delta.text:
            self._texts[delta.index].append(delta.text)
        completion.token_ids.extend(delta.token_ids)
        if delta.pooled is not None:
            self.result.pooled = delta.pooled
        if delta.prompt_logprobs is not None and self.result.prompt_logprobs is None:
            self.result.prompt_logprobs = [None, *delta.prompt_logprobs]
        if completion.logprobs is not None:
            completion.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            completion.text = "".join(self._texts[delta.index])
            completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason
            self.bar.update(1)


def _with_adapters(params: SamplingParams | Sequence[SamplingParams],
                   lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                   num_prompts: int) -> SamplingParams | list[SamplingParams]:
    """Sampling parameters carrying each prompt's LoRA adapter (``SamplingParams.lora_request``)."""
    if lora_request is None:
        return params
    adapters = [lora_request] * num_prompts if isinstance(lora_request, LoRARequest) else list(lora_request)
    if len(adapters) != num_prompts:
        raise ValueError(f"got {num_prompts} prompts but {len(adapters)} LoRA requests")
    params_list = [params] * num_prompts if isinstance(params, SamplingParams) else list(params)
    return [p if a is None else dataclasses.replace(p, lora_request=a) for p, a in zip(params_list, adapters)]
