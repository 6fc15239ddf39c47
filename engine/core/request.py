"""A request as the scheduler sees it: token ids and how many of them are computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from engine.loading.mrope import MRopePositions
from engine.loading.multimodal import image_spans
from engine.outputs import EngineOutput, FinishReason
from engine.sampling_params import SamplingParams
from kvcache.manager import ADAPTER_KEY_PREFIX


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(slots=True, eq=False)
class RequestGroup:
    """Requests of one caller request (their parent) that the scheduler runs together: the beams of a beam search.

    The scheduler appends no sampled token to them: it reports each one's logprobs instead
    (``Scheduler.take_group_reports``), and the group's coordinator (engine/core/beam_search.py) chooses their
    tokens. Once its first request is admitted, the group holds ``width`` seats of the running batch, running
    or not, so that none of its beams ever waits for a seat that another request took.
    """

    request_id: str  # the parent: the caller's request
    width: int  # seats it holds once started
    started: bool = False  # its first request was admitted
    num_requests: int = 0  # its requests in the scheduler (added or forked, not finished yet)


class Request:
    """One sequence. Prefill, chunked prefill, decode and resumption after preemption are
    all the same thing here: compute ``num_tokens - num_computed_tokens`` more tokens.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        mm_inputs: list | None = None,
        mrope: MRopePositions | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens being sampled by steps in flight, not yet appended (0, or 1 while steps are planned ahead).
        self.num_placeholders = 0
        # Speculative decoding: tokens proposed for the next step (the engine's proposer sets them).
        self.spec_token_ids: list[int] = []
        # Whether its table holds slots for proposals of a step in flight, and the blocks it gave back (a step's
        # rejected proposals) that the runner's copy still holds.
        self.lookahead_slots, self.num_trimmed_blocks = False, 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.first_scheduled_time: float | None = None
        self.stop_token_id: int | None = None  # the token that stopped it, when one did
        # Entries for prompt positions 1.. (position 0 has no context), filled as the prefill computes
        # them; handed out with the first token, then dropped.
        self.prompt_logprobs: list | None = (
            [None] * (len(prompt_token_ids) - 1) if sampling_params.prompt_logprobs is not None else None)
        self.group: RequestGroup | None = None  # the group it runs in (a beam of a beam search); None: on its own
        self.resend = False  # its tokens changed other than by a sampled token: the runner gets it anew
        self.grammar = None  # a RequestGrammar (engine/core/structured_output.py) when the output is constrained
        self.set_images(mm_inputs)
        lora = sampling_params.lora_request
        self.lora_id = 0 if lora is None else lora.lora_int_id  # its LoRA adapter's id; 0: the base model
        # M-RoPE models: the prompt's three positions per token (engine/loading/mrope.py); None when every token's
        # position is its index (a text model, or a prompt without images).
        self.mrope = mrope

    def set_images(self, mm_inputs: list | None) -> None:
        """The prompt's images (``engine.loading.multimodal.ImageInput``s, by offset), and what follows from them."""
        self.mm_inputs = list(mm_inputs) if mm_inputs else []
        self.mm_spans = image_spans(self.mm_inputs)  # for the KV blocks' hashes
        lora = self.sampling_params.lora_request
        if lora is not None:  # the adapter keys the first block, and so every block after it: its own prefixes
            self.mm_spans = (*(self.mm_spans or ()), (0, 1, ADAPTER_KEY_PREFIX + str(lora.lora_int_id).encode()))
        self.mm_end = max((mm.end for mm in self.mm_inputs), default=0)  # prefill past it: no image ahead
        self.held_images: set[str] = set()  # content hashes it holds in the encoder cache

    @property
    def ready(self) -> bool:
        """False while its grammar is still being compiled: it cannot be scheduled yet."""
        return self.grammar is None or self.grammar.ready

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are still to be computed: no prefix-cache hit may skip them."""
        return self.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_ahead(self) -> int:
        """Known tokens plus the ones steps in flight are sampling."""
        return len(self.all_token_ids) + self.num_placeholders

    def reached_limits_ahead(self, max_model_len: int) -> bool:
        """True when the tokens in flight already take the request to max_tokens or the context limit."""
        if not self.num_placeholders:
            return False
        max_tokens = self.sampling_params.max_tokens
        num_out = self.num_tokens_ahead - len(self.prompt_token_ids)
        return (max_tokens is not None and num_out >= max_tokens) or self.num_tokens_ahead >= max_model_len

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def append_step_tokens(self, accepted, token_id: int, max_model_len: int) -> tuple[list[int], RequestStatus | None]:
        """Append a step's tokens: the proposals it accepted (speculative decoding; their KV is computed now),
        then its sampled token, each checked for a stop; the tokens after one that stops are dropped. Returns the
        tokens kept and the finished status (None to go on)."""
        if self.status == RequestStatus.RUNNING:  # (preempted meanwhile: its KV is computed again anyway)
            self.num_computed_tokens += len(accepted)
        new_token_ids = []
        for token in (*accepted, token_id):
            self.append_token(token)
            new_token_ids.append(token)
            status = self.check_stop(max_model_len)
            if status is not None:
                return new_token_ids, status
        return new_token_ids, None

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last appended token leads to, or None to go on."""
        params = self.sampling_params
        num_out = self.num_output_tokens
        if num_out >= params.min_tokens:
            last = self.all_token_ids[-1]
            if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
                self.stop_token_id = last
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def engine_output(self, new_token_ids: list[int], finished: bool = False, new_logprobs=None) -> EngineOutput:
        """What a step (or an abort) reports of this request: its new tokens, and how it ended."""
        prompt_logprobs = None
        if new_token_ids and self.prompt_logprobs is not None:
            prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return EngineOutput(
            request_id=self.request_id,
            new_token_ids=new_token_ids,
            finished=finished,
            finish_reason=FinishReason(self.status.value) if finished else None,
            stop_token_id=self.stop_token_id,
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=max(self.num_cached_tokens, 0),
            new_logprobs=new_logprobs or [],
            queue_time_s=(None if self.first_scheduled_time is None
                          else self.first_scheduled_time - self.arrival_time),
            prompt_logprobs=prompt_logprobs,
            num_preemptions=self.num_preemptions,
        )
