"""The per-step messages from tensor-parallel rank 0 to the other ranks.

A step is one fixed-size header of integers (``StepShape`` and two counts) and one integer payload with the host
buffers' rows in use, both broadcast over a gloo group; no Python object is pickled per step.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engine import distributed

logger = logging.getLogger("minivllm")


@dataclass(frozen=True)
class StepShape:
    """The sizes of one step's inputs: all a tensor-parallel follower needs, with the buffers' contents, to
    run the same forward pass (engine/worker/ranks.py sends it as integers)."""

    num_reqs: int
    num_decodes: int
    padded: int  # rows, with a graph's padding
    padded_tokens: int
    width: int  # block-table columns read
    graph_size: int  # the decode graph replayed; 0: none
    mixed_size: int  # the mixed-step graph replayed (its token count); 0: none (with no decode graph: eager)
    max_query_len: int
    max_seq_len: int
    num_logits: int  # logits_indices' rows the step reads: the sampled ones; a mixed-step graph's padded rows
    num_sampled: int  # the rows sampled (a mixed-step graph's LM head takes its first this-many rows)



@dataclass(frozen=True)
class BlockCopies:
    """A step's block copies, made before its forward pass: forked beams' partial blocks (source, destination), and
    the host tier's loads (host block, device block) and saves (device block, host block)."""

    forks: list[tuple[int, int]]
    loads: list[tuple[int, int]]
    saves: list[tuple[int, int]]


_STEP, _STOP = 1, 2
_HEADER_LEN = 20
# The header's message kind, then the counts: prompt-logprob indices, forks, loads, saves, LoRA token slots and the
# words of the LoRA adapters loaded this step.
_COUNTS = 7


class StepChannel:
    """The per-step messages from rank 0 to the others."""

    def __init__(self):
        self.group = distributed.control_group()
        self._header = torch.zeros(_HEADER_LEN, dtype=torch.int64)

    # rank 0 ------------------------------------------------------------------------------------------

    def send(self, shape, buf, prompt_lp_indices: np.ndarray | None, copies: BlockCopies, lora=None) -> None:
        """One step to the other ranks; ``lora`` (a ``LoRAWorker``): its token slots and adapter loads too."""
        header = np.zeros(_HEADER_LEN, dtype=np.int64)
        fields = [getattr(shape, f.name) for f in dataclasses.fields(StepShape)]
        num_lp = 0 if prompt_lp_indices is None else len(prompt_lp_indices)
        lora_loads = _encode_loads(lora.loads) if lora is not None else np.zeros(0, dtype=np.int64)
        header[: _COUNTS + len(fields)] = [_STEP, num_lp, len(copies.forks), len(copies.loads), len(copies.saves),
                                           shape.padded_tokens if lora is not None else 0, len(lora_loads), *fields]
        parts = [buf.positions.np[: shape.padded_tokens], buf.slot_mapping.np[: shape.padded_tokens],
                 buf.seq_lens.np[: shape.padded], buf.query_start_loc.np[: shape.padded + 1],
                 buf.block_tables.np[: shape.padded, : shape.width].reshape(-1),
                 buf.logits_indices.np[: shape.num_logits]]
        if num_lp:
            parts.append(prompt_lp_indices)
        for pairs in (copies.forks, copies.loads, copies.saves):
            if pairs:
                parts.append(np.asarray(pairs, dtype=np.int64).reshape(-1))
        if lora is not None:
            parts += [lora.token_slots.np[: shape.padded_tokens], lora_loads]
        payload = torch.from_numpy(np.concatenate([p.astype(np.int64, copy=False) for p in parts]))
        dist.broadcast(torch.from_numpy(header), src=0, group=self.group)
        dist.broadcast(payload, src=0, group=self.group)

    def stop(self, timeout_s: float) -> bool:
        """Tell the other ranks to stop. False when they did not all take the message within ``timeout_s``:
        a rank that died, or one stuck in a step's collective (gloo delivers only to a waiting receiver)."""
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        header[0] = _STOP
        try:
            work = dist.broadcast(header, src=0, group=self.group, async_op=True)
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - the caller terminates the ranks instead
            logger.warning("tensor parallel: the ranks did not take the stop message (%s)", exc)
            return False
        return True

    # the other ranks ---------------------------------------------------------------------------------

    def recv(self, buf, lora=None):
        """The next step into ``buf``'s host side: (StepShape, prompt-logprob token indices, BlockCopies), or None
        when rank 0 stops. ``lora`` (a ``LoRAWorker``) takes the step's adapter loads and token slots."""
        dist.broadcast(self._header, src=0, group=self.group)
        header = self._header.tolist()
        if header[0] == _STOP:
            return None
        num_lp, num_forks, num_loads, num_saves, num_lora_slots, num_lora_words = header[1:_COUNTS]
        n = len(dataclasses.fields(StepShape))
        shape = StepShape(*header[_COUNTS : _COUNTS + n])
        sizes = [shape.padded_tokens, shape.padded_tokens, shape.padded, shape.padded + 1,
                 shape.padded * shape.width, shape.num_logits, num_lp, 2 * num_forks, 2 * num_loads, 2 * num_saves,
                 num_lora_slots, num_lora_words]
        payload = torch.empty(sum(sizes), dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self.group)
        values = np.split(payload.numpy(), np.cumsum(sizes)[:-1])
        buf.positions.np[: shape.padded_tokens] = values[0]
        buf.slot_mapping.np[: shape.padded_tokens] = values[1]
        buf.seq_lens.np[: shape.padded] = values[2]
        buf.query_start_loc.np[: shape.padded + 1] = values[3]
        buf.block_tables.np[: shape.padded, : shape.width] = values[4].reshape(shape.padded, shape.width)
        buf.logits_indices.np[: shape.num_logits] = values[5]
        forks, loads, saves = ([tuple(pair) for pair in v.reshape(-1, 2).tolist()] for v in values[7:10])
        if lora is not None:
            lora.receive(values[10], _decode_loads(values[11]))
        return shape, values[6], BlockCopies(forks, loads, saves)


def _encode_loads(loads: list) -> np.ndarray:
    """LoRA adapter loads, [(slot, LoRARequest)], as int64 words: per load its slot, its id, and the length in bytes
    and the UTF-8 bytes (zero-padded to whole words) of its name and path as JSON."""
    words = []
    for slot, request in loads:
        text = json.dumps([request.lora_name, request.lora_path]).encode()
        padded = text + b"\0" * (-len(text) % 8)
        words += [np.array([slot, request.lora_int_id, len(text)], dtype=np.int64), np.frombuffer(padded, np.int64)]
    return np.concatenate(words) if words else np.zeros(0, dtype=np.int64)


def _decode_loads(words: np.ndarray) -> list:
    from engine.lora.request import LoRARequest

    loads, i = [], 0
    while i < len(words):
        slot, adapter, length = (int(v) for v in words[i : i + 3])
        num_words = -(-length // 8)
        name, path = json.loads(words[i + 3 : i + 3 + num_words].tobytes()[:length])
        loads.append((slot, LoRARequest(name, adapter, path)))
        i += 3 + num_words
    return loads
