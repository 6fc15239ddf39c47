"""Persistent step-input buffers: numpy views on (pinned) host memory, mirrored on the device; and the small
host/device copies of a step that do not wait for the device.

A step writes its inputs into the host side with numpy, then each buffer is copied to
the device with one asynchronous copy of the rows in use. The device side never moves,
so CUDA graphs captured on it see each step's new inputs on replay. On the CPU the
two sides are the same tensor and nothing is copied.

An M-RoPE model (Qwen2.5-VL) reads three positions per token, ``mrope_positions`` [3, tokens],
instead of ``positions``; ``model_positions`` is whichever of the two the model reads.
"""

from __future__ import annotations

import numpy as np
import torch


class HostDeviceBuffer:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        on_cuda = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np: np.ndarray = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.host
        self._copies = on_cuda

    def copy_to_device(self, rows: int, cols: int | None = None) -> torch.Tensor:
        """Copy ``[:rows]`` (and ``[:, :cols]`` for 2-D buffers) to the device; return the device view of the rows."""
        if self._copies:
            if cols is None:
                self.device[:rows].copy_(self.host[:rows], non_blocking=True)
            else:
                self.device[:rows, :cols].copy_(self.host[:rows, :cols], non_blocking=True)
        return self.device[:rows]


class StepBuffers:
    """The flat inputs of one step, sized for the largest step the engine can schedule."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int, device: torch.device,
                 mrope: bool = False):
        self.input_ids = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.positions = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        # M-RoPE: rows t, h, w; the shape is fixed, so a decode graph reads each step's positions from it.
        self.mrope_positions = HostDeviceBuffer((3, max_num_tokens), torch.int64, device) if mrope else None
        self.slot_mapping = HostDeviceBuffer((max_num_tokens,), torch.int64, device)
        self.seq_lens = HostDeviceBuffer((max_num_reqs,), torch.int32, device)
        # A mixed step's CUDA graph: each row's seq_len if it is a decode, else 0 (AttentionMetadata.decode_seq_lens).
        self.decode_seq_lens = HostDeviceBuffer((max_num_reqs,), torch.int32, device)
        self.query_start_loc = HostDeviceBuffer((max_num_reqs + 1,), torch.int32, device)
        self.block_tables = HostDeviceBuffer((max_num_reqs, max_blocks_per_req), torch.int32, device)
        self.logits_indices = HostDeviceBuffer((max_num_reqs,), torch.int64, device)

    def model_positions_to_device(self, num_tokens: int) -> torch.Tensor:
        """Copy the positions the model reads of the first ``num_tokens`` tokens to the device; return the device
        view: [num_tokens], or [3, num_tokens] (rows ``max_num_tokens`` apart) for M-RoPE."""
        if self.mrope_positions is None:
            return self.positions.copy_to_device(num_tokens)
        return self.mrope_positions.copy_to_device(3, num_tokens)[:, :num_tokens]

    def model_positions(self, num_tokens: int) -> torch.Tensor:
        """The device view of the positions the model reads, without a copy (what a captured graph reads)."""
        if self.mrope_positions is None:
            return self.positions.device[:num_tokens]
        return self.mrope_positions.device[:, :num_tokens]


def upload(t: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on the device without waiting for the device.

    A blocking copy (``.to(device)``) would synchronize the stream, i.e. wait for the step
    in flight. From pageable memory the driver stages the bytes before the call returns,
    so the source may be dropped at once.
    """
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    return t.to(device, non_blocking=True)


def copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, queued behind the work before it (pinned memory on CUDA): valid once an
    event recorded after this call has passed."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
    host.copy_(t, non_blocking=True)
    return host
