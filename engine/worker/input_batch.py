"""The model runner's persistent per-request state, in preallocated host arrays.

Each live request owns one row. A step's inputs are then built with a handful of
vectorised numpy gathers over the scheduled rows, instead of per-token Python work::

    row r:  token_ids[r, :num_tokens[r]]      prompt + generated tokens
            block_table[r, :num_blocks[r]]    its KV blocks, in order
            num_computed[r]                   tokens whose KV is in the pool
            temperature[r], top_p[r], ...     sampling parameters

    mm_inputs[request id]                     the images of a request whose prefill has not passed them all
    mrope_delta[r], mrope_tables[request id]  M-RoPE models: the position delta of every token past the
                                              last image, and the [3, n] positions up to it (engine/loading/mrope.py)
                                              of a request whose prefill has not passed it
    lora[r]                                   the LoRA adapter a row runs under (rows without one: none)
"""

from __future__ import annotations

import numpy as np
import torch

from engine.lora.request import LoRARequest
from engine.outputs import CachedRequestData, NewRequestData
from engine.sampling_params import PoolingParams


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int, device: torch.device
    ):
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        # Speculative decoding: proposed tokens written after a row's known ones for this step (token_ids past
        # num_tokens), which its sampling verifies.
        self.num_spec = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Sampling parameters, one entry per row.
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: none
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: none
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Rows still under min_tokens: the token ids (EOS, stop tokens) they may not sample yet.
        self.banned_until_min: dict[int, list[int]] = {}
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> (token ids int64, biases float32)
        self.allowed: dict[int, np.ndarray] = {}  # row -> the token ids it may sample (int64)
        # row -> the tokens whose logprobs replace its top-N (int64, in the request's order): logprob_token_ids
        self.logprob_token_ids: dict[int, np.ndarray] = {}
        self.generators: dict[int, tuple[torch.Generator, int]] = {}  # row -> (a generator, its request's seed)
        self.pooling: dict[int, PoolingParams] = {}  # row -> how a pooling request's output is made
        self.lora: dict[int, LoRARequest] = {}  # row -> its LoRA adapter (engine/lora), if any
        # Requests with images still ahead of their prefill: their ImageInputs (engine/loading/multimodal.py), by offset.
        self.mm_inputs: dict[str, list] = {}
        self.mrope_delta = np.zeros(max_num_reqs, dtype=np.int64)  # 0 for a prompt without images
        self.mrope_tables: dict[str, np.ndarray] = {}
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, data: NewRequestData, eos_token_ids: frozenset[int] = frozenset()) -> None:
        if data.request_id in self.row_of:
            self.remove(data.request_id)
        row = self._free_rows.pop()
        self.row_of[data.request_id] = row
        n = len(data.token_ids)
        self.token_ids[row, :n] = data.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = data.num_prompt_tokens
        self.num_computed[row] = data.num_computed_tokens
        self.num_blocks[row] = 0
        self._append_blocks(row, data.block_ids)
        if data.mm_inputs and data.num_computed_tokens < data.mm_inputs[-1].end:
            self.mm_inputs[data.request_id] = data.mm_inputs
        self.mrope_delta[row] = data.mrope.delta if data.mrope is not None else 0
        if data.mrope is not None and data.num_computed_tokens < data.mrope.end:
            self.mrope_tables[data.request_id] = data.mrope.table
        p = data.sampling_params
        if p.lora_request is not None:
            self.lora[row] = p.lora_request
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k
        self.min_p[row] = p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        self.num_logprobs[row] = self._num_logprobs(p.logprobs)
        self.num_prompt_logprobs[row] = self._num_logprobs(data.prompt_logprobs)
        self.min_tokens[row] = p.min_tokens
        if p.min_tokens > 0:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            self.banned_until_min[row] = sorted(t for t in banned if 0 <= t < self.vocab_size)
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias))
            self.logit_bias[row] = (ids, np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(ids)))
        else:
            self.logit_bias.pop(row, None)
        if p.allowed_token_ids:
            self.allowed[row] = np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64))
        else:
            self.allowed.pop(row, None)
        if p.logprob_token_ids:
            self.logprob_token_ids[row] = np.asarray(p.logprob_token_ids, dtype=np.int64)
        else:
            self.logprob_token_ids.pop(row, None)
        if p.pooling is not None:
            self.pooling[row] = p.pooling
        else:
            self.pooling.pop(row, None)
        if p.seed is not None and not p.greedy:  # its noise at each position is drawn from (seed, position) alone
            self.generators[row] = (torch.Generator(device=self.device), p.seed)

    def _num_logprobs(self, asked: int | None) -> int:
        """How many top logprobs a row computes: -1 for none; a request's -1 (or more than there are) is the
        whole vocabulary."""
        if asked is None:
            return -1
        return self.vocab_size if asked == -1 else min(asked, self.vocab_size)

    def update(self, data: CachedRequestData) -> None:
        row = self.row_of[data.request_id]
        self.num_computed[row] = data.num_computed_tokens
        self.num_blocks[row] -= data.num_trimmed_blocks
        self._append_blocks(row, data.new_block_ids)

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        self.mm_inputs.pop(request_id, None)
        self.mrope_tables.pop(request_id, None)
        self.generators.pop(row, None)
        self.banned_until_min.pop(row, None)
        self.logit_bias.pop(row, None)
        self.allowed.pop(row, None)
        self.logprob_token_ids.pop(row, None)
        self.pooling.pop(row, None)
        self.lora.pop(row, None)
        self._free_rows.append(row)

    def set_proposals(self, spec_token_ids: dict[str, list[int]]) -> None:
        """This step's proposed tokens, after each row's known ones (none for the other rows)."""
        if not spec_token_ids and not self.num_spec.any():
            return
        self.num_spec[:] = 0
        for rid, spec in spec_token_ids.items():
            row = self.row_of[rid]
            start = self.num_tokens[row]
            self.token_ids[row, start : start + len(spec)] = spec
            self.num_spec[row] = len(spec)

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = self.num_blocks[row]
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)
