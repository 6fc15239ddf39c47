"""Beam search over the paged KV cache, scored as transformers' ``generate(num_beams=W)``.

A beam search is one caller request: one ``BeamGroup`` of the engine's ``BeamSearch`` coordinator.
Each live beam is an ordinary scheduler ``Request`` (``{id}#beam{k}``) in the search's
``RequestGroup`` (its parent id and seats): its step yields the top-K log-probabilities of its
next token instead of a sampled token (``Scheduler.take_group_reports``); when every live beam
of the search has reported, the group picks the next beams::

    running beams b (score s_b)  ──>  candidates (b, t, s_b + logprob_b(t)), the best K over all beams
        a candidate ending in EOS / a stop token / the length limit   -> a finished hypothesis
              (score / generated_len ** length_penalty), if it ranks among the first W
        the best W other candidates                                    -> the next running beams

A parent chosen once keeps its request and appends the token; chosen again, it forks: the child
shares the parent's full KV blocks (reference counts) and gets a copy of the partly filled last
block (copy-on-write, done on the device before the next forward pass); a parent not chosen is
dropped (``Scheduler.fork_request``, ``append_chosen_token``, ``drop_request``). The search ends as
transformers' does with ``early_stopping=False``: when no running beam can beat the worst of W
finished hypotheses at the current length, or when every candidate ended.
"""

from __future__ import annotations

import dataclasses

from engine.core.request import Request, RequestGroup
from engine.core.scheduler import Scheduler
from engine.loading.mrope import MRopePositions
from engine.outputs import BeamResult, EngineOutput, FinishReason, Logprobs
from engine.sampling_params import SamplingParams


class BeamGroup:
    """The search state of one request: its live beams, their scores and the finished hypotheses."""

    def __init__(self, request_id: str, num_prompt_tokens: int, width: int, length_penalty: float,
                 stop_token_ids: frozenset[int], max_tokens: int, max_model_len: int):
        self.request_id = request_id
        self.width = width
        self.length_penalty = length_penalty
        self.stop_token_ids = stop_token_ids
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.num_prompt_tokens = num_prompt_tokens
        # As transformers: enough candidates that W remain after each stop token took one per beam.
        self.num_candidates = max(2, 1 + len(stop_token_ids)) * width
        self.beams: dict[str, float] = {}  # live beam request id -> cumulative logprob
        self.reports: dict[str, tuple[list[int], list[float]]] = {}  # this round: beam -> (top ids, top logprobs)
        self.finished: list[tuple[float, list[int]]] = []  # (score, generated tokens), best first, at most W
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.seats = RequestGroup(request_id, width)  # what the scheduler knows of the search
        self._next_id = 0

    def new_beam_id(self) -> str:
        beam_id = f"{self.request_id}#beam{self._next_id}"
        self._next_id += 1
        return beam_id

    def report(self, beam_id: str, top_ids: list[int], top_logprobs: list[float]) -> bool:
        """A live beam's next-token logprobs; True once every live beam has reported this round."""
        if beam_id in self.beams:
            self.reports.setdefault(beam_id, (top_ids, top_logprobs))
        return len(self.reports) == len(self.beams)

    def select(self, generated: dict[str, list[int]]) -> tuple[list[tuple[str, int, float]], bool]:
        """Pick the next running beams from this round's reports.

        ``generated``: each live beam's generated tokens so far. Returns the next running beams as
        (parent beam id, token, cumulative logprob), best first, and whether the search is over.
        """
        cur_len = self.num_prompt_tokens + len(next(iter(generated.values())))
        new_len = cur_len + 1 - self.num_prompt_tokens  # generated tokens with the candidate's
        at_limit = new_len >= self.max_tokens or cur_len + 1 >= self.max_model_len
        candidates = [(self.beams[beam] + lp, beam, token)
                      for beam, (ids, lps) in self.reports.items() for token, lp in zip(ids, lps)]
        candidates.sort(key=lambda c: -c[0])
        candidates = candidates[: self.num_candidates]
        self.reports = {}
        running, ended = [], []
        for rank, (score, beam, token) in enumerate(candidates):
            if at_limit or token in self.stop_token_ids:
                if rank < self.width and self.improvable:
                    ended.append((score / new_len ** self.length_penalty, generated[beam] + [token]))
            elif len(running) < self.width:
                running.append((beam, token, score))
        self.finished = sorted(self.finished + ended, key=lambda f: -f[0])[: self.width]
        if not running:
            return [], True
        # Could the best running beam still beat the worst kept hypothesis (at today's length)?
        if len(self.finished) == self.width:
            best_possible = running[0][2] / new_len ** self.length_penalty
            self.improvable = self.improvable and best_possible > self.finished[-1][0]
        return running, not self.improvable

    def results(self) -> list[BeamResult]:
        """The finished hypotheses, best first."""
        out = []
        for score, tokens in self.finished:
            stopped = bool(tokens) and tokens[-1] in self.stop_token_ids
            out.append(BeamResult(tokens, FinishReason.STOP if stopped else FinishReason.LENGTH,
                                  tokens[-1] if stopped else None, score))
        return out


class BeamSearch:
    """The engine's beam searches. The engine adds, aborts and advances them; they run their beams through the
    scheduler's public methods only."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: frozenset[int], max_model_len: int):
        self._scheduler = scheduler
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self._groups: dict[str, BeamGroup] = {}  # by the caller's request id

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float | None,
            mm_inputs: list | None = None, mrope: MRopePositions | None = None) -> Request:
        """Start a beam search (``request_id``): its first beam, which prefills the prompt, is queued."""
        if request_id in self._groups or self._scheduler.get_request(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_token_ids))
        group = BeamGroup(request_id, len(prompt_token_ids), params.n, params.length_penalty, frozenset(stop),
                          params.max_tokens, self._max_model_len)
        # Each beam reports its top candidates' raw logprobs; the group chooses the tokens.
        beam_params = dataclasses.replace(params, n=1, use_beam_search=False, temperature=0.0,
                                          logprobs=group.num_candidates)
        first = Request(group.new_beam_id(), prompt_token_ids, beam_params, self._eos_token_ids, arrival_time,
                        mm_inputs, mrope)
        first.group = group.seats
        group.beams[first.request_id] = 0.0
        self._scheduler.add_request(first)
        self._groups[request_id] = group
        return first

    def abort(self, request_ids: list[str]) -> list[EngineOutput]:
        """End the beam searches among ``request_ids`` (their beams dropped); their outputs finish with "abort"."""
        if not self._groups:
            return []
        outputs = []
        for rid in request_ids:
            group = self._groups.pop(rid, None)
            if group is not None:
                for beam in group.beams:
                    self._scheduler.drop_request(self._scheduler.get_request(beam))
                outputs.append(EngineOutput(rid, [], finished=True, finish_reason=FinishReason.ABORT, beams=[]))
        return outputs

    def advance(self, reports: list[tuple[Request, Logprobs]]) -> list[EngineOutput]:
        """Hand a step's beam logprobs to their searches; every search whose live beams have all reported
        chooses its next beams (forking, continuing and dropping beam requests), or ends with an output."""
        ready = {}
        for request, logprobs in reports:
            group = self._groups.get(request.group.request_id)
            if group is not None and group.seats is request.group and group.report(
                    request.request_id, logprobs.top_token_ids, logprobs.top_logprobs):
                ready[group.request_id] = group
        outputs = []
        for group in ready.values():
            beams = {rid: self._scheduler.get_request(rid) for rid in group.beams}
            running, done = group.select({rid: r.output_token_ids for rid, r in beams.items()})
            if done:
                outputs.append(self._finish(group, beams))
            else:
                self._branch(group, beams, running)
        return outputs

    def _branch(self, group: BeamGroup, beams: dict[str, Request], running: list[tuple[str, int, float]]) -> None:
        """The next round's beams: a parent chosen once goes on with its token, chosen again it forks, not chosen
        it is dropped."""
        scheduler = self._scheduler
        chosen = {parent for parent, _, _ in running}
        for rid, request in beams.items():
            if rid not in chosen:
                scheduler.drop_request(request)  # first: its blocks may serve the forks' copies
        next_beams, continued = {}, {}
        for parent, token, score in running:
            if parent in continued:  # chosen again: a new beam branches off it
                child = scheduler.fork_request(beams[parent], group.new_beam_id(), token)
                next_beams[child.request_id] = score
            else:
                continued[parent] = (token, score)
        for parent, (token, score) in continued.items():  # after the forks, which copy the parent's tokens
            scheduler.append_chosen_token(beams[parent], token)
            next_beams[parent] = score
        group.beams = next_beams

    def _finish(self, group: BeamGroup, beams: dict[str, Request]) -> EngineOutput:
        first = next(iter(beams.values()))
        for request in beams.values():
            self._scheduler.drop_request(request)
        del self._groups[group.request_id]
        results = group.results()
        return EngineOutput(
            request_id=group.request_id, new_token_ids=[], finished=True, finish_reason=results[0].finish_reason,
            num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=max(first.num_cached_tokens, 0),
            queue_time_s=(None if first.first_scheduled_time is None
                          else first.first_scheduled_time - first.arrival_time),
            beams=results,
        )
