"""Stored responses (the Responses API's ``store``), in memory, for ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``.

Bounded three ways: at most ``max_responses`` entries, at most ``max_chars`` characters of JSON in all (the
conversations they hold), and each lives ``ttl_s`` seconds from when it was stored. Past a bound the least
recently used entries go first; a read counts as a use. A server restart forgets them all.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_RESPONSES = 1000
MAX_CHARS = 64 * 1024 * 1024
TTL_S = 3600.0


@dataclass
class StoredResponse:
    response: str  # the response object's JSON, as GET answers it
    items: list  # the conversation it continues: its previous response's items, then its own input items
    output: list  # its output items, as input items (what a follow-up sends back)
    num_chars: int
    stored_at: float


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_chars: int = MAX_CHARS, ttl_s: float = TTL_S,
                 clock=time.monotonic):
        self.max_responses = max_responses
        self.max_chars = max_chars
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response: str, items: list, output: list, num_chars: int) -> None:
        self.delete(response_id)
        if num_chars > self.max_chars:
            return  # larger than the whole store: kept nowhere (a follow-up gets a 404 for it)
        self._entries[response_id] = StoredResponse(response, items, output, num_chars, self._clock())
        self.num_chars += num_chars
        self._evict()

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_chars -= entry.num_chars
        return True

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        for response_id in [key for key, entry in self._entries.items() if entry.stored_at < deadline]:
            self.delete(response_id)

    def _evict(self) -> None:
        self._expire()
        while self._entries and (len(self._entries) > self.max_responses or self.num_chars > self.max_chars):
            self.delete(next(iter(self._entries)))

    def check_invariants(self) -> None:
        assert self.num_chars == sum(entry.num_chars for entry in self._entries.values())
        assert len(self._entries) <= self.max_responses and self.num_chars <= self.max_chars
