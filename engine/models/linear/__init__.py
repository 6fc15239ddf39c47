"""Linear layers that take a weight method (``method.py`` tells the life cycle and how int4 or LoRA plug in).

    layer.py        LinearBase, FusedLinear (q|k|v, gate|up), RowParallelLinear (o, down); setting methods
    method.py       LinearMethod, the interface; WeightLayout and WeightPart, how checkpoint tensors land
    output.py       LinearOutput: a product whose last step the kernel reading it does
    unquantized.py  UnquantizedLinearMethod: 16/32-bit weights, decode-sized products cut along K
    fp8.py          Fp8LinearMethod: FP8 weights quantized at load time or loaded as an FP8 checkpoint stores them
    ksplit.py       MINIVLLM_DECODE_KSPLIT: which products are cut along K, into how many slices
"""

from engine.models.linear.fp8 import Fp8LinearMethod
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

__all__ = [
    "DECODE_KSPLIT_MAX_ROWS",
    "Fp8LinearMethod",
    "FusedLinear",
    "LinearBase",
    "LinearMethod",
    "LinearOutput",
    "RowParallelLinear",
    "UnquantizedLinearMethod",
    "WeightLayout",
    "WeightPart",
    "decode_k_split_setting",
    "decode_k_split_summary",
    "linear_layers",
    "process_weights_after_loading",
    "set_linear_methods",
    "use_decode_k_split",
]
