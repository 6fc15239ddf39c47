"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import LLMEngine, RequestError
from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams

PromptType = str | dict


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[Logprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False


class LLM:
    """Load a model and generate for many prompts at once with continuous batching.

    ``LLM()`` with no model serves the embedded default model (SmolLM2-135M-Instruct).
    Keyword arguments are ``EngineConfig`` fields.
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. Prompts are strings or ``{"prompt_token_ids": [...]}``."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")

        results: list[RequestOutput] = []
        pending: dict[str, tuple[CompletionOutput, IncrementalDetokenizer | None, RequestOutput]] = {}
        for prompt, params in zip(prompts, params_list):
            text, token_ids = self._tokenize(prompt)
            result = RequestOutput(str(next(self._ids)), text, token_ids)
            results.append(result)
            for j in range(params.n):
                child = replace(params, n=1, seed=None if params.seed is None else params.seed + j)
                rid = f"{result.request_id}-{j}"
                self.engine.add_request(rid, token_ids, child)
                completion = CompletionOutput(index=j, text="", token_ids=[],
                                              logprobs=[] if params.logprobs is not None else None)
                result.outputs.append(completion)
                pending[rid] = (completion, self._detokenizer(token_ids, child), result)

        bar = tqdm(total=len(pending), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                self._collect(self.engine.step(), pending, bar)
        finally:
            bar.close()
        for result in results:
            result.finished = True
        return results

    def _collect(self, outputs, pending, bar) -> None:
        to_abort = []
        for out in outputs:
            completion, detok, result = pending[out.request_id]
            completion.token_ids.extend(out.new_token_ids)
            if completion.logprobs is not None:
                completion.logprobs.extend(out.new_logprobs)
            result.num_cached_tokens = out.num_cached_tokens
            stop = detok.add_tokens(out.new_token_ids) if detok is not None else None
            if stop is not None and not out.finished:
                completion.finish_reason, completion.stop_reason = "stop", stop.stop_string
                to_abort.append(out.request_id)
            elif out.finished:
                completion.finish_reason = out.finish_reason
                completion.stop_reason = out.stop_token_id if out.finish_reason == "stop" else None
                if stop is not None:
                    completion.finish_reason, completion.stop_reason = "stop", stop.stop_string
            if out.finished or stop is not None:
                if detok is not None:
                    completion.text = detok.text
                bar.update(1)
        if to_abort:
            self.engine.abort_requests(to_abort)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise RequestError("a dict prompt needs 'prompt_token_ids'", param="prompt")
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: give prompts as {'prompt_token_ids': [...]}",
                               param="prompt")
        return prompt, self.tokenizer.encode(prompt)

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop,
                                      params.include_stop_str_in_output)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> RequestOutput:
        """Render one conversation with the tokenizer's chat template and generate the reply."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so it has no chat template", param="messages")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = list(ids["input_ids"])
        return self.generate([{"prompt_token_ids": ids}], sampling_params, use_tqdm=use_tqdm)[0]
