"""``W8A8LinearMethod``: int8 weights times int8 activations (compressed-tensors' W8A8: ``int-quantized`` weights
with a scale per output channel, ``input_activations`` int8, dynamic, one scale per token, symmetric).

    weight        [out, in] int8
    weight_scale  [out, 1]             float32 (stored in the checkpoint's dtype)

Every product quantizes its input at run time, one scale a token (row): a = amax|x| / 127, xq = round(x / a) in
[-127, 127]; the int8 product xq W^T is accumulated in int32 and scaled back, y = (xq W^T) * a * s, in float32,
rounded once to the compute dtype. The integer product is ``torch._int_mm`` wherever it runs (CUDA, where it wants
more than 16 rows, which a decode step pads to, and whole multiples of 8 columns; the CPU, in recent torch), checked
once per device on a small product; elsewhere it is emulated by a float32 product of the same integers (exact while
the sums stay within float32's 24 bits, as they do for small layers; a rounding of the sum beyond that).

Under tensor parallelism a row-parallel rank quantizes its own share of each token's columns, with that share's
maximum: the scales differ from one GPU's, as they do in other servers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.linear.compressed import fill_int8_dummy
from engine.models.linear.int_checkpoint import dummy_scale
from engine.models.linear.method import LinearMethod, WeightLayout

INT8_MAX = 127
INT_MM_MIN_ROWS = 17  # CUDA's int8 product takes more than 16 rows


def quantize_tokens_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [m, k] -> (int8 [m, k], float32 scales [m, 1]): each row scaled so that its absolute maximum is 127."""
    rows = x.float()
    scales = rows.abs().amax(dim=1, keepdim=True).div_(INT8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    return rows.div(scales).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scales


def int8_product(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``values @ weight.T`` of int8 [m, k] and [n, k] in int32, through ``torch._int_mm``."""
    rows = values.shape[0]
    if values.is_cuda and rows < INT_MM_MIN_ROWS:
        values = F.pad(values, (0, 0, 0, INT_MM_MIN_ROWS - rows))
    return torch._int_mm(values, weight.t())[:rows]


@functools.lru_cache(maxsize=None)
def int_mm_available(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` multiplies int8 exactly on this device (checked once on a small product)."""
    if not hasattr(torch, "_int_mm"):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randint(-127, 128, (3, 64), dtype=torch.int8, generator=generator)
        b = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=generator)
        got = int8_product(a.to(device), b.to(device)).cpu()
        return got.dtype == torch.int32 and torch.equal(got, (a.long() @ b.long().T).int())
    except (RuntimeError, NotImplementedError):
        return False


class W8A8LinearMethod(LinearMethod):
    """The int8 x int8 product; see the module docstring."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.compute_dtype = dtype
        layer.int8_mm = False  # whether products go through torch._int_mm (process_after_loading)
        layer.widened_weight = None  # the emulation's float32 weight, where they do not
        layer.add_param("weight", (layer.out_features, layer.in_features), torch.int8, WeightLayout())
        layer.add_param("weight_scale", (layer.out_features, 1), torch.float32, WeightLayout(0, None))

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        shape = (layer.out_features, layer.in_features)
        if tuple(layer.weight.shape) != shape or layer.weight.dtype != torch.int8:
            raise ValueError(f"a W8A8 linear layer needs a {shape} int8 weight, has {tuple(layer.weight.shape)} "
                             f"{layer.weight.dtype}")
        if tuple(layer.weight_scale.shape) != (shape[0], 1):
            raise ValueError(f"a W8A8 linear layer needs [{shape[0]}, 1] weight scales (one per output channel), has "
                             f"{list(layer.weight_scale.shape)}")
        device = layer.weight.device
        whole = layer.in_features % 8 == 0 and layer.out_features % 8 == 0
        layer.int8_mm = whole and int_mm_available(device)
        layer.widened_weight = None if layer.int8_mm else layer.weight.float()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        values, scales = quantize_tokens_int8(rows)
        if not layer.int8_mm:
            products = F.linear(values.float(), layer.widened_weight)
        elif rows.shape[0] == 0:
            products = rows.new_zeros((0, layer.out_features), dtype=torch.float32)
        else:
            products = int8_product(values, layer.weight).float()
        out = (products.mul_(scales).mul_(layer.weight_scale.view(1, -1))).to(x.dtype)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], out.shape[-1])

    def fill_dummy(self, layer: nn.Module, generator: torch.Generator) -> None:
        fill_int8_dummy(layer.weight, generator)
        layer.weight_scale.fill_(dummy_scale(8))
