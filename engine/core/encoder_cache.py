"""The scheduler's book of the encoder cache: which images' embeddings the model runner holds, and for whom.

The model runner keeps each encoded image's embeddings (``[length, hidden]`` on the device) under its
content hash; this class decides what is in there. An image enters when a step's chunk first reaches
its placeholder tokens and it is not held yet: the step encodes it (once, however many requests of
the step need it). Every request whose prefill is inside or before one of its images holds it; a
request lets go once its prefill has passed the image (or when it is preempted or finishes), and an
image no request holds leaves the cache at the end of the step being planned (``collect``; a request
of that step may still take it back). Chunked prefill may thus cut through an image: the later chunks
read the rest of its embeddings from the cache.

Space is counted in embeddings (image tokens) against ``capacity``: an image that does not fit waits
(its request's chunk stops before it) until the images ahead of it are passed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EncoderCacheStats:
    """The encoder cache at one moment, and its counters since start (for /metrics)."""

    capacity_tokens: int  # image embeddings it may hold at once
    used_tokens: int
    num_images: int  # images held now
    num_encoded: int  # images encoded since start
    num_reused: int  # times a request found an image it needed already encoded


@dataclass
class _Entry:
    num_tokens: int
    holders: set[str] = field(default_factory=set)  # request ids


class EncoderCacheManager:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"the encoder cache needs a positive capacity, got {capacity}")
        self.capacity = capacity  # image tokens (embeddings) the runner may hold at once
        self.num_used = 0
        self._entries: dict[str, _Entry] = {}
        self.num_encoded = 0  # images encoded so far
        self.num_reused = 0  # times a request found an image it needed already encoded

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def has_room(self, num_tokens: int) -> bool:
        return self.num_used + num_tokens <= self.capacity

    def acquire(self, content_hash: str, request_id: str, num_tokens: int) -> bool:
        """``request_id`` holds the image; True when it is new here (the step must encode it)."""
        entry = self._entries.get(content_hash)
        new = entry is None
        if new:
            entry = self._entries[content_hash] = _Entry(num_tokens)
            self.num_used += num_tokens
            self.num_encoded += 1
        elif request_id not in entry.holders:
            self.num_reused += 1
        entry.holders.add(request_id)
        return new

    def release(self, content_hash: str, request_id: str) -> None:
        """``request_id`` no longer needs the image (it stays until ``collect``; another request may take it)."""
        entry = self._entries.get(content_hash)
        if entry is not None:
            entry.holders.discard(request_id)

    def collect(self) -> list[str]:
        """Drop the images no request holds; return their hashes (the runner frees their embeddings)."""
        gone = [h for h, entry in self._entries.items() if not entry.holders]
        for h in gone:
            self.num_used -= self._entries.pop(h).num_tokens
        return gone

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(self.capacity, self.num_used, len(self._entries), self.num_encoded, self.num_reused)

    def check_invariants(self) -> None:
        assert self.num_used == sum(e.num_tokens for e in self._entries.values()), "encoder cache: used != entries"
        assert 0 <= self.num_used, "encoder cache: negative use"
