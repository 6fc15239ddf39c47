"""The model runner's side of LoRA: the adapters' device slots and host cache, and each step's token-to-slot map.

    host cache   up to ``max_cpu_loras`` adapters read from disk (``load_adapter``), least recently used out first
    slots        ``max_loras`` adapters on the device, in every linear layer's stacked A and B (``LoRALayer``)
    mapping      each token's slot for the step (``LoRAMapping``), which the layers read

Rank 0 plans each step: the adapters of the step's rows get slots, an adapter not resident takes the slot that
was used least recently and that this step does not read (the scheduler never runs more adapters at once than
there are slots), and its tensors are copied in, queued on the stream behind the steps that may still read the
slot's old adapter. The other tensor-parallel ranks get the same loads and the per-token slots with the step
(``StepChannel``) and copy their shares of the same adapters into the same slots.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from engine.lora.adapter import load_adapter
from engine.lora.layers import LoRALayer, LoRAMapping, attach_lora
from engine.lora.request import LoRARequest
from engine.ops.lora_reference import segments
from engine.worker.step_buffers import HostDeviceBuffer

logger = logging.getLogger("minivllm")


class LoRAWorker:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 max_tokens: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.token_slots = HostDeviceBuffer((max_tokens,), torch.int32, device)
        self.token_order = HostDeviceBuffer((max_tokens,), torch.int32, device)
        self.slot_starts = HostDeviceBuffer((max_loras + 1,), torch.int32, device)
        self.mapping = LoRAMapping(self.token_slots.device, self.token_order.device, self.slot_starts.device)
        self.layers: dict[str, LoRALayer] = attach_lora(model, self.mapping, max_loras, max_rank, dtype, device)
        self._distinct = list({id(e.layer): e for e in self.layers.values()}.values())  # a fused layer once
        self.slot_adapter = [0] * max_loras  # the adapter id in each slot; 0: none
        self.slot_used = [0] * max_loras  # the step that last read each slot
        self.num_steps = 0
        # By adapter id, least recently used first: module name -> (A, B times its scaling), in host memory.
        self.host: OrderedDict[int, dict[str, tuple]] = OrderedDict()
        self.num_loads = self.num_evictions = 0
        self.loads: list[tuple[int, LoRARequest]] = []  # this step's (slot, adapter), for the other ranks
        per_slot = sum(e.layer.lora_a[0].numel() + e.layer.lora_b[0].numel() for e in self._distinct)
        logger.info("LoRA: %d slots of rank %d on %d linear layers, %.1f MiB each", max_loras, max_rank,
                    len(self._distinct), per_slot * dtype.itemsize / 2**20)

    # rank 0 ------------------------------------------------------------------------------------------------

    def prepare(self, rows_lora: dict[int, LoRARequest], token_rows: np.ndarray, padded_tokens: int) -> None:
        """This step's slots: load the adapters its rows run under that are not resident, and write each token's
        slot (-1 for the base model and the padding) into the host buffers. ``rows_lora``: the batch's rows that
        run under an adapter."""
        self.num_steps += 1
        self.loads = []
        slots = np.full(padded_tokens, -1, dtype=np.int32)
        if rows_lora:
            step_rows = np.unique(token_rows)
            wanted = {rows_lora[r].lora_int_id: rows_lora[r] for r in step_rows.tolist() if r in rows_lora}
            slot_of = {adapter: self._slot_for(request, wanted) for adapter, request in wanted.items()}
            row_slot = {r: slot_of[rows_lora[r].lora_int_id] for r in step_rows.tolist() if r in rows_lora}
            if row_slot:
                lookup = np.full(int(step_rows.max()) + 1, -1, dtype=np.int32)
                lookup[list(row_slot)] = list(row_slot.values())
                slots[: len(token_rows)] = lookup[token_rows]
        self._fill(slots)

    def _slot_for(self, request: LoRARequest, wanted: dict[int, LoRARequest]) -> int:
        adapter = request.lora_int_id
        if adapter in self.slot_adapter:
            slot = self.slot_adapter.index(adapter)
        else:
            free = [s for s in range(self.max_loras) if self.slot_adapter[s] not in wanted]
            slot = min(free, key=lambda s: (self.slot_adapter[s] != 0, self.slot_used[s]))
            self.load(slot, request)
            self.loads.append((slot, request))
        self.slot_used[slot] = self.num_steps
        return slot

    # every rank ---------------------------------------------------------------------------------------------

    def load(self, slot: int, request: LoRARequest) -> None:
        """Copy an adapter (from the host cache, read from disk first if need be) into ``slot``."""
        weights = self.host.pop(request.lora_int_id, None)
        if weights is None:
            weights = load_adapter(request.lora_path, self.max_rank, self.dtype)
            while len(self.host) >= self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host[request.lora_int_id] = weights
        if self.slot_adapter[slot]:
            self.num_evictions += 1
        for layer in self._distinct:
            layer.install(slot, weights, self.max_rank)
        self.slot_adapter[slot] = request.lora_int_id
        self.num_loads += 1
        logger.info("LoRA adapter %r (id %d) in slot %d", request.lora_name, request.lora_int_id, slot)

    def receive(self, token_slots: np.ndarray, loads: list[tuple[int, LoRARequest]]) -> None:
        """Another rank: rank 0's loads and token slots for this step."""
        for slot, request in loads:
            self.load(slot, request)
        self._fill(token_slots.astype(np.int32, copy=False))

    def _fill(self, slots: np.ndarray) -> None:
        n = len(slots)
        self.token_slots.np[:n] = slots
        self.token_order.np[:n], self.slot_starts.np[:] = segments(slots, self.max_loras)
        self.mapping.active = bool((slots >= 0).any())

    def to_device(self, padded_tokens: int) -> None:
        """The step's map on the device (behind the copies of its other inputs)."""
        self.token_slots.copy_to_device(padded_tokens)
        self.token_order.copy_to_device(padded_tokens)
        self.slot_starts.copy_to_device(self.max_loras + 1)

    @contextlib.contextmanager
    def capturing(self):
        """While CUDA graphs are captured (and the profiling step runs): the products are recorded whatever the
        map holds, since a graph replays every step's."""
        active = self.mapping.active
        self.mapping.active = True
        try:
            yield
        finally:
            self.mapping.active = active

    def module_names(self) -> set[str]:
        """The checkpoint modules an adapter may adapt."""
        return set(self.layers)
