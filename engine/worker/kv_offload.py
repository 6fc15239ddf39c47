"""The host tier's KV tensors and the copies between them and the device cache.

The KV cache manager plans the copies (``kvcache/manager.py``: evicted cached blocks saved to the host tier,
host prefix hits and swapped-out requests loaded back) and each step carries them; this module makes them before
the step's forward pass. The host tier holds every layer's K and V of a block together::

    host_kv[host_block, layer, 0 (K) | 1 (V), slot_in_block, kv_head, head_dim]

so a block moves in one contiguous copy (its device slots lie in 2 x layers places). On CUDA the host tensors are
pinned and the copies run on a side stream, ordered by events with the step's stream, never with a host sync:

    step stream:  gather the saves' device blocks into a staging buffer ─┐        ┌─> scatter the loads into
                                                                         │        │   their device blocks, then
    side stream:  loads: host -> staging (may start while the step       │        │   the step's forward pass
                  before is still running) ─────────────────────────────-│────────┘
                  saves: staging -> host, after the gather ──────────────┘

The gather runs before anything the step writes, so a saved device block may be reused by this very step; the
side stream reads the loads' host blocks before it writes the saves', so a host block may be loaded from and
refilled in one step. FP8 caches move their scales the same way. On the CPU the same copies are plain tensor
copies, in the same order.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque

import torch

from engine.config import ConfigError
from engine.distributed import tp_rank, tp_size
from kvcache.metrics import KVTransferStats
from kvcache.paged_cache import PagedKVCache, is_fp8

logger = logging.getLogger("minivllm")

# Blocks moved per staging buffer fill: a bound on the device memory the copies take at once.
_CHUNK_BLOCKS = 64


class KVOffloader:
    """One rank's host tier: ``num_host_blocks`` blocks of its share of the KV heads, and the copies."""

    def __init__(self, cache: PagedKVCache, num_host_blocks: int) -> None:
        self.cache = cache
        self.num_host_blocks = num_host_blocks
        self.device = cache.device
        cuda = self.device.type == "cuda"
        layers, _, _, block_size, heads, head_dim = cache.kv.shape
        self._kv = cache.kv.view(torch.uint8) if is_fp8(cache.dtype) else cache.kv  # FP8 copies move bytes
        self.host_kv = _host_empty((num_host_blocks, layers, 2, block_size, heads, head_dim), self._kv.dtype, cuda)
        self.host_scales = None
        if cache.scales is not None:
            self.host_scales = _host_empty((num_host_blocks, layers, 2, block_size, heads), cache.scales.dtype, cuda)
        self.bytes_per_block = self.host_kv[0].nbytes + (self.host_scales[0].nbytes if self.host_scales is not None
                                                         else 0)
        self.counters = KVTransferStats()
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._load_staging = None
        if cuda:  # loads land here first: the side stream fills it, the step's stream scatters it
            self._load_staging = self._staging(_CHUNK_BLOCKS)
            self._staging_free = torch.cuda.Event()  # the last scatter from the staging buffer has run
            self._staging_free.record(torch.cuda.current_stream(self.device))
        self._timed: deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = deque()

    @classmethod
    def of_size(cls, cache: PagedKVCache, size_gib: float) -> KVOffloader:
        """The host tier of ``size_gib`` shared by the tensor-parallel ranks: as many whole blocks of this rank's
        share of the heads as the size holds over all ranks."""
        ranks = tp_size()
        num_host_blocks = int(size_gib * 2**30 // (cache.bytes_per_block_all_layers() * ranks))
        if num_host_blocks < 1:
            raise ConfigError(f"kv_offloading_size={size_gib} GiB holds no KV block of "
                              f"{cache.bytes_per_block_all_layers() * ranks} bytes: give it more or 0 (off)")
        start = time.perf_counter()
        tier = cls(cache, num_host_blocks)
        logger.info("KV host tier%s: %d blocks x %d tokens = %d tokens, %.2f GiB of %s host memory, ready in %.1f s",
                    f" of rank {tp_rank()}" if ranks > 1 else "", num_host_blocks, cache.block_size,
                    num_host_blocks * cache.block_size, tier.nbytes / 2**30,
                    "pinned" if cache.device.type == "cuda" else "plain", time.perf_counter() - start)
        return tier

    @property
    def nbytes(self) -> int:
        return self.num_host_blocks * self.bytes_per_block

    def run(self, loads: list[tuple[int, int]], saves: list[tuple[int, int]]) -> None:
        """Make one step's copies (``KVCacheManager.take_transfers``) ahead of its forward pass."""
        if not loads and not saves:
            return
        if self.stream is None:
            self._run_on_cpu(loads, saves)
        else:
            self._run_on_cuda(loads, saves)
        self.counters.blocks_to_device += len(loads)
        self.counters.blocks_to_host += len(saves)
        self.counters.bytes_to_device += len(loads) * self.bytes_per_block
        self.counters.bytes_to_host += len(saves) * self.bytes_per_block

    def poll(self) -> KVTransferStats:
        """The counters, with the device time of the copies that have finished since the last call."""
        while self._timed and self._timed[0][2].query():
            direction, start, end = self._timed.popleft()
            seconds = start.elapsed_time(end) / 1000
            if direction == "to_host":
                self.counters.seconds_to_host += seconds
            else:
                self.counters.seconds_to_device += seconds
        return self.counters

    # ------------------------------------------------------------------ the CPU

    def _run_on_cpu(self, loads, saves) -> None:
        # Read before written, on both sides: the saves' device blocks, then the loads' host blocks.
        t0 = time.perf_counter()
        saved = self._gather(torch.tensor([d for d, _ in saves])) if saves else None
        t1 = time.perf_counter()
        loaded = self._host_blocks([h for h, _ in loads]) if loads else None
        t2 = time.perf_counter()
        if saved is not None:
            host_ids = torch.tensor([h for _, h in saves])
            self.host_kv[host_ids] = saved[0]
            if self.host_scales is not None:
                self.host_scales[host_ids] = saved[1]
        t3 = time.perf_counter()
        if loaded is not None:
            self._scatter(torch.tensor([d for _, d in loads]), *loaded)
        t4 = time.perf_counter()
        self.counters.seconds_to_host += (t1 - t0) + (t3 - t2)
        self.counters.seconds_to_device += (t2 - t1) + (t4 - t3)

    # ------------------------------------------------------------------ CUDA

    def _run_on_cuda(self, loads, saves) -> None:
        step = torch.cuda.current_stream(self.device)
        side = self.stream
        staged = []
        for i in range(0, len(saves), _CHUNK_BLOCKS):  # the gathers first, on the step's stream
            chunk = saves[i : i + _CHUNK_BLOCKS]
            ids = torch.tensor([d for d, _ in chunk], dtype=torch.long).to(self.device, non_blocking=True)
            staged.append((chunk, self._gather(ids)))
        gathered = torch.cuda.Event()
        gathered.record(step)
        with torch.cuda.stream(side):
            for i in range(0, len(loads), _CHUNK_BLOCKS):
                chunk = loads[i : i + _CHUNK_BLOCKS]
                side.wait_event(self._staging_free)  # the previous chunk's scatter has read the buffer
                start, end = self._timer("to_device", side)
                for row, (host_block, _) in enumerate(chunk):
                    self._load_staging[0][row].copy_(self.host_kv[host_block], non_blocking=True)
                    if self.host_scales is not None:
                        self._load_staging[1][row].copy_(self.host_scales[host_block], non_blocking=True)
                end.record(side)
                filled = torch.cuda.Event()
                filled.record(side)
                step.wait_event(filled)
                n = len(chunk)
                with torch.cuda.stream(step):
                    ids = torch.tensor([d for _, d in chunk], dtype=torch.long).to(self.device, non_blocking=True)
                    self._scatter(ids, self._load_staging[0][:n],
                                  self._load_staging[1][:n] if self.host_scales is not None else None)
                    self._staging_free.record(step)
            if staged:
                side.wait_event(gathered)
                start, end = self._timer("to_host", side)
                for chunk, (kv, scales) in staged:
                    for row, (_, host_block) in enumerate(chunk):
                        self.host_kv[host_block].copy_(kv[row], non_blocking=True)
                        if scales is not None:
                            self.host_scales[host_block].copy_(scales[row], non_blocking=True)
                    kv.record_stream(side)  # the allocator keeps it until the side stream is past this copy
                    if scales is not None:
                        scales.record_stream(side)
                end.record(side)

    def _timer(self, direction: str, stream) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        self._timed.append((direction, start, end))
        return start, end

    # ------------------------------------------------------------------ both

    def _staging(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        shape = (num_blocks, *self.host_kv.shape[1:])
        kv = torch.empty(shape, dtype=self._kv.dtype, device=self.device)
        scales = None
        if self.host_scales is not None:
            scales = torch.empty((num_blocks, *self.host_scales.shape[1:]), dtype=self.host_scales.dtype,
                                 device=self.device)
        return kv, scales

    def _gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device blocks ``ids`` in the host layout: [n, layers, 2, slots, heads, head_dim] (and scales)."""
        kv = self._kv.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        scales = None
        if self.cache.scales is not None:
            scales = self.cache.scales.index_select(2, ids).permute(2, 0, 1, 3, 4).contiguous()
        return kv, scales

    def _scatter(self, ids: torch.Tensor, kv: torch.Tensor, scales: torch.Tensor | None) -> None:
        self._kv[:, :, ids] = kv.permute(1, 2, 0, 3, 4, 5)
        if scales is not None:
            self.cache.scales[:, :, ids] = scales.permute(1, 2, 0, 3, 4)

    def _host_blocks(self, host_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.tensor(host_ids)
        return self.host_kv[ids], self.host_scales[ids] if self.host_scales is not None else None


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor, page-locked for CUDA's asynchronous copies when ``pin``. Registered with CUDA rather than
    taken from torch's pinned-memory allocator, which rounds a request up to a power of two (a 40 GiB tier would
    take 64)."""
    tensor = torch.empty(shape, dtype=dtype)
    if pin and tensor.numel():
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 0)) != 0:
            cudart.cudaGetLastError()  # clear it, or the next CUDA call would report it as its own
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        # Unregistered when the tensor goes: the allocator may hand the same pages to the next tier's tensor.
        weakref.finalize(tensor, _unregister, cudart, tensor.data_ptr())
    return tensor


def _unregister(cudart, pointer: int) -> None:
    if int(cudart.cudaHostUnregister(pointer)) != 0:
        cudart.cudaGetLastError()
