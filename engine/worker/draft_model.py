"""Speculative decoding with a draft model: a smaller model of the same vocabulary proposes each request's next k
tokens at the start of the step that verifies them.

The scheduler plans such a request's step as 1 + k tokens (its last known token and k placeholders,
``engine.speculative.proposer.TO_DRAFT``) and the KV manager gives it slots for all of them. Before the target's
forward pass, ``DraftModel.draft`` runs the draft over the same rows:

    pass 0      the tokens the draft has not seen yet (the whole prompt the first time, then the tokens accepted
                since, which end in the last known token): their K/V into the draft's cache, its argmax after
                the last one -> proposal 1
    pass j      proposal j at the position after -> proposal j + 1, for j < k (a row whose step has fewer
                proposal slots stops at its k)

and writes the proposals over the placeholders in the rows' tokens, which the verification reads. Each pass takes
the last one's proposals on the device; the host waits once, after the last pass. The draft's K/V live in its own
paged cache with as many blocks as the target's and the same block ids: a request's block table addresses both, so
the draft needs no allocator of its own, and the slots of the step's proposals (allocated for the
target's verification) hold the draft's K/V of its own proposals in passes 1 .. k - 1. A draft position is written
again when it is next fed (the tokens accepted after it), so what a rejected proposal left is never read. The
draft's proposals are its argmax: a point mass for the rejection sampling, so the output is distributed as the
target's own sampling (greedy: its greedy tokens) whatever the request's temperature.

Prefix-cache hits and preemption: the draft keeps, per request, how many of its tokens it has computed, from 0
when the request (re)joins the batch, so a block the target found in the prefix cache is filled by the draft too (the
same tokens at the same positions give the same K/V). With the host KV tier only the target's blocks travel: a
request swapped back in rejoins the batch, and the draft computes its tokens again.

Tensor parallelism: the draft runs unsharded on rank 0 (``draft_tensor_parallel_size`` 1, as vLLM's), built and run
as if this process were alone (``engine.distributed.single_rank``); its proposals reach the other ranks with the
step's input ids, which rank 0 broadcasts, and only rank 0's KV budget gives the draft's cache its share.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.config import ConfigError, EngineConfig
from engine.distributed import single_rank, tp_rank
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from engine.speculative.config import SpeculativeConfig
from engine.worker.input_batch import InputBatch
from kvcache.paged_cache import PagedKVCache

logger = logging.getLogger("minivllm")


class DraftModel:
    aux_layers: tuple[int, ...] = ()  # it reads no hidden states of the target (an EAGLE-3 head does)

    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device,
                 block_size: int, backend, load_format: str, seed: int):
        self.model_config = model_config
        self.kv_dtype = kv_dtype
        self.device = device
        self.block_size = block_size
        self.model = load_model(model_config, dtype, device, load_format, seed)
        for layer in self.model.attention_layers():
            layer.set_backend(backend)
        self.kv_cache: PagedKVCache | None = None
        self.computed: dict[str, int] = {}  # request id -> its tokens whose K/V the draft's cache holds
        self.num_passes = 0  # forward passes run (the engine's metrics may report them)

    @classmethod
    def from_config(cls, config: EngineConfig, target: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype,
                    device: torch.device, block_size: int, backend) -> DraftModel | None:
        """The draft model ``config.speculative_config`` names, or None where it names none."""
        spec = SpeculativeConfig.parse(config.speculative_config)
        if spec is None or spec.method != "draft_model":
            return None
        if tp_rank() > 0:  # rank 0 drafts, unsharded; the other ranks verify what it proposes
            return None
        draft = ModelConfig.from_pretrained(spec.model, config.trust_remote_code)
        if draft.vocab_size != target.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({draft.vocab_size} tokens, {spec.model}) is not the "
                              f"target's ({target.vocab_size}): a draft must share the target's tokenizer")
        if draft.mrope_section is not None:
            raise ConfigError(f"the draft model {spec.model} takes M-RoPE positions, which drafts do not get")
        logger.info("speculative decoding: draft model %s (%s, %d layers), %d proposals a step", spec.model,
                    draft.architecture, draft.num_hidden_layers, spec.num_speculative_tokens)
        with single_rank():
            return cls(draft, dtype, kv_dtype, device, block_size, backend, config.load_format, config.seed)

    def bytes_per_block(self) -> int:
        mc = self.model_config
        return PagedKVCache.bytes_per_block(mc.num_hidden_layers, self.block_size, mc.num_key_value_heads,
                                            mc.head_dim, self.kv_dtype)

    def init_kv_cache(self, num_blocks: int) -> None:
        mc = self.model_config
        self.kv_cache = PagedKVCache(mc.num_hidden_layers, num_blocks, self.block_size, mc.num_key_value_heads,
                                     mc.head_dim, self.kv_dtype, self.device)
        for i, layer in enumerate(self.model.attention_layers()):
            layer.bind_kv_cache(*self.kv_cache.layer(i), self.kv_cache.layer_scales(i))
        logger.info("draft model's KV cache: %s", self.kv_cache.describe())

    def forget(self, request_ids) -> None:
        """Requests that left the batch (finished, preempted) or (re)joined it: the draft starts them over."""
        for rid in request_ids:
            self.computed.pop(rid, None)

    @torch.inference_mode()
    def draft(self, batch: InputBatch, spec_token_ids: dict[str, list[int]]) -> None:
        """Write each request's proposals over its placeholders in ``batch.token_ids`` (after its known tokens)."""
        if not spec_token_ids:
            return
        with single_rank():
            self._draft(batch, spec_token_ids)

    def _draft(self, batch: InputBatch, spec_token_ids: dict[str, list[int]]) -> None:
        rids = list(spec_token_ids)
        rows = np.asarray([batch.row_of[rid] for rid in rids], dtype=np.int64)
        counts = np.asarray([len(spec_token_ids[rid]) for rid in rids], dtype=np.int64)
        ends = batch.num_tokens[rows].copy()  # the known tokens: the last one's K/V is not in either cache yet
        starts = np.asarray([min(self.computed.get(rid, 0), end - 1) for rid, end in zip(rids, ends)])
        tokens = np.concatenate([batch.token_ids[row, start:end] for row, start, end in zip(rows, starts, ends)])
        proposal = self._pass(batch, rows, starts, ends, torch.from_numpy(tokens).to(self.device))
        for rid, end in zip(rids, ends):
            self.computed[rid] = int(end)
        # Each pass feeds the last one's proposals on the device; the host waits once, for all of them.
        live = np.arange(len(rows))
        made = [(live, proposal)]
        for j in range(1, int(counts.max())):
            more = counts[live] > j
            live, proposal = live[more], proposal[torch.from_numpy(np.nonzero(more)[0]).to(self.device)]
            at = ends[live] + j - 1  # proposal j's position, whose output is proposal j + 1
            proposal = self._pass(batch, rows[live], at, at + 1, proposal)
            made.append((live, proposal))
        write_proposals(batch, rows, ends, made)

    def _pass(self, batch: InputBatch, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
              tokens: torch.Tensor) -> torch.Tensor:
        """One forward pass of the draft over tokens [start, end) of each row (``tokens`` concatenated, on the
        device); returns its argmax after each row's last token, on the device."""
        meta, positions = pass_metadata(batch, rows, starts, ends, self.block_size, self.device)
        hidden = self.model(tokens, positions, meta)
        last = torch.from_numpy(np.cumsum(ends - starts) - 1).to(self.device)
        logits = self.model.compute_logits(hidden[last])[:, : self.model_config.vocab_size]
        self.num_passes += 1
        return logits.argmax(dim=-1)


def write_proposals(batch: InputBatch, rows: np.ndarray, ends: np.ndarray,
                    made: list[tuple[np.ndarray, torch.Tensor]]) -> None:
    """Write chained passes' proposals after the rows' known tokens (``ends``): ``made[j]`` is (the indices into
    ``rows`` that pass j served, their proposals j + 1 on the device). One host sync reads them all."""
    tokens = torch.cat([proposal for _, proposal in made]).cpu().numpy()
    offset = 0
    for j, (live, _) in enumerate(made):
        batch.token_ids[rows[live], ends[live] + j] = tokens[offset : offset + len(live)]
        offset += len(live)


def pass_metadata(batch: InputBatch, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, block_size: int,
                  device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """A drafter's pass over positions [start, end) of each of ``rows`` (InputBatch rows), its K/V in its own cache
    at the rows' block ids: (the attention metadata, the positions [sum(end - start)] int64, on ``device``)."""
    lens = ends - starts
    positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])
    row_of_token = np.repeat(rows, lens)
    blocks = batch.block_table[row_of_token, positions // block_size].astype(np.int64)
    slots = blocks * block_size + positions % block_size
    qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    seq_lens = torch.from_numpy(ends.astype(np.int32))
    max_blocks = -(-int(ends.max()) // block_size)
    decodes = len(rows) if int(lens.max()) == 1 else 0
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots).to(device), query_start_loc=qsl.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=torch.from_numpy(np.ascontiguousarray(batch.block_table[rows, :max_blocks])).to(device),
        num_reqs=len(rows), num_decodes=decodes, num_decode_tokens=decodes, max_query_len=int(lens.max()),
        max_seq_len=int(ends.max()), block_size=block_size, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    return meta, torch.from_numpy(positions).to(device)
