"""Paged attention in Triton: the decode and prefill kernels and the KV-cache write.

The kernels read K/V in place through the block table; nothing is gathered into contiguous tensors (``tiles``
says how a key tile finds its blocks). They are GQA-aware: one program owns one KV head and all the query heads
that share it, so each K/V tile is loaded once per group rather than once per query head.

* ``decode``: one query token per sequence, flash-decoding: the context is cut into ``num_splits`` pieces that run
  in parallel and a small second kernel merges them (``decode_fp8``: the kernel of an FP8 cache).
* ``prefill``: a varlen batch of new tokens (prefill, chunked prefill, decode rows too) attending causally to their
  cached context and to themselves. It is correct for decode rows too, but slower there than the decode kernel (it
  cannot split small batches, and decode rows batched with long prompts get their tile size), so the backend uses
  both.
* ``kv_write``: the new tokens' K and V into their slots, with the rope q and k still need (``kv_write_fp8``: the
  write of an FP8 cache, quantized, K rotated and the queries alike).
* ``launch``: the launch choices (split counts, tiles), functions of shapes; ``checks``: the argument checks.
* ``paged``: the entry points. ``PagedAttention`` is bound to one layer's cache and checks it once, for the
  backend's steps; ``paged_decode_attention``, ``paged_prefill_attention`` and ``write_paged_kv`` check every
  argument of every call. ``warmup``: every variant a step can pick, compiled at start-up.

Each launch module has a private launch function under its wrapper (``_launch_decode``, ``_launch_prefill``,
``_launch_write``) that takes the launch choices a sweep sets (``tiles`` ...); bench/ calls those.

CUDA-graph safety: grids and compile-time constants depend only on tensor shapes and host arguments. Sequence
lengths are read on the device, so a captured launch stays correct when the lengths change between replays.

Softmax runs in base 2 (``exp2``), with the scale folded into ``qk_scale``. Everything accumulates in float32.

FP8 caches (``kv_scales`` given, see ``kvcache.paged_cache``): K and V tiles are loaded as float8_e4m3 and
converted in registers, with their per-(token, head) scales; a key's scale multiplies its column of ``q @ k^T``.
The decode kernel has its own FP8 variant, which reads the tiles as byte pairs (``decode_fp8`` says why); the
prefill kernel converts whole tiles and scales V's rows by their scales. The write kernel quantizes each head's row.

Measurements behind the launch choices: bench/RESULTS.md (its section "Kernel measurements moved from docstrings"
quotes those that stood in these docstrings).
"""

from engine.ops.attention.checks import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from engine.ops.attention.launch import MAX_NUM_SPLITS, choose_num_splits, num_sms
from engine.ops.attention.paged import PagedAttention, paged_decode_attention, paged_prefill_attention, write_paged_kv
from engine.ops.attention.warmup import compile_variants, compile_write_variants

__all__ = [
    "MAX_NUM_SPLITS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "PagedAttention",
    "choose_num_splits",
    "compile_variants",
    "compile_write_variants",
    "num_sms",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_paged_kv",
]
