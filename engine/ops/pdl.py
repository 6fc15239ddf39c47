"""Programmatic dependent launch (PDL) for the engine's Triton kernels, on Hopper and later GPUs.

A decode step replays a few hundred small kernels; between two of them the GPU drains the first, flushes its
writes and only then starts dispatching the second, a microsecond or two each time. With PDL a kernel is launched
with the "programmatic stream serialization" attribute: its programs may be dispatched as soon as every program of
the kernel before it has exited (or said ``griddepcontrol.launch_dependents``), and each waits in
``griddepcontrol.wait`` until that kernel has completed and its writes are visible. The launch and the set-up of
the next kernel overlap the tail of the previous one; the results are those of a plain launch. A CUDA graph
captures such launches as programmatic edges. SGLang and FlashInfer launch their norm and activation kernels so.

Every kernel launched this way must wait before its first memory access (``wait`` below, first in the kernel):
the previous kernel may still be reading or writing any buffer. The cuBLAS products between the engine's kernels
are launched by torch without the attribute and keep a plain dependency on whatever ran before them.

``MINIVLLM_PDL`` picks the mode, read once per process: ``off`` (the default: on W1 the other modes did not shorten
a decode step, bench/RESULTS.md), ``on`` (a kernel waits first thing; the next one may be dispatched as its
programs exit), ``early`` (it also lets the next kernel be dispatched as soon as all its own programs have started,
so the next kernel's programs may sit in ``griddepcontrol.wait`` beside the tail of this one). It needs CUDA
compute capability 9.0 or later and a Triton that has ``launch_pdl`` (3.4 and later); elsewhere it is off whatever
the variable says.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

MODES = {"off": 0, "on": 1, "early": 2}

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # older Triton: the kernels never take the PDL branch (``triton_supports_pdl`` is False)
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def wait(PDL: tl.constexpr):
    """First in a kernel: with ``PDL`` > 0, wait for the kernel before to complete; with 2, then let the next kernel's
    programs be dispatched (they wait for this one in turn). Nothing at all with ``PDL`` 0."""
    if PDL > 0:
        gdc_wait()
    if PDL > 1:
        gdc_launch_dependents()


def triton_supports_pdl() -> bool:
    """Whether this Triton can launch with the attribute (the NVIDIA backend's ``launch_pdl`` option)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return _HAS_GDC and "launch_pdl" in CUDAOptions.__dataclass_fields__


def mode_from_env() -> int:
    """``MINIVLLM_PDL`` as a mode number; an unknown value is an error naming the choices."""
    value = os.environ.get("MINIVLLM_PDL", "off").strip().lower()
    if value not in MODES:
        raise ValueError(f"MINIVLLM_PDL must be one of {sorted(MODES)}, got {value!r}")
    return MODES[value]


@functools.cache
def _mode(device_index: int) -> int:
    mode = mode_from_env()
    if mode == 0:
        return 0
    capability = torch.cuda.get_device_capability(device_index)
    if capability < (9, 0) or not triton_supports_pdl():
        logger.info("programmatic dependent launch off: needs compute capability 9.0 (this GPU: %d.%d) and a "
                    "Triton with launch_pdl (%s)", *capability, triton.__version__)
        return 0
    logger.info("programmatic dependent launch on (%s) for the engine's Triton kernels",
                next(name for name, m in MODES.items() if m == mode))
    return mode


def reread_env() -> None:
    """Forget the mode read from ``MINIVLLM_PDL``: kernels launched after this read the variable again (for a
    benchmark or test that compares settings in one process)."""
    _mode.cache_clear()


def mode(t: torch.Tensor) -> int:
    """The mode for kernels on ``t``'s device: 0 on the CPU (Triton's interpreter included)."""
    return _mode(t.device.index if t.device.index is not None else torch.cuda.current_device()) if t.is_cuda else 0


def launch_args(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel that takes ``PDL: tl.constexpr`` and calls ``wait(PDL)`` first: the mode, and
    the launch attribute when it is on."""
    level = mode(t)
    return {"PDL": level, "launch_pdl": True} if level else {"PDL": 0}
