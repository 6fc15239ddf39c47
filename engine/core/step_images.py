"""The images of the step being planned: which ones it encodes, and how far a request's chunk may go.

A chunk that reaches an image not in the encoder cache encodes it this step, if the step's encoder budget
(``max_num_encoder_tokens`` image tokens) and the cache's free space allow it; otherwise the chunk stops just
before the image. A request holds every image from its first chunk that reaches it until its prefill has passed
it (``engine/core/encoder_cache.py`` keeps that book); preempted or finished, it holds none.
"""

from __future__ import annotations

from engine.core.encoder_cache import EncoderCacheManager
from engine.core.request import Request


class StepImages:
    def __init__(self, cache: EncoderCacheManager, max_num_encoder_tokens: int):
        self.cache = cache
        self.max_num_encoder_tokens = max_num_encoder_tokens
        self._budget = 0  # what is left of max_num_encoder_tokens in the step being planned
        self._inputs: list = []  # the images the step being planned encodes

    def begin_step(self) -> None:
        self._budget = self.max_num_encoder_tokens

    def end_step(self) -> tuple[list, list[str]]:
        """The images the planned step encodes, and the content hashes no request holds any more: passed by this
        step's chunks, or let go of by requests preempted here or finished since the last step (one that a
        request of this step took again stays, not encoded anew)."""
        inputs, self._inputs = self._inputs, []
        return inputs, self.cache.collect()

    def fit(self, request: Request, start: int, num_new: int) -> int:
        """How many of the ``num_new`` tokens from ``start`` this step can compute given the images they reach
        (0: the request waits for a later step)."""
        end, cost, counted = start + num_new, 0, set()
        for mm in request.mm_inputs:
            if mm.offset >= end:
                break
            if mm.end <= start or mm.content_hash in self.cache or mm.content_hash in counted:
                continue
            cost += mm.length
            if cost > self._budget or not self.cache.has_room(cost):
                return max(0, mm.offset - start)
            counted.add(mm.content_hash)
        return num_new

    def take(self, request: Request, num_new: int) -> None:
        """The request's next ``num_new`` tokens run this step: it holds each image they reach (the step
        encodes the ones not in the cache yet) and lets go of the ones it has now prefilled past."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        cache, held = self.cache, request.held_images
        for mm in request.mm_inputs:
            if mm.offset >= end:
                break
            if mm.end <= start or mm.content_hash in held:
                continue
            if cache.acquire(mm.content_hash, request.request_id, mm.length):
                self._inputs.append(mm)
                self._budget -= mm.length
            held.add(mm.content_hash)
        if held:
            ahead = {mm.content_hash for mm in request.mm_inputs if mm.end > end}
            for content_hash in held - ahead:
                cache.release(content_hash, request.request_id)
            held &= ahead

    def release(self, request: Request) -> None:
        """A preempted or finished request holds no image (a preempted one takes them again when it resumes)."""
        for content_hash in request.held_images:
            self.cache.release(content_hash, request.request_id)
        request.held_images.clear()
