"""The engine's side of speculative decoding: after each step, proposals for the running requests that can take
them (``SpeculationProposer.propose``); the scheduler gives a request with proposals 1 + k tokens in its next step
and the runner verifies them (``engine.worker.speculation``).

A request speculates unless it is a beam of a beam search (whose tokens its group chooses) or a pooling request. The
verification changes each position's logits as the sampler changes a row's, with the proposals before it taken as
accepted: logprobs, penalties, min_tokens, logit_bias and allowed_token_ids keep their meaning
(``engine.worker.speculation``). A constrained request's n-gram proposals are cut at the first token its grammar
refuses (``RequestGrammar.allowed_prefix``), and the verification masks each position by the grammar's state there;
a draft model proposes nothing for one (its proposals are made on the device, where no grammar checks them). A step
that samples a request that does not speculate has no proposals: the batch decodes one token a step, as without
speculation, while such a request is in it.
``disable_by_batch_size``: no proposals while at least that many requests run, where a step of many requests is
busy enough without them.

Low acceptance: each request keeps a moving average of the share of its proposals accepted (``Acceptance``). Once
it has had ``PROBATION`` drafts and the average is under ``MIN_ACCEPTANCE``, it decodes without proposals for
``PAUSE_STEPS`` steps, then tries again with its average reset: a request whose text the proposer cannot guess (a
draft model that disagrees with the target, an n-gram history with nothing to copy) stops paying for verifying and
drafting proposals that are thrown away, and one whose text turns predictable later gets them back.

With a draft model the tokens are not known here: a request that speculates is given ``TO_DRAFT`` placeholders,
and the scheduler plans (and the KV manager allocates) 1 + k tokens for it as for n-gram proposals; the runner's
draft model writes the proposals over them at the start of the step that verifies them
(``engine.worker.draft_model``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.outputs import SpecDecodeStats
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramProposer

if TYPE_CHECKING:
    from engine.core.request import Request

TO_DRAFT = -1  # a proposal the runner's draft model makes at the start of the step (never a model input)
MIN_ACCEPTANCE = 0.2  # a request whose average share of proposals accepted falls below this pauses them...
PROBATION = 4  # ...once it has had this many drafts...
PAUSE_STEPS = 16  # ...for this many steps
SMOOTHING = 0.3  # the weight of a draft's share in the moving average


class Acceptance:
    """One request's recent acceptance: a moving average of the share of each draft's proposals accepted."""

    __slots__ = ("average", "drafts", "paused")

    def __init__(self):
        self.average, self.drafts, self.paused = 1.0, 0, 0

    def record(self, proposed: int, accepted: int) -> None:
        share = accepted / proposed
        self.average = share if not self.drafts else self.average + SMOOTHING * (share - self.average)
        self.drafts += 1
        if self.drafts >= PROBATION and self.average < MIN_ACCEPTANCE:
            self.paused, self.average, self.drafts = PAUSE_STEPS, 1.0, 0

    def proposes(self) -> bool:
        """Whether the request takes proposals in the next step (a paused one counts a step down)."""
        if self.paused:
            self.paused -= 1
            return False
        return True


def speculates(request: Request) -> bool:
    """Whether the request's sampling takes proposals (the module's rule)."""
    p = request.sampling_params
    return request.group is None and not p.use_beam_search and p.pooling is None


def take_proposals(request: Request, num_new: int, budget: int, max_model_len: int) -> list[int]:
    """The proposed tokens a decoding request computes after its last one in the step being planned: its
    proposals, as many as the budget, the model's length and max_tokens leave room for (a step that accepts them
    all adds one more token). Taken from the request: a later step needs new ones."""
    spec, request.spec_token_ids = request.spec_token_ids, []
    if not spec or num_new != 1 or request.num_placeholders:
        return []
    room = min(budget - 1, max_model_len - request.num_tokens)
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - request.num_output_tokens - 1)
    return spec[:max(room, 0)]


def drop_proposals_beside_others(spec_token_ids: dict[str, list[int]], num_scheduled: dict[str, int],
                                 requests: dict[str, Request]) -> int:
    """A verification step samples every row as ``speculates`` allows (no beam): where the step being planned also
    samples a request that does not speculate (one that joined since the proposals), its proposals are taken back
    (their slots, allocated, go back after the step: ``Scheduler.update_from_output``). Returns the tokens taken
    back."""
    if all(speculates(requests[rid]) for rid in num_scheduled
           if requests[rid].num_computed_tokens >= requests[rid].num_tokens):  # the step samples it
        return 0
    for rid, spec in spec_token_ids.items():
        num_scheduled[rid] -= len(spec)
    dropped = sum(map(len, spec_token_ids.values()))
    spec_token_ids.clear()
    return dropped


class SpeculationProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.ngram = (NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
                      if config.method == "ngram" else None)
        # vLLM's counters: requests' proposals verified, their tokens, the tokens accepted, and how often the
        # proposal at each position (0 .. k - 1) was accepted.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * config.num_speculative_tokens
        self.acceptance: dict[str, Acceptance] = {}  # by request id, of the running requests that speculated
        self.num_paused = 0  # times a request's proposals were paused for low acceptance

    def count(self, spec_token_ids: dict[str, list[int]], accepted_token_ids: dict[str, list[int]]) -> None:
        """A finished step's proposals and what its sampling accepted of them."""
        self.num_drafts += len(spec_token_ids)
        self.num_draft_tokens += sum(map(len, spec_token_ids.values()))
        for rid, spec in spec_token_ids.items():
            acceptance = self.acceptance.setdefault(rid, Acceptance())
            acceptance.record(len(spec), len(accepted_token_ids.get(rid, ())))
            self.num_paused += acceptance.paused == PAUSE_STEPS
        for accepted in accepted_token_ids.values():
            self.num_accepted_tokens += len(accepted)
            for position in range(len(accepted)):
                self.accepted_per_position[position] += 1

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))

    @classmethod
    def from_config(cls, given: dict[str, Any] | None) -> SpeculationProposer | None:
        config = SpeculativeConfig.parse(given)
        return cls(config) if config is not None else None

    def _off(self, running: list[Request]) -> bool:
        """No proposals for anyone: the batch is at ``disable_by_batch_size``, or holds a request that cannot take
        them (the step samples without them: ``drop_proposals_beside_others``)."""
        limit = self.config.disable_by_batch_size
        return (limit is not None and len(running) >= limit) or not all(map(speculates, running))

    def wants_proposals(self, running: Iterable[Request]) -> bool:
        """Whether the next step would give a running request proposals, were its tokens known: the engine plans
        a step ahead of the one in flight (async scheduling) only where it would not."""
        running = list(running)
        if self._off(running):
            return False
        for request in running:
            acceptance = self.acceptance.get(request.request_id)
            if (acceptance is None or not acceptance.paused) and (self.ngram is not None or request.grammar is None):
                return True
        return False

    def propose(self, running: Iterable[Request]) -> None:
        """Set each running request's proposals for the next step (none where it does not speculate, is not
        decoding, has paused them for low acceptance, or the batch is at ``disable_by_batch_size``). Called once a
        step: a paused request counts a step down here, whether or not it could take proposals."""
        running = list(running)
        off = self._off(running)
        if len(self.acceptance) > 2 * len(running):  # forget the requests that ended
            ids = {request.request_id for request in running}
            self.acceptance = {rid: a for rid, a in self.acceptance.items() if rid in ids}
        for request in running:
            acceptance = self.acceptance.get(request.request_id)
            paused = acceptance is not None and not acceptance.proposes()
            decoding = request.num_computed_tokens == request.num_tokens - 1 and not request.num_placeholders
            if off or paused or not decoding or not speculates(request):
                request.spec_token_ids = []
                continue
            if self.ngram is None:  # a draft model's proposals are unknown here: a grammar could not check them
                request.spec_token_ids = [] if request.grammar is not None else \
                    [TO_DRAFT] * self.config.num_speculative_tokens
                continue
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            request.spec_token_ids = self.ngram.propose(tokens).tolist()
            if request.grammar is not None:
                request.spec_token_ids = request.grammar.allowed_prefix(request.spec_token_ids)
