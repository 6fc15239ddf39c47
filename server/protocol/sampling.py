"""The sampling fields completions and chat requests share, and the ``SamplingParams`` they give (structured
outputs, logit bias and logprobs checked as vLLM checks them)."""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

from pydantic import Field

from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from server.protocol.common import RequestModel

MAX_N = 128  # parallel samples per prompt
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage so far on every chunk


class JSONSchemaFormat(RequestModel):
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None  # an xgrammar structural tag


class SamplingRequest(RequestModel):
    """Fields shared by completions and chat; ``None`` means "the default"."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=_INT32_MAX)
    min_p: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = Field(None, le=MAX_N)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None  # vLLM: the prompt's and each choice's token ids in the response
    allowed_token_ids: list[int] | None = None  # vLLM: sample only among these
    # vLLM: keep only the prompt's last N tokens (-1: as many as the context holds with max_tokens)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM: which end truncate_prompt_tokens cuts: "left" (the default) keeps the last N, "right" the first N
    truncation_side: Literal["left", "right"] | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprob entries name tokens as "token_id:N"
    # vLLM: the top-N logprobs of every prompt token (scoring), -1 for the whole vocabulary
    prompt_logprobs: int | None = None
    # vLLM: the logprobs of these token ids at each generated position, in place of the top-N (with logprobs)
    logprob_token_ids: list[int] | None = None
    # vLLM: beam search of width n (the n best beams are the choices), scored with length_penalty
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older names for structured_outputs.
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Metadata only (METADATA_FIELDS).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far on every chunk (vLLM's ``continuous_usage_stats``). As in vLLM it takes effect with
        ``include_usage`` only: without it no chunk carries usage."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None,
                           tool_grammar: StructuredOutputsParams | None = None,
                           skip_special_tokens: bool | None = None, reasoning: str | None = None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        """Validated engine parameters: the request's values, else ``defaults`` (the model's generation
        config), else the engine's. ``max_tokens=None`` lets the engine fill the context.

        ``tool_grammar``: the constraint the tools put on the output; ``reasoning``: where the output's
        thinking block is (StructuredOutputsParams.reasoning), so that constraints start after it;
        ``prompt_logprobs``: when the request's own field is unset (completions' ``echo`` with ``logprobs``)."""
        if self.prompt_logprobs is not None:
            # vLLM's rules: a stream has nowhere to put them (0 asks only for the prompt tokens' own).
            if self.stream and (self.prompt_logprobs > 0 or self.prompt_logprobs == -1):
                raise SamplingParamsError("`prompt_logprobs` are not available when `stream=True`", "prompt_logprobs")
            if self.prompt_logprobs < -1:
                raise SamplingParamsError("`prompt_logprobs` must be a positive value or -1", "prompt_logprobs")
            prompt_logprobs = self.prompt_logprobs
        if self.stream_options is not None and not self.stream:
            raise SamplingParamsError("stream_options is only allowed when stream is true", "stream_options")
        named = self.logprob_token_ids or None  # vLLM's: an empty list names none
        if named is not None:
            if self.use_beam_search:
                raise SamplingParamsError("`logprob_token_ids` is not supported with beam search.",
                                          "logprob_token_ids")
            if logprobs is None:
                raise SamplingParamsError(f"when using `logprob_token_ids`, `logprobs` must be "
                                          f"{'set to true' if isinstance(self.logprobs, bool) else 'set'}.",
                                          "logprob_token_ids")
            logprobs = 0  # the named tokens take the top-N's place: only the sampled token's own is computed
        fields = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        given = {name: value for name, value in fields.items() if value is not None}
        sampling = {name: value for name, value in (defaults or {}).items() if name != "max_tokens"}
        if self.use_beam_search:
            # Beams are ranked by the model's own logprobs: the generation config's sampling knobs do not apply,
            # and a temperature asked for could not be honoured.
            if self.temperature not in (None, 0):
                raise SamplingParamsError("temperature cannot be combined with use_beam_search (beams are ranked "
                                          "by the model's logprobs)", "temperature")
            sampling = {}
            given.update(use_beam_search=True, length_penalty=1.0 if self.length_penalty is None
                         else self.length_penalty)
        elif self.length_penalty is not None:
            raise SamplingParamsError("length_penalty applies to beam search: set use_beam_search", "length_penalty")
        if skip_special_tokens is not None and self.skip_special_tokens is None:
            given["skip_special_tokens"] = skip_special_tokens  # the tool-call parser needs its markers
        structured = self.structured_outputs_params()
        if tool_grammar is not None:
            if structured is not None:
                raise SamplingParamsError("the tools constrain the output already (tool_choice 'required', a named "
                                          "function or strict tools): leave out response_format and structured "
                                          "outputs", "tool_choice")
            structured = tool_grammar
        if structured is not None and reasoning is not None and structured.structural_tag is None:
            structured = dataclasses.replace(structured, reasoning=reasoning)
        return SamplingParams(**{**sampling, **given}, max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs, logit_bias=self._logit_bias(),
                              structured_outputs=structured, allowed_token_ids=self.allowed_token_ids,
                              logprob_token_ids=named)

    def _logit_bias(self) -> dict[int, float] | None:
        """Token id keys (ASCII digits: ``"²"`` is no id) to biases; every key that is not one is named."""
        if not self.logit_bias:
            return None
        bias, bad = {}, []
        for key, value in self.logit_bias.items():
            # ASCII digits only: str.isdigit() also takes "²" and "١٢", which are no token ids.
            token_id = _ascii_int(key)
            if token_id is None:
                bad.append(key)
            else:
                bias[token_id] = value
        if bad:
            raise SamplingParamsError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: "
                                      f"{[k[:32] for k in bad[:8]]!r}", "logit_bias")
        return bias

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one grammar the request asks for, by whichever name it used (``param`` names it: the handler
        checks it once, off the event loop, with ``check_structured_outputs``). Every JSON schema is
        compiled strictly, as vLLM does whatever ``strict`` says: no properties beyond those it lists."""
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", StructuredOutputsParams(json_object=True, param="response_format")))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise SamplingParamsError("response_format: json_schema needs a schema", "response_format")
            asked.append(("response_format", _vllm_spec(fmt.json_schema.schema_, None, None, None, None,
                                                        "response_format")))
        so = self.structured_outputs
        if so is not None:
            asked.append(("structured_outputs", _vllm_spec(so.json_, so.regex, so.choice, so.grammar,
                                                           so.json_object, "structured_outputs",
                                                           structural_tag=so.structural_tag)))
        legacy = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}
        for name, value in legacy.items():
            if value is not None:
                asked.append((name, _vllm_spec(*(value if k == name else None for k in legacy), None, name)))
        if not asked:
            return None
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise SamplingParamsError(f"ask for one structured output, not several ({names})", asked[1][0])
        return asked[0][1]


def _ascii_int(text: str) -> int | None:
    if not (text.isascii() and text.isdigit()):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() converts
        return None


def _vllm_spec(json_schema, regex, choice, grammar, json_object, param: str,
               structural_tag=None) -> StructuredOutputsParams:
    try:
        if isinstance(json_schema, dict):
            json_schema = json.dumps(json_schema)
        if isinstance(structural_tag, dict):
            structural_tag = json.dumps(structural_tag)
    except RecursionError:
        raise SamplingParamsError(f"{param}: the JSON is nested too deeply", param) from None
    try:
        return StructuredOutputsParams(json=json_schema, regex=regex, choice=choice, grammar=grammar,
                                       json_object=bool(json_object), structural_tag=structural_tag, param=param)
    except SamplingParamsError as exc:
        raise SamplingParamsError(str(exc).replace("structured outputs", param), param) from None
