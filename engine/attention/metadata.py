"""Per-step attention metadata: where each request's tokens and KV slots are.

A step's batch is a flat list of tokens from several requests. Requests are laid
out one after another, decodes (exactly one new token) first::

    tokens:      | r0 | r1 | r2 | r3 r3 r3 r3 | r4 r4 |
    query_start:  0    1    2    3             7       9   (num_reqs + 1 entries)
    num_decodes = 3

For request ``i`` the new tokens sit at positions
``seq_lens[i] - query_len(i) .. seq_lens[i] - 1`` of its sequence; earlier
positions are already in the paged KV cache. Token ``p`` of request ``i`` lives
in slot ``block_tables[i, p // block_size] * block_size + p % block_size``.

The metadata is passed explicitly to every attention layer: there is no module
global that could be left set after an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class AttentionMetadata:
    # Device tensors.
    slot_mapping: torch.Tensor  # [num_tokens] int64: KV slot of each new token
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    # Host-side values, known when the batch is built (no device sync needed).
    num_reqs: int
    # The first num_decodes requests have query length 1, longest context first: the model runner lays them out
    # so, and the decode kernels start their programs in row order (so that the short contexts fill the tail).
    num_decodes: int
    num_decode_tokens: int  # == num_decodes; kept for readability at call sites
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, on the CPU
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32, on the CPU
    # A mixed step run as a CUDA graph (engine/worker/cuda_graphs.py, ``MixedGraphs``) does not know which rows are
    # decodes when it is captured: num_decodes is 0, and this [num_reqs] int32 device tensor holds each row's
    # context length if it is a decode (one new token) and 0 if not. The decode kernel then runs over every row
    # with these lengths, the prefill kernel over every row but the decodes. Requests may have no new tokens
    # (padding), and tokens past the last request's are padding too.
    decode_seq_lens: torch.Tensor | None = None
    # What a backend derives from this step's metadata once for all its layers (``derive``); a fresh metadata
    # (``dataclasses.replace`` included) starts empty.
    _derived: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def derive(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``, computed by the first layer that asks for ``key`` in this step and shared by the others:
        values every layer would compute alike from the metadata (a decode batch's mask, the step's host lists)."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    @property
    def num_prefills(self) -> int:
        """Requests with more than one new token (prefill, chunked prefill, resumption)."""
        return self.num_reqs - self.num_decodes
