"""Linear layers that take a weight method (``method.py`` tells the life cycle and how int4 or LoRA plug in).

    layer.py        LinearBase, FusedLinear (q|k|v, gate|up), RowParallelLinear (o, down); setting methods
    method.py       LinearMethod, the interface; WeightLayout and WeightPart, how checkpoint tensors land
    output.py       LinearOutput: a product whose last step the kernel reading it does
    unquantized.py  UnquantizedLinearMethod: 16/32-bit weights, decode-sized products cut along K
    fp8.py          Fp8LinearMethod: FP8 weights quantized at load time or loaded as an FP8 checkpoint stores them
    int4.py         Int4LinearMethod: 4-bit codes with a scale and a zero per group of input columns (GGUF Q4_0,
                    Q4_1, Q4_K, AWQ, GPTQ); on CUDA Triton kernels that read the codes; on the CPU torch's int4 op
                    in bfloat16 (W dequantized per call past 80 tokens); else W dequantized once
    int8.py         Int8LinearMethod: int8 codes with a scale, and optionally a zero, per row or per group (GGUF
                    Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, and fused layers of mixed types); Triton kernels on CUDA
    int_checkpoint.py  Int4CheckpointMethod, Int8CheckpointMethod: an integer checkpoint's tensors loaded as stored,
                    converted once to the int4 or int8 method's; awq.py, gptq.py, compressed.py: the layouts
    w8a8.py         W8A8LinearMethod: int8 weights times int8 activations quantized per token (compressed-tensors)
    ksplit.py       MINIVLLM_DECODE_KSPLIT: which products are cut along K, into how many slices
"""

from engine.models.linear.fp8 import Fp8LinearMethod
from engine.models.linear.int4 import Int4LinearMethod, dequantize_int4, pack_int4, unpack_int4
from engine.models.linear.int8 import Int8LinearMethod, dequantize_int8
from engine.models.linear.int_checkpoint import Int4CheckpointMethod, Int8CheckpointMethod
from engine.models.linear.ksplit import decode_k_split_setting, decode_k_split_summary, use_decode_k_split
from engine.models.linear.layer import (
    FusedLinear,
    LinearBase,
    RowParallelLinear,
    linear_layers,
    process_weights_after_loading,
    set_linear_methods,
)
from engine.models.linear.method import LinearMethod, WeightLayout, WeightPart
from engine.models.linear.output import LinearOutput
from engine.models.linear.unquantized import DECODE_KSPLIT_MAX_ROWS, UnquantizedLinearMethod
from engine.models.linear.w8a8 import W8A8LinearMethod

__all__ = [
    "DECODE_KSPLIT_MAX_ROWS",
    "Fp8LinearMethod",
    "FusedLinear",
    "Int4CheckpointMethod",
    "Int4LinearMethod",
    "Int8CheckpointMethod",
    "Int8LinearMethod",
    "LinearBase",
    "LinearMethod",
    "LinearOutput",
    "RowParallelLinear",
    "UnquantizedLinearMethod",
    "W8A8LinearMethod",
    "WeightLayout",
    "WeightPart",
    "decode_k_split_setting",
    "decode_k_split_summary",
    "dequantize_int4",
    "dequantize_int8",
    "linear_layers",
    "pack_int4",
    "process_weights_after_loading",
    "set_linear_methods",
    "unpack_int4",
    "use_decode_k_split",
]
