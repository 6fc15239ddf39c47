"""Fused Triton kernels for the small ops of a decoder layer, each with a wrapper that checks its inputs.

Eagerly, a decoder layer spends most of its kernel launches on tiny elementwise ops: RMSNorm
alone is half a dozen (cast, square, mean, rsqrt, scale, cast back, weight), rotary embedding
a dozen more. Each costs a few microseconds even when replayed from a CUDA graph. Here each
group is one kernel, a module per family:

* ``norm``: ``rms_norm`` / ``fused_add_rms_norm``, one program per row, the whole row in registers.
* ``rope``: ``rotary`` / ``qk_norm_rotary``, neox-style rope (rotate-half) of q and k, optionally after
  Qwen3's per-head RMSNorm; grid ``(num_tokens, 2)``, one program per token for q, one for k.
  With an ``mrope_section`` (Qwen2.5-VL's M-RoPE) a token has three positions, and each rotary
  frequency takes its cos/sin from the position of the section it falls in.
  The same kernel is the KV-cache write of a 16-bit cache (the models hand their rope to attention,
  ``engine.ops.attention.write_paged_kv``): the k program stores the roped K heads straight into the
  token's cache slot and copies V beside them, so one launch per layer ropes and writes
  (``launch_rope_into_cache``, on arguments the write checked). An FP8 cache's write kernel ropes with the
  helpers of ``engine.ops.triton_helpers`` (``norm_halves``, ``rope_halves``), the same roundings.
* ``activation``: ``silu_and_mul``, SwiGLU on a fused ``[gate | up]`` projection.
* ``rms_norm_fp8`` / ``silu_and_mul_fp8``: the same, written as the FP8 input of the linear that follows
  (``engine.models.fp8``): float8 values with one scale per token and 128 columns, so that no separate
  quantization kernel runs before the product (three launches per decoder layer fewer).

Numerics: every kernel rounds where the torch code in ``engine.models`` (norm.py, rotary.py, activation.py) rounds
(Hugging Face's order): the residual add in the model dtype; the norm in float32, cast to the
model dtype, then times the weight in the model dtype; rope with cos/sin rounded to the model
dtype and each product and sum rounded. Only reduction order and the float32 ``rsqrt``/``exp``
differ, so bfloat16 results agree with torch's to a rounding step at most, and float32 ones to
about 1e-6. Floating-point contraction (mul + add into fma) is turned off for the same reason.

All wrappers are out of place (inputs are never written), take rows with any stride as long
as the last dim is contiguous, and launch grids that depend only on shapes: they are safe to
capture in a CUDA graph.
"""

from engine.ops.fused.activation import silu_and_mul, silu_and_mul_fp8
from engine.ops.fused.checks import SUPPORTED_DTYPES
from engine.ops.fused.norm import MAX_HIDDEN_SIZE, fused_add_rms_norm, rms_norm, rms_norm_fp8
from engine.ops.fused.rope import (
    check_partials,
    check_rope_inputs,
    check_rope_tables,
    launch_rope,
    launch_rope_into_cache,
    qk_norm_rotary,
    rope_strides,
    rotary,
)

__all__ = [
    "MAX_HIDDEN_SIZE",
    "SUPPORTED_DTYPES",
    "check_partials",
    "check_rope_inputs",
    "check_rope_tables",
    "fused_add_rms_norm",
    "launch_rope",
    "launch_rope_into_cache",
    "qk_norm_rotary",
    "rms_norm",
    "rms_norm_fp8",
    "rope_strides",
    "rotary",
    "silu_and_mul",
    "silu_and_mul_fp8",
]
