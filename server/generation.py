"""One API request in flight: its prompts, its parameters, and the stream of its choices' deltas.

    prompts x n samples ──> AsyncEngine.generate ──> one engine request per choice
                        <── RequestStream: lists of ChoiceDelta, merged while the reader is busy

Streamed and non-streamed responses both consume ``Generation.updates()``, so their text
is identical by construction. Stop strings, detokenization and the n fan-out happen in
the engine's output processor (the same one ``LLM`` uses). Closing ``updates()`` early
(a client that went away) aborts every choice still running and frees its KV blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.frontend.async_engine import RequestStream
from engine.frontend.output_processor import ChoiceDelta, Usage
from engine.sampling_params import SamplingParams
from server.tokenization import TokenizedPrompt


@dataclass
class Generation:
    request_id: str
    prompts: list[TokenizedPrompt]
    params: SamplingParams
    stream: RequestStream
    model: str  # what responses name as their model: the served model's name, or the LoRA adapter's

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    async def updates(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Every choice's deltas, a list at a time (at most one per choice); raises if the engine fails."""
        try:
            async for batch in self.stream:
                yield batch
        finally:
            self.stream.close()

    def usage(self) -> Usage:
        return self.stream.state.usage()
