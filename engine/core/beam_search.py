"""Beam search over the paged KV cache, scored as transformers' ``generate(num_beams=W)``.

A beam group is one caller request. Each live beam is an ordinary scheduler ``Request``
(``{id}#beam{k}``) whose step yields the top-K log-probabilities of its next token instead of a
sampled token; when every live beam of the group has reported, the group picks the next beams::

    running beams b (score s_b)  ──>  candidates (b, t, s_b + logprob_b(t)), the best K over all beams
        a candidate ending in EOS / a stop token / the length limit   -> a finished hypothesis
              (score / generated_len ** length_penalty), if it ranks among the first W
        the best W other candidates                                    -> the next running beams

A parent chosen once keeps its request and appends the token; chosen again, it forks: the child
shares the parent's full KV blocks (reference counts) and gets a copy of the partly filled last
block (copy-on-write, done on the device before the next forward pass); a parent not chosen is
dropped. The search ends as transformers' does with ``early_stopping=False``: when no running beam
can beat the worst of W finished hypotheses at the current length, or when every candidate ended.
"""

from __future__ import annotations

from engine.outputs import BeamResult, FinishReason


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
        self.started = False  # its first beam was admitted (the scheduler reserves W seats from then on)
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
