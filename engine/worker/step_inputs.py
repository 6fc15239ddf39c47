"""One step's flat inputs, from the scheduler's plan and the runner's rows (``InputBatch``).

The step's rows are ordered decodes first, longest context first; their tokens are laid out flat::

    rows       r0 (decode)   r1 (decode)   r2 (chunk of 3)   [padding rows of a graph]
    tokens     t0            t1            t2 t3 t4           [padding tokens]
    positions  num_computed[row] + 0, 1, ...: each token's index in its request
    slots      block_table[row, pos // block] * block + pos % block
    logits     the last token of each row whose known tokens the step completes (it samples)

Everything is written with vector operations into the persistent host buffers (``StepBuffers``), which
``device_inputs`` copies to the device, on rank 0 and, from rank 0's message, on every other tensor-parallel
rank. Tokens whose id a step still in flight is sampling (async scheduling) are left as placeholders here and
written on the device (``ModelRunner``). Image placeholder tokens take their embeddings from the encoder cache,
and an M-RoPE model's three positions per token come from each request's table (engine/loading/mrope.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.lora.worker import LoRAWorker
from engine.outputs import SchedulerOutput
from engine.worker.cuda_graphs import DecodeGraphs, MixedGraphs
from engine.worker.graph_selection import select_step_shape
from engine.worker.input_batch import InputBatch
from engine.worker.prompt_logprobs import PromptLogprobsPlan, plan_prompt_logprobs
from engine.worker.step_buffers import StepBuffers, upload
from engine.worker.step_channel import StepShape


@dataclass(slots=True)
class StepInputs:
    """The flat tensors of one step, plus which rows get a sampled token."""

    shape: StepShape  # its sizes and the graph it replays (0: none)
    rows: np.ndarray  # [num_reqs] the InputBatch rows of its requests, in token order
    sampled_request_ids: list[str]  # requests that get a token, in logits order
    sampled_rows: np.ndarray  # [num_sampled] their InputBatch rows
    sampled_positions: np.ndarray  # [num_sampled] where each one's (first) sampled token goes in its sequence
    samples_leading_rows: bool  # a decode graph's step whose sampled rows are its first num_sampled, in order
    # Tokens whose id a step in flight is still sampling: their flat positions, and their requests.
    placeholder_tokens: np.ndarray
    placeholder_request_ids: list[str]
    prompt_logprobs: PromptLogprobsPlan | None
    # Image embeddings for some of the step's tokens: (their positions in the flat tokens [K] int64 on the
    # device, their embeddings [K, hidden]); None when the step has no image token.
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None
    # Speculative decoding: each sampled row's proposals verified this step [num_sampled]; None in a step with none.
    # The logits are then each sampled row's 1 + k last tokens', row after row.
    spec_counts: np.ndarray | None
    # On the device, once ``ModelRunner.device_inputs`` has copied the host buffers:
    input_ids: torch.Tensor | None = None  # [padded tokens] int64
    positions: torch.Tensor | None = None  # [padded tokens] int64; [3, padded tokens] for an M-RoPE model
    meta: AttentionMetadata | None = None
    logits_indices: torch.Tensor | None = None  # [num_logits] int64: the token (or graph row) of each sampled row


class StepInputPreparer:
    """Builds each step's inputs into the step buffers, and copies them to the device."""

    def __init__(self, batch: InputBatch, buffers: StepBuffers, block_size: int, device: torch.device,
                 encoder_cache: dict[str, torch.Tensor], lora: LoRAWorker | None = None):
        self.batch = batch
        self.lora = lora  # LoRA adapters: each token's slot (engine/lora/worker.py)
        self.buffers = buffers
        self.block_size = block_size
        self.device = device
        self.encoder_cache = encoder_cache  # encoded images by content hash (the runner fills it)
        self._inputs_copied: torch.cuda.Event | None = None  # the last step's input copies

    def prepare(self, sched: SchedulerOutput, decode_graphs: DecodeGraphs | None,
                mixed_graphs: MixedGraphs | None) -> StepInputs:
        """The step's inputs in the host buffers, and what the runner needs of them; ``device_inputs`` then
        copies the buffers to the device."""
        b = self.batch
        # With a step planned ahead, the previous step's copies may still be reading the pinned buffers.
        self.wait_for_input_copies()
        req_ids = list(sched.num_scheduled_tokens)
        rows, counts, seq_lens, order = self._decodes_first(sched, req_ids)
        num_reqs, num_tokens = len(rows), int(counts.sum())
        ends = np.cumsum(counts)  # [num_reqs]
        token_req = np.repeat(np.arange(num_reqs), counts)  # [num_tokens] batch index of each token
        positions = b.num_computed[rows][token_req] + np.arange(num_tokens) - (ends - counts)[token_req]
        token_rows = rows[token_req]
        # A request gets a token when this step computes the last of its known tokens (and its proposals).
        sampled = np.nonzero(seq_lens >= b.num_tokens[rows])[0]
        spec_counts = b.num_spec[rows[sampled]] if sched.spec_token_ids else None
        prompt_lp = None
        if (b.num_prompt_logprobs[rows] >= 0).any():
            prompt_lp = plan_prompt_logprobs(b, rows, token_req, token_rows, positions, req_ids, order, self.device)
        image_embeds = self._gather_image_embeds(rows, counts, ends) if b.mm_inputs else None
        max_seq_len = int(seq_lens.max())
        shape = select_step_shape(
            decode_graphs, mixed_graphs, prompt_lp is not None or image_embeds is not None, num_reqs,
            int(np.count_nonzero(counts == 1)), num_tokens, len(sampled), -(-max_seq_len // self.block_size),
            int(counts.max()), max_seq_len, int(len(sampled) + spec_counts.sum()) if spec_counts is not None else 0)
        self._fill_buffers(shape, rows, seq_lens, ends, positions, token_rows, sampled)
        if self.lora is not None:
            self.lora.prepare(b.lora, token_rows, shape.padded_tokens)
        if spec_counts is not None:  # verification: every proposal's logits too, each row's 1 + k last tokens
            verified = np.repeat(ends[sampled] - 1 - spec_counts, spec_counts + 1)
            verified += np.arange(len(verified)) - np.repeat(np.cumsum(spec_counts + 1) - spec_counts - 1,
                                                              spec_counts + 1)
            self.buffers.logits_indices.np[: len(verified)] = verified
            self.buffers.logits_indices.np[len(verified) : shape.num_logits] = 0  # a mixed graph's padding rows
        if self.buffers.mrope_positions is not None:  # M-RoPE: the model reads three positions per token
            self._fill_mrope_positions(rows, counts, ends, positions, token_rows, shape.padded_tokens)
        # ids a step in flight is sampling (proposals are known: written after the known tokens)
        unknown = np.nonzero(positions >= (b.num_tokens + b.num_spec)[token_rows])[0]
        return StepInputs(
            shape=shape,
            rows=rows,
            sampled_request_ids=[req_ids[order[i]] for i in sampled.tolist()],
            sampled_rows=rows[sampled],
            sampled_positions=seq_lens[sampled] - (spec_counts if spec_counts is not None else 0),
            samples_leading_rows=bool(shape.graph_size and len(sampled) and sampled[-1] == len(sampled) - 1),
            placeholder_tokens=unknown,
            placeholder_request_ids=[req_ids[order[token_req[t]]] for t in unknown.tolist()] if len(unknown) else [],
            prompt_logprobs=prompt_lp,
            image_embeds=image_embeds,
            spec_counts=spec_counts,
        )

    def wait_for_input_copies(self) -> None:
        """Wait until the last step's host-to-device input copies have read the pinned host buffers."""
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()

    def device_inputs(self, shape: StepShape):
        """The step's inputs on the device from the host buffers: (input ids, positions, attention metadata,
        logits indices). Rank 0 fills the buffers from its batch; the other ranks from rank 0's message."""
        buf, padded, padded_tokens, width = self.buffers, shape.padded, shape.padded_tokens, shape.width
        graph = shape.graph_size > 0 or shape.mixed_size > 0
        if shape.mixed_size:  # which rows are decodes, for the graph's attention (AttentionMetadata.decode_seq_lens)
            single = np.diff(buf.query_start_loc.np[: padded + 1]) == 1
            buf.decode_seq_lens.np[:padded] = np.where(single, buf.seq_lens.np[:padded], 0)
            buf.decode_seq_lens.copy_to_device(padded)
        seq_lens_cpu = buf.seq_lens.host[:padded].clone()
        qsl_cpu = buf.query_start_loc.host[: padded + 1].clone()
        meta = AttentionMetadata(
            slot_mapping=buf.slot_mapping.copy_to_device(padded_tokens),
            query_start_loc=buf.query_start_loc.copy_to_device(padded + 1),
            seq_lens=buf.seq_lens.copy_to_device(padded),
            block_tables=buf.block_tables.copy_to_device(padded, width) if graph
            else buf.block_tables.copy_to_device(padded, width)[:, :width],
            num_reqs=padded, num_decodes=padded if graph else shape.num_decodes,
            num_decode_tokens=padded if graph else shape.num_decodes,
            max_query_len=shape.max_query_len, max_seq_len=shape.max_seq_len, block_size=self.block_size,
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu,
        )
        input_ids = buf.input_ids.copy_to_device(padded_tokens)
        positions = buf.model_positions_to_device(padded_tokens)
        logits_indices = buf.logits_indices.copy_to_device(shape.num_logits)
        if self.lora is not None:
            self.lora.to_device(padded_tokens)
        if self.device.type == "cuda":
            self._inputs_copied = torch.cuda.Event()
            self._inputs_copied.record()
        return input_ids, positions, meta, logits_indices

    # ------------------------------------------------------------------ helpers

    def _decodes_first(self, sched: SchedulerOutput, req_ids: list[str]):
        """The step's rows, token counts and context lengths after the step, in batch order, and that order
        (``req_ids[order[i]]`` is batch index i's request). Decodes (one new token) come first, longest context
        first: the decode kernels start one program per row (and KV head) in row order, so the long contexts
        start first and the short ones fill the tail, and no program has to look its row up."""
        b = self.batch
        rows = np.fromiter((b.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        counts = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        seq_lens = b.num_computed[rows] + counts  # context length after this step
        order = np.lexsort((-seq_lens, counts > 1))
        return rows[order], counts[order], seq_lens[order], order

    def _fill_buffers(self, shape: StepShape, rows: np.ndarray, seq_lens: np.ndarray, ends: np.ndarray,
                      positions: np.ndarray, token_rows: np.ndarray, sampled: np.ndarray) -> None:
        """Write the step's tokens, positions, slots, lengths, block tables and logits rows into the host buffers,
        and the padding of the graph it replays."""
        b, buf, bs = self.batch, self.buffers, self.block_size
        num_reqs, num_tokens, padded, width = shape.num_reqs, len(positions), shape.padded, shape.width
        buf.input_ids.np[:num_tokens] = b.token_ids[token_rows, positions]
        buf.positions.np[:num_tokens] = positions
        buf.slot_mapping.np[:num_tokens] = b.block_table[token_rows, positions // bs] * bs + positions % bs
        buf.seq_lens.np[:num_reqs] = seq_lens
        buf.query_start_loc.np[0] = 0
        buf.query_start_loc.np[1 : num_reqs + 1] = ends
        buf.block_tables.np[:num_reqs, :width] = b.block_table[rows, :width]
        buf.logits_indices.np[: len(sampled)] = sampled if shape.graph_size else ends[sampled] - 1
        if shape.graph_size:
            # Padding rows: length 0, slot 0 of the null block, token 0.
            for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
                getattr(buf, name).np[num_reqs:padded] = 0
            buf.query_start_loc.np[num_reqs + 1 : padded + 1] = ends[-1]
        if shape.mixed_size:
            # Padding tokens: token 0 at position 0, slot 0 of the null block; padding requests: no tokens, length 0;
            # logits rows past the sampled ones: token 0's.
            for name in ("input_ids", "positions", "slot_mapping"):
                getattr(buf, name).np[num_tokens : shape.padded_tokens] = 0
            buf.seq_lens.np[num_reqs:padded] = 0
            buf.query_start_loc.np[num_reqs + 1 : padded + 1] = num_tokens
            buf.logits_indices.np[len(sampled) : padded] = 0

    def _gather_image_embeds(self, rows: np.ndarray, counts: np.ndarray, ends: np.ndarray):
        """(flat token positions, embeddings) of the step's image placeholder tokens, from the encoder cache;
        None when it has none. A request whose prefill passes its last image leaves ``batch.mm_inputs``."""
        b = self.batch
        positions, pieces, done = [], [], []
        for rid, images, lo, hi, first in self._step_chunks(b.mm_inputs, rows, counts, ends):
            for mm in images:
                if mm.offset >= hi:
                    break
                start, end = max(lo, mm.offset), min(hi, mm.end)
                if start >= end:
                    continue
                embeds = self.encoder_cache.get(mm.content_hash)
                if embeds is None:
                    raise RuntimeError(f"request {rid}: image {mm.content_hash} is not in the encoder cache")
                pieces.append(embeds[start - mm.offset : end - mm.offset])
                positions.append(np.arange(first + start - lo, first + end - lo, dtype=np.int64))
            if hi >= images[-1].end:
                done.append(rid)
        for rid in done:
            del b.mm_inputs[rid]
        if not pieces:
            return None
        return upload(np.concatenate(positions), self.device), torch.cat(pieces)

    def _step_chunks(self, by_request: dict, rows: np.ndarray, counts: np.ndarray, ends: np.ndarray):
        """(request id, its entry, lo, hi, first) for each request of ``by_request`` that this step runs: its chunk
        is its tokens ``lo..hi-1``, at the step's flat positions from ``first`` on."""
        b = self.batch
        batch_index = {row: i for i, row in enumerate(rows.tolist())}
        for rid, entry in by_request.items():
            i = batch_index.get(b.row_of[rid])
            if i is not None:
                lo = int(b.num_computed[rows[i]])
                yield rid, entry, lo, lo + int(counts[i]), int(ends[i] - counts[i])

    def _fill_mrope_positions(self, rows: np.ndarray, counts: np.ndarray, ends: np.ndarray, positions: np.ndarray,
                              token_rows: np.ndarray, padded_tokens: int) -> None:
        """The step's [3, tokens] M-RoPE positions: each token's index plus its request's delta in all three rows,
        then, for the requests whose chunk reaches into the positions before the end of their last image, those
        from their table. A request whose prefill passes its last image leaves ``batch.mrope_tables``."""
        b = self.batch
        out = self.buffers.mrope_positions.np
        num_tokens = len(positions)
        out[:, :num_tokens] = positions + b.mrope_delta[token_rows]
        out[:, num_tokens:padded_tokens] = 0  # a decode graph's padding rows
        if not b.mrope_tables:
            return
        done = []
        for rid, table, lo, hi, first in self._step_chunks(b.mrope_tables, rows, counts, ends):
            end = min(hi, table.shape[1])
            if lo < end:
                out[:, first : first + end - lo] = table[:, lo:end]
            if hi >= table.shape[1]:
                done.append(rid)
        for rid in done:
            del b.mrope_tables[rid]
