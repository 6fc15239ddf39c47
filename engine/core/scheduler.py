"""Continuous batching in token counts.

Each step has a token budget (``max_num_batched_tokens``). Running requests are served
first, in arrival order, then waiting ones (FCFS). A request is simply given
``num_tokens - num_computed_tokens`` more tokens, or as many as the budget allows:
decode, prefill, chunked prefill and resumption after preemption are one mechanism,
and one step can mix them all.

When the KV pool runs out, the newest running request is preempted and goes back to the front of
the queue with its generated tokens. By recompute, its blocks are freed and it is prefilled again
later (prefix caching, in both tiers, usually makes that cheap). By swap (with a host tier,
``kvcache/host_pool.py``), its KV is kept in host memory and copied back when it resumes, with
exactly the tokens it had. ``preemption_mode`` "auto" swaps a request whose KV holds more tokens
than one step's budget (``max_num_batched_tokens``), so that bringing it back by prefill would take
more than one step, and recomputes shorter ones.

Images (a multimodal model's prompts) are encoded when a chunk first reaches their placeholder
tokens: each step encodes at most ``max_num_encoder_tokens`` image tokens' worth of images (the
same number as the token budget), into the encoder cache (``engine/core/encoder_cache.py``), which holds
each image until every request that needs it has prefilled past it. A chunk that would reach an
image the step cannot encode (budget spent, cache full) stops before it (``engine/core/step_images.py``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from engine.core.encoder_cache import EncoderCacheManager
from engine.core.request import Request, RequestGroup, RequestStatus
from engine.core.step_images import StepImages
from engine.outputs import (
    CachedRequestData,
    EngineOutput,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from engine.speculative.proposer import drop_proposals_beside_others, take_proposals
from kvcache.manager import KVCacheManager


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        max_num_encoder_tokens: int = 0,
        preemption_mode: str = "recompute",
        max_loras: int | None = None,
    ):
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.max_loras = max_loras  # LoRA: most adapters among the running requests (their device slots)
        self._requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._freed_ids: set[str] = set()  # reported to the runner with the next step
        self.num_preemptions_total = 0
        self.preemption_mode = preemption_mode  # "recompute", "swap" or "auto" (the module docstring)
        self.num_swapped_out = 0  # preemptions by swap (the rest were by recompute)
        self._groups: dict[str, RequestGroup] = {}  # started groups that have requests, by parent id: they hold seats
        # Grouped requests whose step gave their next-token logprobs: (request, Logprobs), for their coordinator.
        self.group_reports: list[tuple[Request, Logprobs]] = []
        self._block_copies: list[tuple[int, int]] = []  # forked requests' partial blocks, copied before the next step
        # A model that takes images: the image tokens a step may encode, which is also the encoder cache's size.
        self.encoder_cache = EncoderCacheManager(max_num_encoder_tokens) if max_num_encoder_tokens > 0 else None
        self._images = StepImages(self.encoder_cache, max_num_encoder_tokens) if max_num_encoder_tokens > 0 else None

    # ----------------------------------------------------------------- public API

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._requests[request.request_id] = request
        if request.group is not None:
            request.group.num_requests += 1
        self.waiting.append(request)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request of that id, or None."""
        return self._requests.get(request_id)

    def grammars_of(self, request_ids: list[str]) -> list:
        """Each request's grammar (``RequestGrammar``), in order; None for a request without one, or gone."""
        requests = self._requests
        return [None if (r := requests.get(rid)) is None else r.grammar for rid in request_ids]

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineOutput]:
        """Finish the given requests with reason "abort" and free their blocks. Unknown ids are ignored."""
        aborted = [self._requests[rid] for rid in dict.fromkeys(request_ids) if rid in self._requests]
        if not aborted:
            return []
        # One pass over each queue, however many are aborted: a client that drops a request of
        # thousands of choices costs linear time, not a list.remove per choice.
        gone = {id(r) for r in aborted}
        if any(r.status == RequestStatus.RUNNING for r in aborted):
            self.running = [r for r in self.running if id(r) not in gone]
        if any(r.status != RequestStatus.RUNNING for r in aborted):
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        outputs = []
        for request in aborted:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(request.engine_output([], finished=True))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_ready_requests(self) -> bool:
        """Whether a step could run now: a request is running, or one waits whose grammar (if any) is compiled."""
        return bool(self.running) or any(r.ready for r in self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        spec_token_ids: dict[str, list[int]] = {}
        num_preempted = 0
        if self._images is not None:
            self._images.begin_step()

        # 1. Running requests, oldest first. If one cannot get blocks, preempt from the newest end.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.reached_limits_ahead(self.max_model_len):
                i += 1  # its last token is already being sampled; it finishes when that arrives
                continue
            num_new = min(request.num_tokens_ahead - request.num_computed_tokens, budget)
            if request.mm_end > request.num_computed_tokens:  # images ahead: the chunk may stop before one
                num_new = self._images.fit(request, request.num_computed_tokens, num_new)
            if num_new == 0:
                i += 1  # a grouped request that waits for its next token to be chosen, or an image that waits
                continue
            spec = take_proposals(request, num_new, budget, self.max_model_len)
            new_block_ids, preempted = self._allocate_or_preempt(request, num_new + len(spec), len(spec))
            num_preempted += preempted
            if new_block_ids is None:  # the request itself was preempted
                break
            if request.resend:  # a grouped request whose token was chosen, or that was forked
                new_reqs.append(self._new_request_data(request, request.num_computed_tokens))
                request.resend = False
            else:
                cached_reqs.append(CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens,
                                                     request.num_trimmed_blocks))
            request.num_trimmed_blocks = 0
            num_scheduled[request.request_id] = num_new + len(spec)
            if spec:
                spec_token_ids[request.request_id] = spec
                request.lookahead_slots = True
            if request.mm_end > request.num_computed_tokens:
                self._images.take(request, num_new)
            self._advance(request, num_new)  # proposals count as computed once accepted (update_from_output)
            budget -= num_new + len(spec)
            i += 1

        # 2. Waiting requests, first come first served; none while memory is short this step. A request
        # whose grammar is still compiling is passed over (it keeps its place) rather than holding up the queue.
        if num_preempted == 0:
            budget = self._admit_waiting(budget, new_reqs, num_scheduled)
            if not num_scheduled and self.waiting and self._groups:
                # Everything running is a beam waiting for siblings that wait for memory: make room.
                while not num_scheduled and self._preempt_parked_group():
                    budget = self._admit_waiting(budget, new_reqs, num_scheduled)
        if spec_token_ids:  # proposals only in a step whose every sampled request can take them
            budget += drop_proposals_beside_others(spec_token_ids, num_scheduled, self._requests)

        freed, self._freed_ids = self._freed_ids, set()
        copies, self._block_copies = self._block_copies, []
        # A step that runs nothing leaves its copies to the next one (before anything writes the blocks again).
        loads, saves = self.kv.take_transfers() if num_scheduled else ([], [])
        out = SchedulerOutput(
            new_requests=new_reqs,
            cached_requests=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            freed_request_ids=freed,
            num_preempted=num_preempted,
            block_copies=copies,
            kv_loads=loads,
            kv_saves=saves,
            spec_token_ids=spec_token_ids,
        )
        if self._images is not None:
            out.encoder_inputs, out.freed_encoder_hashes = self._images.end_step()
        return out

    def update_from_output(self, sched: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineOutput]:
        """Append the sampled tokens (resolving their placeholders) and finish what stopped.

        A request that finished here may be in a step already planned ahead; that step's
        token for it is dropped (the request is gone by then).
        """
        outputs: list[EngineOutput] = []
        requests = self._requests
        for rid, chunk in runner_out.prompt_logprobs.items():
            request = requests.get(rid)
            if request is not None and request.prompt_logprobs is not None:
                start = chunk.first_position - 1  # the request's list has no entry for position 0
                request.prompt_logprobs[start : start + len(chunk.entries)] = chunk.entries
        for rid, token_id in zip(runner_out.request_ids, runner_out.sampled_token_ids):
            request = requests.get(rid)
            if request is None:  # aborted or finished while the step ran
                continue
            request.num_placeholders -= 1
            if request.group is not None:  # its coordinator picks its token, with the rest of its group
                self.group_reports.append((request, runner_out.logprobs[rid][0]))
                continue
            accepted = runner_out.accepted_token_ids.get(rid, ())
            new_token_ids, status = request.append_step_tokens(accepted, token_id, self.max_model_len)
            if request.lookahead_slots and request.status == RequestStatus.RUNNING and not request.num_placeholders:
                # The slots of its rejected (or dropped) proposals go back to the pool.
                request.num_trimmed_blocks += self.kv.trim(rid, request.num_computed_tokens)
                request.lookahead_slots = False
            if request.grammar is not None and status is None:
                status = self._follow_grammar(request, token_id)
            new_logprobs = runner_out.logprobs.get(rid, [])[: len(new_token_ids)]  # (none past a stop)
            if status is None:
                outputs.append(request.engine_output(new_token_ids, new_logprobs=new_logprobs))
                continue
            # A request preempted while this token was in flight is already back in the queue.
            (self.running if request.status == RequestStatus.RUNNING else self.waiting).remove(request)
            self._finish(request, status)
            outputs.append(request.engine_output(new_token_ids, finished=True, new_logprobs=new_logprobs))
        return outputs

    # ------------------------------------------------------------------ helpers

    def _admit_waiting(self, budget: int, new_reqs: list[NewRequestData], num_scheduled: dict[str, int]) -> int:
        """Admit waiting requests in order while they fit; returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self._first_ready_waiting()
            if request is None:
                break
            if (self._groups or request.group is not None) and not self._has_seat(request):
                break
            scheduled = self._schedule_waiting(request, budget)
            if scheduled is None:
                break
            if request.group is not None and not request.group.started:
                request.group.started = True
                self._groups[request.group.request_id] = request.group
            self.waiting.remove(request) if request is not self.waiting[0] else self.waiting.popleft()
            self.running.append(request)
            new_data, num_new = scheduled
            new_reqs.append(new_data)
            num_scheduled[request.request_id] = num_new
            if request.mm_end > request.num_computed_tokens:
                self._images.take(request, num_new)
            self._advance(request, num_new)
            budget -= num_new
        return budget

    def _first_ready_waiting(self) -> Request | None:
        """The first waiting request that can start: its grammar is compiled, and its LoRA adapter is one the
        running requests use or has a free slot (a request waiting for a slot lets those behind it go first)."""
        if self.max_loras is None:
            if self.waiting[0].ready:  # the usual case, in O(1)
                return self.waiting[0]
            return next((r for r in self.waiting if r.ready), None)
        adapters = {r.lora_id for r in self.running} - {0}
        return next((r for r in self.waiting if r.ready and (r.lora_id in adapters or r.lora_id == 0
                                                             or len(adapters) < self.max_loras)), None)

    @staticmethod
    def _follow_grammar(request: Request, token_id: int) -> RequestStatus | None:
        """A grammar that has ended with this token (or refused it) ends the request. The engine has
        fed the step's tokens into the grammars already (StepPipeline.finish)."""
        if request.grammar.ended:
            if token_id in request.eos_token_ids or token_id in request.sampling_params.stop_token_ids:
                request.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        return None

    @staticmethod
    def _advance(request: Request, num_new: int) -> None:
        """Count the scheduled tokens as computed now, so the next step can be planned before this
        one's tokens are known; a step that completes the known tokens leaves one placeholder
        for the token it samples."""
        request.num_computed_tokens += num_new
        if request.num_computed_tokens == request.num_tokens_ahead:
            request.num_placeholders += 1

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be planned before this step's tokens are known.

        Not while a running request needs its exact output so far to sample: penalties count
        generated tokens, and min_tokens counts them to mask EOS. Nor while a group runs (a beam search):
        its next tokens are chosen from all its requests' logprobs.
        """
        return not any(r.sampling_params.has_penalties or r.sampling_params.min_tokens or r.group is not None
                       for r in self.running)

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             num_lookahead: int = 0) -> tuple[list[int] | None, int]:
        """Blocks for ``num_new`` more tokens (``num_lookahead`` of them proposals past the known tokens),
        preempting newer requests until they fit.

        Returns the new block ids (None when ``request`` itself had to be preempted) and
        how many requests were preempted.
        """
        num_preempted = 0
        while True:
            new_block_ids = self.kv.allocate_slots(
                request.request_id, request.all_token_ids, request.num_computed_tokens, num_new,
                mm_spans=request.mm_spans, num_lookahead_tokens=num_lookahead,
            )  # a placeholder's block is hashed once its token is known
            if new_block_ids is not None:
                return new_block_ids, num_preempted
            victim = self.running.pop()  # the newest running request
            self._preempt(victim)
            num_preempted += 1
            if victim is request:
                return None, num_preempted

    def _schedule_waiting(self, request: Request, budget: int) -> tuple[NewRequestData, int] | None:
        """Admit the head of the queue with as many tokens as fit, or None if it cannot run now."""
        if request.num_placeholders:
            return None  # preempted while its last token was being sampled: wait for that token
        # Counted only once the request is admitted: one that waits for blocks is looked up again next step.
        # Prompt logprobs come from computing every prompt token: a prefix hit would skip some.
        prefix = None
        if not request.wants_prompt_logprobs:
            prefix = self.kv.find_prefix(request.request_id, request.all_token_ids, mm_spans=request.mm_spans)
        num_cached = prefix.num_tokens if prefix is not None else 0
        num_new = request.num_tokens - num_cached
        if num_new > budget and not self.enable_chunked_prefill:
            return None
        num_new = min(num_new, budget)
        if request.mm_end > num_cached:
            fitted = self._images.fit(request, num_cached, num_new)
            if fitted == 0 or (fitted < num_new and not self.enable_chunked_prefill):
                return None  # its next image cannot be encoded this step
            num_new = fitted
        new_block_ids = self.kv.allocate_slots(
            request.request_id, request.all_token_ids, num_cached, num_new, mm_spans=request.mm_spans, prefix=prefix,
        )
        if new_block_ids is None:
            return None
        if prefix is not None:
            self.kv.record_prefix_hit(request.num_tokens, prefix)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.resend = False
        return self._new_request_data(request, num_cached), num_new

    def _new_request_data(self, request: Request, num_computed: int) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv.get_block_ids(request.request_id),
            num_computed_tokens=num_computed,
            prompt_logprobs=request.sampling_params.prompt_logprobs if request.wants_prompt_logprobs else None,
            mm_inputs=request.mm_inputs or None,
            mrope=request.mrope,
        )

    # ------------------------------------------------------------------ groups

    def take_group_reports(self) -> list[tuple[Request, Logprobs]]:
        """The grouped requests whose steps gave their next-token logprobs since the last call, with them."""
        reports, self.group_reports = self.group_reports, []
        return reports

    def append_chosen_token(self, request: Request, token_id: int) -> None:
        """A grouped request goes on with the token its coordinator chose (the runner gets its row anew)."""
        request.append_token(token_id)
        request.resend = True

    def fork_request(self, parent: Request, child_id: str, token_id: int) -> Request:
        """A new request of the parent's group: the parent's tokens plus ``token_id``. With the parent's KV in the
        pool, it shares the full blocks and copies the partial one; otherwise (the parent was preempted) it is
        recomputed."""
        child = Request(child_id, parent.prompt_token_ids, parent.sampling_params, parent.eos_token_ids,
                        parent.arrival_time, parent.mm_inputs, parent.mrope)
        child.all_token_ids = parent.all_token_ids + [token_id]
        child.group = parent.group
        child.group.num_requests += 1
        child.first_scheduled_time, child.num_cached_tokens = parent.first_scheduled_time, parent.num_cached_tokens
        self._requests[child_id] = child
        if parent.status == RequestStatus.RUNNING and parent.num_computed_tokens > 0:
            copies = self.kv.fork(parent.request_id, child_id, parent.num_computed_tokens)
            if copies is not None:
                self._block_copies += copies
                child.num_computed_tokens = parent.num_computed_tokens
                child.status, child.resend = RequestStatus.RUNNING, True
                self.running.append(child)
                return child
        self.waiting.appendleft(child)
        return child

    def drop_request(self, request: Request) -> None:
        """A request gone without an output (a beam its group did not continue)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)

    def _has_seat(self, request: Request) -> bool:
        """Room in the running batch: a started group holds seats for all its requests, running or not."""
        # Every running grouped request's group is a started one, and no group runs more than its width.
        reserved = sum(g.width for g in self._groups.values()) - sum(1 for r in self.running if r.group is not None)
        group = request.group
        if group is None:
            return len(self.running) + reserved < self.max_num_seqs
        if not group.started:
            return len(self.running) + reserved + group.width <= self.max_num_seqs
        return len(self.running) + reserved <= self.max_num_seqs  # its own seat is among the reserved

    def _preempt_parked_group(self) -> bool:
        """Make room for the head of the queue when every running request is a beam waiting for siblings
        that wait for blocks: preempt the newest other group whose running requests are all waiting so.

        Its requests queue behind its own waiting ones, so that the head's group (whose parked requests stay)
        gets its requests in and moves on. False if there is none to preempt.
        """
        head = self.waiting[0].group
        for request in reversed(self.running):
            group = request.group
            if group is None or group is head:
                continue
            members = [r for r in self.running if r.group is group]
            if any(r.num_tokens_ahead != r.num_computed_tokens for r in members):
                continue
            after = max((i for i, r in enumerate(self.waiting) if r.group is group), default=len(self.waiting) - 1)
            for r in members:
                self.running.remove(r)
                self._preempt(r, queue_at=after + 1)
            return True
        return False

    def _preempt(self, request: Request, queue_at: int = 0) -> None:
        """Preemption: keep the tokens, requeue (at the front); the KV goes to the host tier (swap) or is
        dropped (recompute)."""
        if self._swaps(request) and self.kv.swap_out(request.request_id, request.all_token_ids,
                                                     request.num_computed_tokens, request.mm_spans):
            self.num_swapped_out += 1
        else:
            self.kv.free(request.request_id)
        if request.held_images:
            self._images.release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        # The runner forgets it, and gets its whole table when it rejoins.
        request.num_trimmed_blocks, request.lookahead_slots = 0, False
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.insert(queue_at, request)
        self._freed_ids.add(request.request_id)

    def _swaps(self, request: Request) -> bool:
        """Whether preempting ``request`` keeps its KV in the host tier (the module docstring's rule). A request
        whose prompt logprobs are still to come is recomputed: they come from computing its prompt."""
        if self.preemption_mode == "recompute" or request.wants_prompt_logprobs:
            return False
        return self.preemption_mode == "swap" or request.num_computed_tokens > self.max_num_batched_tokens

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        if request.held_images:
            self._images.release(request)
        del self._requests[request.request_id]
        self._freed_ids.add(request.request_id)
        group = request.group
        if group is not None:
            group.num_requests -= 1
            if group.num_requests == 0:  # the group is over: its seats are free
                self._groups.pop(group.request_id, None)
