"""The torch side of the batched LoRA products (``engine.ops.lora``): the same products as its kernels, one matmul
per slot present (the engine's path where the kernels do not run, and the kernels' reference), and the segmented
mapping of per-token slots. Nothing here needs Triton."""

from __future__ import annotations

import numpy as np
import torch


def _slot_rows(token_slots: torch.Tensor, t: int):
    """(slot, its tokens' indices) for each slot present among the first ``t`` tokens (reads them on the host)."""
    slots = token_slots[:t].long()
    for slot in torch.unique(slots[slots >= 0]).tolist():
        yield slot, torch.nonzero(slots == slot).squeeze(1)


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor) -> None:
    """``lora_shrink_bgmv`` in torch: one float32 matmul per slot present."""
    for slot, rows in _slot_rows(token_slots, x.shape[0]):
        out.index_copy_(0, rows, x.index_select(0, rows).float() @ a[slot].float().t())


def lora_expand_reference(h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor) -> None:
    """``lora_expand_bgmv`` in torch: one float32 matmul per slot present, rounded into ``y`` once."""
    for slot, rows in _slot_rows(token_slots, h.shape[0]):
        total = y.index_select(0, rows).float() + h.index_select(0, rows).float() @ b[slot].float().t()
        y.index_copy_(0, rows, total.to(y.dtype))


def segments(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """The segmented mapping of per-token slots (-1: none): ``token_order`` [T] int32, the tokens grouped by slot in
    their order within each slot and the unmapped ones last, and ``slot_starts`` [num_slots + 1] int32."""
    slots = np.asarray(token_slots).astype(np.int64).reshape(-1)
    if slots.size and (slots.min() < -1 or slots.max() >= num_slots):
        raise ValueError(f"segments: slots must lie in -1 .. {num_slots - 1}")
    mapped = slots >= 0
    order = np.argsort(np.where(mapped, slots, num_slots), kind="stable").astype(np.int32)
    slot_starts = np.zeros(num_slots + 1, dtype=np.int32)
    np.cumsum(np.bincount(slots[mapped], minlength=num_slots), out=slot_starts[1:])
    return order, slot_starts
