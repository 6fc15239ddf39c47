"""Speculative decoding with an EAGLE-3 head (``speculative_config={"method": "eagle3", "model": <head>}``): a one-layer
head reads the target's hidden states and proposes each request's next k tokens at the start of the step that
verifies them, over the ``TO_DRAFT`` placeholders, as a draft model does (``engine.worker.draft_model``).

The target's side: with a head loaded every step runs eagerly (CUDA graphs end at the final hidden states; the head
needs more) and also gives its aux states, the residual stream entering the head's aux layers, [tokens, n * hidden]
(``run_target``). The runner keeps them per request on the device until the head has consumed them::

    pending[rid]   start: the first position the head has not consumed; chunks: the states of positions start,
                   start + 1, ... in order (views of the steps' outputs)

The head consumes position t (the embedding of token t + 1 with the target's state at t) once token t + 1 is known.
At the start of each step (``draft``) it catches up on every request's positions start .. n - 2 (n: its known
tokens) in one batched pass; a drafting request's output at n - 2 predicts token n, proposal 1. Proposal j + 1
chains on proposal j and the head's own prenorm row at the position before: pass j runs at position n - 2 + j,
whose slot the verification allocated. The proposals are the head's argmax (a point mass for the rejection sampling,
as a draft model's), mapped to target ids by ``d2t``; one host sync reads them all.

A step that computes a request's tokens from position p replaces what ``pending`` holds from p on: the states of a
verification's rejected proposals are dropped when the next step's arrive, never consumed. The head's K/V of its
chained positions are written again when the head consumes those positions. It catches up every step, drafting or
not, so that ``pending`` holds about a step's tokens (a request that never speculates would keep all of its own).

Prefix-cache hits, preemption and the host KV tier: a request that (re)joins the batch starts over at the first
position the target computes. The head's K/V of earlier positions are what its cache holds in those blocks: the
head of the request that filled them wrote them if it consumed them; stale ones only cost acceptance, never an
output token.

Tensor parallelism: the head runs unsharded on rank 0 (``engine.distributed.single_rank``), as a draft model does.
The aux states it reads are whole on every rank (each block's product is all-reduced into the residual stream), so
only rank 0 keeps them; its proposals reach the other ranks with the step's input ids. A head without embeddings of
its own embeds with the target's, which the ranks gather once at start-up into a whole copy on rank 0. Every rank
runs the target eagerly (no CUDA graphs: ``reads_target_states``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.config import ConfigError, EngineConfig
from engine.distributed import all_gather_last_dim, single_rank, tp_rank, tp_size
from engine.loading.eagle3 import Eagle3Checkpoint
from engine.models.llama import LlamaForCausalLM
from engine.models.llama_eagle3 import LlamaEagle3Head
from engine.speculative.config import SpeculativeConfig
from engine.worker.draft_model import pass_metadata, write_proposals
from engine.worker.input_batch import InputBatch
from kvcache.paged_cache import PagedKVCache

logger = logging.getLogger("minivllm")


class PendingStates:
    """One request's target states the head has not consumed: positions ``start`` .. ``start + size - 1``."""

    __slots__ = ("start", "chunks", "size")

    def __init__(self, start: int, states: torch.Tensor):
        self.start, self.chunks, self.size = start, [states], len(states)

    def add(self, position: int, states: torch.Tensor) -> None:
        """A step's states from ``position`` on, which replace those held from there."""
        keep = position - self.start
        if not 0 <= keep <= self.size:  # a gap, or consumed positions computed again: the head starts there
            self.start, self.chunks, self.size = position, [states], len(states)
            return
        chunks, left = [], keep
        for chunk in self.chunks:
            if left <= 0:
                break
            chunks.append(chunk[:left])
            left -= len(chunk)
        self.chunks, self.size = [*chunks, states], keep + len(states)

    def take(self, end: int) -> list[torch.Tensor]:
        """The states of positions ``start`` .. ``end - 1`` (as many as are held), which the head consumes."""
        n = min(end - self.start, self.size)
        if n <= 0:
            return []
        taken, rest, left = [], [], n
        for chunk in self.chunks:
            if left >= len(chunk):
                taken.append(chunk)
            elif left > 0:
                taken.append(chunk[:left])
                rest.append(chunk[left:])
            else:
                rest.append(chunk)
            left -= len(chunk)
        self.start, self.size, self.chunks = self.start + n, self.size - n, rest
        return taken


class Eagle3Drafter:
    def __init__(self, head: LlamaEagle3Head, embed_tokens: torch.nn.Module, aux_layers: tuple[int, ...],
                 kv_dtype: torch.dtype, device: torch.device, block_size: int, backend):
        self.head = head
        self.embed_tokens = embed_tokens  # the head's own embeddings, or the target's
        self.aux_layers = aux_layers  # the target layers whose input the head reads, ascending
        self.kv_dtype, self.device, self.block_size = kv_dtype, device, block_size
        for layer in head.attention_layers():
            layer.set_backend(backend)
        self.kv_cache: PagedKVCache | None = None
        self.pending: dict[str, PendingStates] = {}  # by request id
        self.num_passes = 0  # forward passes of the head
        self.num_blind_drafts = 0  # drafts without the head's states to draft from (the last token repeated)

    @classmethod
    def from_config(cls, config: EngineConfig, target: torch.nn.Module, dtype: torch.dtype, kv_dtype: torch.dtype,
                    device: torch.device, block_size: int, backend) -> Eagle3Drafter | None:
        """The EAGLE-3 head ``config.speculative_config`` names for ``target``, or None where it names none;
        ConfigError for a head or a target that cannot serve."""
        spec = SpeculativeConfig.parse(config.speculative_config)
        if spec is None or spec.method != "eagle3":
            return None
        if not isinstance(target, LlamaForCausalLM) or target.config.multimodal is not None:
            raise ConfigError(f"an EAGLE-3 head needs a Llama-family text model as its target (Llama, Mistral, "
                              f"Qwen2, Qwen3 and their MoE); {type(target).__name__} is not one")
        target_config = target.config
        try:
            checkpoint = Eagle3Checkpoint.read(spec.model)
            check_head_fits(checkpoint, target_config.hidden_size, target_config.vocab_size)
            aux_layers = aux_layer_ids(checkpoint, target_config.num_hidden_layers)
            max_position = max(checkpoint.layer.max_position_embeddings, target_config.max_position_embeddings)
            head = None
            if tp_rank() == 0:  # rank 0 alone runs the head, whole
                with single_rank():
                    head = checkpoint.load(len(aux_layers), target_config.vocab_size, dtype, device, max_position)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"speculative_config: the EAGLE-3 head {spec.model}: {exc}") from None
        # Every rank takes part in gathering the target's embeddings for it.
        embed = None if checkpoint.own_embeddings else whole_embedding(target.model.embed_tokens)
        if head is None:
            return None
        logger.info("speculative decoding: EAGLE-3 head %s (draft vocabulary %d, target layers %s), %d proposals a "
                    "step; the target runs eagerly (no CUDA graphs)", spec.model, checkpoint.draft_vocab_size,
                    list(aux_layers), spec.num_speculative_tokens)
        return cls(head, head.embed_tokens if embed is None else embed, aux_layers, kv_dtype, device, block_size,
                   backend)

    def bytes_per_block(self) -> int:
        mc = self.head.config
        return PagedKVCache.bytes_per_block(1, self.block_size, mc.num_key_value_heads, mc.head_dim, self.kv_dtype)

    def init_kv_cache(self, num_blocks: int) -> None:
        mc = self.head.config
        self.kv_cache = PagedKVCache(1, num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim,
                                     self.kv_dtype, self.device)
        self.head.attention_layers()[0].bind_kv_cache(*self.kv_cache.layer(0), self.kv_cache.layer_scales(0))
        logger.info("EAGLE-3 head's KV cache: %s", self.kv_cache.describe())

    def forget(self, request_ids) -> None:
        """Requests that left the batch (finished, preempted) or (re)joined it: their states go."""
        for rid in request_ids:
            self.pending.pop(rid, None)

    def run_target(self, model: torch.nn.Module, inputs, batch: InputBatch) -> torch.Tensor:
        """The target's eager forward pass of a step (``StepInputs``); keeps each request's aux states. Returns the
        final hidden states, as the model's forward does."""
        hidden, aux = model(inputs.input_ids, inputs.positions, inputs.meta, aux_layers=self.aux_layers)
        qsl = inputs.meta.query_start_loc_cpu.tolist()
        request_of = {row: rid for rid, row in batch.row_of.items()}
        for i, row in enumerate(inputs.rows.tolist()):
            rid, position, states = request_of[row], int(batch.num_computed[row]), aux[qsl[i] : qsl[i + 1]]
            if rid in self.pending:
                self.pending[rid].add(position, states)
            else:
                self.pending[rid] = PendingStates(position, states)
        return hidden

    @torch.inference_mode()
    def draft(self, batch: InputBatch, spec_token_ids: dict[str, list[int]]) -> None:
        """Catch the head up on every request's known tokens; write each drafting request's proposals over its
        placeholders in ``batch.token_ids`` (after its known tokens)."""
        with single_rank():  # (the head is whole, beside a sharded target)
            self._draft(batch, spec_token_ids)

    def _draft(self, batch: InputBatch, spec_token_ids: dict[str, list[int]]) -> None:
        normed, prenorm, last = self._catch_up(batch)
        drafting = [rid for rid in spec_token_ids if rid in last]
        for rid in spec_token_ids:
            if rid not in last:  # no states to draft from: the request's last token (verification rejects it)
                row = batch.row_of[rid]
                n = int(batch.num_tokens[row])
                batch.token_ids[row, n : n + len(spec_token_ids[rid])] = batch.token_ids[row, n - 1]
                self.num_blind_drafts += 1
        if drafting:
            at = torch.tensor([last[rid] for rid in drafting], device=self.device)
            self._chain(batch, drafting, [len(spec_token_ids[rid]) for rid in drafting], normed[at], prenorm[at])

    def _catch_up(self, batch: InputBatch) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, int]]:
        """One pass over every request's consumable positions: (normed, prenorm) [tokens, hidden] of the pass, and
        the row of the output at position n - 2 of each request that has one (the head then has every known token
        of it)."""
        rids, spans, pieces = [], [], []  # spans: (row, first position, positions taken)
        for rid, pending in self.pending.items():
            row = batch.row_of[rid]
            start, taken = pending.start, pending.take(int(batch.num_tokens[row]) - 1)
            if taken:
                rids.append(rid)
                spans.append((row, start, sum(map(len, taken))))
                pieces += taken
        if not rids:
            return None, None, {}
        rows, starts, counts = (np.asarray(column, dtype=np.int64) for column in zip(*spans))
        ends = starts + counts
        hidden = self.head.combine(torch.cat(pieces))  # [tokens, hidden]
        meta, positions = pass_metadata(batch, rows, starts, ends, self.block_size, self.device)
        tokens = np.concatenate([batch.token_ids[row, start + 1 : end + 1] for row, start, end in
                                 zip(rows, starts, ends)])
        normed, prenorm = self.head(self.embed_tokens(torch.from_numpy(tokens).to(self.device)), hidden, positions,
                                    meta)
        self.num_passes += 1
        last = {rid: i for rid, row, end, i in zip(rids, rows, ends, (np.cumsum(counts) - 1).tolist())
                if end == batch.num_tokens[row] - 1}
        return normed, prenorm, last

    def _chain(self, batch: InputBatch, rids: list[str], counts: list[int], normed: torch.Tensor,
               prenorm: torch.Tensor) -> None:
        """Proposal 1 from the rows' outputs at n - 2, then each next one from the last and the head's prenorm row;
        all written to the rows' tokens after one host sync."""
        rows = np.asarray([batch.row_of[rid] for rid in rids], dtype=np.int64)
        counts, ends = np.asarray(counts), batch.num_tokens[rows].copy()
        proposal, hidden, live = self.head.propose(normed), prenorm, np.arange(len(rows))
        made = [(live, proposal)]
        for j in range(1, int(counts.max())):
            more = counts[live] > j
            keep = torch.from_numpy(np.nonzero(more)[0]).to(self.device)
            live, proposal, hidden = live[more], proposal[keep], hidden[keep]
            at = ends[live] - 2 + j  # the position of proposal j, whose output predicts proposal j + 1
            meta, positions = pass_metadata(batch, rows[live], at, at + 1, self.block_size, self.device)
            normed, hidden = self.head(self.embed_tokens(proposal), hidden, positions, meta)
            proposal = self.head.propose(normed)
            self.num_passes += 1
            made.append((live, proposal))
        write_proposals(batch, rows, ends, made)  # the drafts' one host sync


def reads_target_states(config: EngineConfig) -> bool:
    """Whether ``config`` speculates with an EAGLE-3 head, whose target steps run eagerly on every rank (they give
    the head the target's states, which no CUDA graph keeps)."""
    spec = SpeculativeConfig.parse(config.speculative_config)
    return spec is not None and spec.method == "eagle3"


def whole_embedding(embed_tokens: torch.nn.Module) -> torch.nn.Module:
    """The target's embeddings as one module: itself on one rank; with several, every rank's rows gathered (a
    collective: every rank calls it), an unsharded copy for the head to embed with on rank 0."""
    if tp_size() == 1:
        return embed_tokens
    weight = all_gather_last_dim(embed_tokens.weight.detach().t()).t().contiguous()  # [vocab, hidden], rank order
    return torch.nn.Embedding.from_pretrained(weight, freeze=True) if tp_rank() == 0 else embed_tokens


def aux_layer_ids(checkpoint: Eagle3Checkpoint, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose input the head reads, ascending (the order fc reads them in); ValueError where they
    are not distinct layers of the target, or fc reads another number of states."""
    layers = num_target_layers
    ids = tuple(sorted(checkpoint.aux_layer_ids or (2, layers // 2, layers - 3)))
    if len(set(ids)) != len(ids) or ids[0] < 0 or ids[-1] >= layers:
        default = "" if checkpoint.aux_layer_ids else " (the default 2, L // 2, L - 3: a target of 7 layers or more)"
        raise ValueError(f"its aux layers {list(ids)}{default} are not distinct layers of the target's {layers}")
    if len(ids) * checkpoint.target_hidden_size != checkpoint.fc_inputs:
        raise ValueError(f"its fc reads {checkpoint.fc_inputs} inputs, not {len(ids)} target states of "
                         f"{checkpoint.target_hidden_size}")
    return ids


def check_head_fits(checkpoint: Eagle3Checkpoint, hidden_size: int, vocab_size: int) -> None:
    """ValueError where the head cannot read a target of this hidden size and vocabulary."""
    if checkpoint.target_hidden_size != hidden_size:
        raise ValueError(f"it reads target states of {checkpoint.target_hidden_size}, the target's hidden size is "
                         f"{hidden_size}")
    if checkpoint.layer.vocab_size != vocab_size:
        raise ValueError(f"its vocabulary ({checkpoint.layer.vocab_size} tokens) is not the target's ({vocab_size})")
    if not checkpoint.own_embeddings and checkpoint.layer.hidden_size != hidden_size:
        raise ValueError(f"its hidden size ({checkpoint.layer.hidden_size}) is not the target's ({hidden_size}) "
                         "and it has no embed_tokens of its own")
    if not checkpoint.has_d2t and checkpoint.draft_vocab_size != vocab_size:
        raise ValueError(f"its draft vocabulary ({checkpoint.draft_vocab_size}) is not the target's and it has no "
                         "d2t to map it")
