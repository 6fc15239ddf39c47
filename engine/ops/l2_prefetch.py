"""Weights asked of the L2 cache by the kernel before the product that reads them (Hopper and later).

In a decode step a projection's weight is read once, by a short cuBLAS product that starts cold: its first loads
wait on HBM, and between kernels nothing reads memory at all. The small kernel that computes the product's input
(the add-norm before q|k|v and gate|up, the SwiGLU before down) can ask the L2 cache for that weight first thing:
each of its programs issues bulk prefetches (``cp.async.bulk.prefetch.L2.global``, sm_90) for a share of the
weight's bytes, and carries on with its own work while the L2 fills. Decode attention, before o, reads far more
than the L2 holds, so there the programs dispatched last ask for o's weight as they finish (``prefetch_tail``; in
split steps, the merge kernel's programs as they start). The product then finds its weight in the L2 (50 MB on an
H100 or H200; Qwen3-0.6B's largest projection is 12.6 MB). A prefetch is a hint: it changes no result, only where
the product's loads are served from. It reads only the weight, which no kernel writes, so it is issued before the
kernel waits for the one before it (``engine.ops.pdl``).

``MINIVLLM_L2_PREFETCH=1`` turns it on (off by default: on W1 it lengthened decode steps, bench/RESULTS.md) for
steps of up to ``MAX_ROWS`` tokens on GPUs of compute capability 9.0 and later, for weights of up to ``MAX_BYTES``.
A larger weight is left alone: which part of it a product reads first is cuBLAS's choice, and lines fetched for a
part read last would be evicted by the rest before use, their bandwidth spent for nothing.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

MAX_ROWS = 512  # decode-sized steps: a prefill-sized product reads its weight many times and is not cold long
MAX_BYTES = 36 << 20  # of the H200's 50 MB L2 (Llama-3.1-8B's o is 33.5 MB): room for activations and the rest
TAIL = tl.constexpr(128)  # decode attention: the programs dispatched last, about one per SM, prefetch o's weight


@triton.jit
def share_range(num_bytes, program, num_programs):
    """(start, end) of program ``program``'s bytes: the programs take consecutive shares of a multiple of 16 bytes,
    the last ones shorter or empty, together exactly ``[0, num_bytes)``."""
    share = tl.cdiv(tl.cdiv(num_bytes, num_programs), 16) * 16
    start = tl.minimum(program.to(tl.int64) * share, num_bytes)
    return start, tl.minimum(start + share, num_bytes)


@triton.jit
def prefetch_share(base_ptr, num_bytes, program, num_programs, PIECE: tl.constexpr = 1 << 19):
    """Program ``program`` of ``num_programs`` asks the L2 for its share of the bytes ``[base_ptr, base_ptr +
    num_bytes)`` (``base_ptr`` a byte pointer and ``num_bytes`` a multiple of 16): bulk prefetches of up to
    ``PIECE`` bytes, each issued by the program's first thread (sm_90 encodes a size in 16-byte units in 16 bits:
    1 MB at most), so that a lone program, a batch of one, issues a few dozen at most."""
    start, end = share_range(num_bytes, program, num_programs)
    for offset in range(start, end, PIECE):
        size = tl.minimum(end - offset, PIECE).to(tl.int32)
        tl.inline_asm_elementwise(
            asm="""{
            .reg .pred p;
            .reg .u32 t;
            mov.u32 t, %tid.x;
            setp.eq.u32 p, t, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }""", constraints="=r,l,r", args=[base_ptr + offset, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_tail(base_ptr, num_bytes, program, num_programs, TAIL: tl.constexpr):
    """``prefetch_share`` among the last ``TAIL`` programs (all of them if fewer) of a grid whose programs are
    dispatched in the order of ``program``, their linear index: called as they finish, when the kernel's reads
    that would evict the lines are nearly done."""
    tail = tl.minimum(num_programs, TAIL)
    if program >= num_programs - tail:
        prefetch_share(base_ptr, num_bytes, program - (num_programs - tail), tail)


def enabled_from_env() -> bool:
    value = os.environ.get("MINIVLLM_L2_PREFETCH", "0").strip().lower()
    if value not in ("0", "1", "off", "on"):
        raise ValueError(f"MINIVLLM_L2_PREFETCH must be 0 or 1 (or off, on), got {value!r}")
    return value in ("1", "on")


@functools.cache
def _enabled(device_index: int) -> bool:
    if not enabled_from_env():
        return False
    capability = torch.cuda.get_device_capability(device_index)
    if capability < (9, 0):
        logger.info("L2 prefetch of weights off: needs compute capability 9.0 (this GPU: %d.%d)", *capability)
        return False
    logger.info("L2 prefetch of weights on: projections' weights of up to %d MB, steps of up to %d tokens",
                MAX_BYTES >> 20, MAX_ROWS)
    return True


def reread_env() -> None:
    """Forget the setting read from ``MINIVLLM_L2_PREFETCH``: kernels launched after this read it again."""
    _enabled.cache_clear()


def target(weight: torch.Tensor | None, x: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, int] | None:
    """(byte view of ``weight``, bytes to prefetch) where a kernel on ``x`` with ``num_rows`` rows should prefetch
    ``weight``; None where it should not (off, the CPU, a large step, a weight too large or not contiguous)."""
    if weight is None or not x.is_cuda or num_rows > MAX_ROWS:
        return None
    if not _enabled(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return None
    num_bytes = weight.numel() * weight.element_size()
    if not 0 < num_bytes <= MAX_BYTES or num_bytes % 16 or weight.data_ptr() % 16 or not weight.is_contiguous():
        return None
    return weight.view(-1).view(torch.uint8), num_bytes
