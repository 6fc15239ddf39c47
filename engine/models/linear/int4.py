"""``Int4LinearMethod``: 4-bit weights with a scale and a zero per group of input columns (W4A16).

W [out, in] is held as codes q in [0, 15], one per element, and per row and group of ``group_size`` input columns a
scale s and a zero z: W = (q - 8) * s + z. This is the convention of torch's tinygemm int4 ops (z is the value of
code 8). The checkpoint formats map to it exactly: GGUF Q4_0 (d * (q - 8)) is s = d, z = 0; GGUF Q4_1 (d * q + m)
is s = d, z = m + 8 d; AWQ and GPTQ with an integer zero point zp ((q - zp) * s) are z = (8 - zp) * s.

    qweight  [out, in / 2] uint8     two codes a byte along the input dim: column 2j in the low nibble, 2j + 1 in
                                     the high one (``pack_int4``)
    scales   [out, in / group]       the compute dtype
    zeros    [out, in / group]       the compute dtype

The WeightLayouts cut q|k|v parts and column-parallel shards by rows, and a row-parallel rank's columns in whole
bytes and whole groups (a rank's columns must start and end on a group boundary: checked when the method is set).

``process_after_loading`` chooses the product once:

* on the CPU in bfloat16, where torch has ``_convert_weight_to_int4pack_for_cpu`` and
  ``_weight_int4pack_mm_for_cpu`` (torch 2.6 on), for a group size they take (32, 64, 128, 256) and a multiple of
  16 output features: the codes are repacked into the op's layout once, and each product is one call of the op,
  which dequantizes as it multiplies (the layer holds 4 bits a weight twice: the loaded codes and the op's). The op
  takes float32 and float16 too, but on x86 only its bfloat16 kernel is vectorized: in float32 it is many times
  slower than a dense product. A float32 model may run it in bfloat16 (``float32_in_bfloat16``: x cast in, the
  product cast back, scales and zeros rounded to bfloat16). The op dequantizes the codes again for every few
  tokens, so its time grows with the tokens as a dense product's does not: a product of more than
  ``INT4_CPU_OP_MAX_TOKENS`` tokens (prefill chunks, large decode batches) dequantizes W instead, into a scratch
  buffer of this thread that every layer reuses (``cpu_dequantized_product``: no copy of W is kept), and multiplies
  densely, in bfloat16 where oneDNN has a bfloat16 product for this CPU (``dense_bfloat16``), else in float32;
* on CUDA, the Triton W4A16 kernels of ``engine.ops.quant_matmul`` (``cuda_kernels_apply``): up to
  ``DEQUANTIZE_FROM_ROWS`` tokens a product dequantizes the codes tile by tile on their way to the tensor cores
  (K cut into slices at decode sizes, the slices' partial products handed to the next kernel by
  ``apply_deferred``); longer products dequantize W into a temporary and multiply on cuBLAS;
* otherwise (an older torch, another group size or dtype on the CPU, a shape the kernels do not take): W is
  dequantized once into a weight in the compute dtype kept on the layer (``dequantized_weight``) and the product is
  ``F.linear``: the speed and the memory of an unquantized layer.

The parameters stay as loaded either way (the codes are a quarter of a bfloat16 weight).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.linear.method import LinearMethod, WeightLayout
from engine.models.linear.output import LinearOutput
from engine.models.linear.quant_kernels import cuda_kernels_apply, cuda_kernels_apply_deferred, cuda_quant_weight

INT4_CPU_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes torch's CPU int4 op takes
INT4_CPU_DTYPES = (torch.bfloat16,)  # the dtypes it is used for: the one its x86 kernels vectorize
INT4_CPU_OUT_MULTIPLE = 16  # its repacking takes a multiple of 16 output features
# Products of more tokens than this dequantize W and multiply densely. Measured on a 2-core Sapphire Rapids VM (AMX)
# with the default model's shapes (a decoder layer's four products, 3.5M weights): the op takes ~45 us a token,
# dequantizing ~3.3 ms once and the bfloat16 product after it ~11 us a token, so the two cross between 64 and 96
# tokens (bench/int4_cpu_products.py; bench/RESULTS.md, 2026-12-07).
INT4_CPU_OP_MAX_TOKENS = 80
DEQUANTIZE_ROWS = 1024  # rows dequantized at a time, in float32 (bounds the temporary memory)


def int4_cpu_op_available() -> bool:
    """Whether this torch has the CPU int4 ops in their torch 2.6 form (codes in as [out, in] int32, repacked to
    [out, in / 2] uint8; x, scales and zeros in one dtype). Earlier releases had ops of other names and layouts,
    which are not used."""
    return (hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., n] (values 0-15, n even) -> [..., n / 2] uint8: column 2j in the low nibble, 2j + 1 in the high."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """``pack_int4`` undone: [..., n / 2] uint8 -> [..., n] uint8 codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """W = (q - 8) * s + z in the scales' dtype, computed in float32 a block of rows at a time."""
    rows, groups = scales.shape
    weight = torch.empty(rows, groups * group_size, dtype=scales.dtype, device=scales.device)
    for start in range(0, rows, DEQUANTIZE_ROWS):
        part = slice(start, start + DEQUANTIZE_ROWS)
        codes = unpack_int4(qweight[part]).float().sub_(8).unflatten(1, (groups, group_size))
        values = codes.mul_(scales[part].float().unsqueeze(-1)).add_(zeros[part].float().unsqueeze(-1))
        weight[part] = values.flatten(1)
    return weight


class Int4LinearMethod(LinearMethod):
    """``group_size``: the input columns that share a scale and a zero (32 for GGUF's Q4 blocks, 128 for most AWQ
    and GPTQ checkpoints); even, so that a byte's two codes share their group. ``float32_in_bfloat16``: in a
    float32 model on the CPU, run the int4 op in bfloat16 (x cast in and the product cast back; the scales and
    zeros rounded to bfloat16) rather than dequantize W to float32."""

    def __init__(self, group_size: int, float32_in_bfloat16: bool = False):
        if group_size < 2 or group_size % 2:
            raise ValueError(f"an int4 group size must be even and positive, not {group_size}")
        self.group_size = group_size
        self.float32_in_bfloat16 = float32_in_bfloat16

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        check_group_alignment(layer, self.group_size, "int4")
        out_features, groups = layer.out_features, layer.in_features // self.group_size
        layer.int4_packed = None  # the CPU op's operands (process_after_loading)
        layer.int4_scales_zeros = None
        layer.int4_offsets = None  # z - 8 s per group in float32, for the CPU products that dequantize
        layer.dequantized_weight = None  # W in the compute dtype, where the op is not used
        layer.quant_weight = None  # what the CUDA kernels read (process_after_loading)
        layer.add_param("qweight", (out_features, layer.in_features // 2), torch.uint8, WeightLayout(0, 1, 1, 2))
        layer.add_param("scales", (out_features, groups), dtype, WeightLayout(0, 1, 1, self.group_size))
        layer.add_param("zeros", (out_features, groups), dtype, WeightLayout(0, 1, 1, self.group_size))

    @torch.no_grad()
    def process_after_loading(self, layer: nn.Module) -> None:
        group_size, out_features, in_features = self.group_size, layer.out_features, layer.in_features
        if in_features % group_size:
            raise ValueError(f"{in_features} input features do not divide into int4 groups of {group_size}")
        groups = (out_features, in_features // group_size)
        check_param(layer, "qweight", (out_features, in_features // 2), (torch.uint8,), "int4")
        check_param(layer, "scales", groups, (torch.float32, torch.bfloat16, torch.float16), "int4")
        check_param(layer, "zeros", groups, (layer.scales.dtype,), "int4")
        layer.int4_packed = layer.int4_scales_zeros = layer.int4_offsets = layer.dequantized_weight = None
        layer.quant_weight = cuda_quant_weight(layer.qweight, layer.scales, layer.zeros, 4, group_size)
        if layer.quant_weight is None and self.uses_cpu_op(layer):
            prepare_cpu_int4(layer, self._op_dtype(layer.scales.dtype))
        elif layer.quant_weight is None:
            layer.dequantized_weight = dequantize_int4(layer.qweight, layer.scales, layer.zeros, group_size)

    def uses_cpu_op(self, layer: nn.Module) -> bool:
        """Whether the layer's products go through torch's CPU int4 op (after loading, by its parameters)."""
        return (layer.qweight.device.type == "cpu" and int4_cpu_op_available()
                and self.group_size in INT4_CPU_GROUP_SIZES
                and self._op_dtype(layer.scales.dtype) in INT4_CPU_DTYPES
                and layer.out_features % INT4_CPU_OUT_MULTIPLE == 0)

    def _op_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the CPU op would run in for a model computing in ``dtype``."""
        return torch.bfloat16 if dtype == torch.float32 and self.float32_in_bfloat16 else dtype

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.quant_weight is not None:
            return cuda_kernels_apply(layer.quant_weight, x, bias)
        if layer.int4_packed is None:
            return F.linear(x, layer.dequantized_weight, bias)
        return cpu_int4_product(layer, x, bias, self.group_size)

    def apply_deferred(self, layer: nn.Module, x: torch.Tensor, partials_ok: bool = True) -> LinearOutput:
        if layer.quant_weight is not None:
            return cuda_kernels_apply_deferred(layer.quant_weight, x, layer.bias, partials_ok)
        return LinearOutput(self.apply(layer, x, layer.bias))


# ----------------------------------------------------------------------------- the CPU products


def prepare_cpu_int4(layer: nn.Module, op_dtype: torch.dtype) -> None:
    """The operands of the CPU products: the op's repacked codes and its [groups, out, 2] scales and zeros in
    ``op_dtype``, and for the dense path each group's offset z - 8 s in float32 (W = q s + offset)."""
    layer.int4_packed, layer.int4_scales_zeros = int4_op_operands(unpack_int4(layer.qweight), layer.scales,
                                                                  layer.zeros, op_dtype)
    layer.int4_offsets = layer.zeros.float() - 8 * layer.scales.float()


def int4_op_operands(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     op_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [out, in] (0-15) and scales and zeros [out, groups] as torch's CPU int4 op takes them: the codes
    repacked, the scales and zeros as [groups, out, 2] in ``op_dtype``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)  # innerKTiles
    return packed, torch.stack((scales.t(), zeros.t()), dim=-1).to(op_dtype).contiguous()


def cpu_int4_product(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """x W^T + bias on the CPU: torch's int4 op up to ``INT4_CPU_OP_MAX_TOKENS`` tokens, W dequantized past it."""
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] > INT4_CPU_OP_MAX_TOKENS:
        out = cpu_dequantized_product(layer, x2d, group_size)
    else:
        op_dtype = layer.int4_scales_zeros.dtype
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2d.to(op_dtype).contiguous(), layer.int4_packed,
                                                         group_size, layer.int4_scales_zeros)
    out = out.to(x.dtype)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out.shape[-1])


def cpu_dequantized_product(layer: nn.Module, x2d: torch.Tensor, group_size: int) -> torch.Tensor:
    """x W^T with W dequantized into this thread's scratch buffers, in bfloat16 where ``dense_bfloat16`` says so.

    The codes are unpacked without interleaving them again (a strided write of bytes is the slow part): every
    byte's low nibbles (W's even columns) first, then its high ones (the odd columns), and x's columns are put in
    the same order, so the product is unchanged. A group of ``group_size`` columns is then ``group_size / 2``
    columns in each half, and W = q s + (z - 8 s) is computed in float32 and rounded once."""
    rows, cols = layer.out_features, layer.in_features
    half, groups = cols // 2, cols // group_size
    codes = _scratch("codes", (rows, 2, half), torch.uint8)
    torch.bitwise_and(layer.qweight, 15, out=codes[:, 0])
    torch.bitwise_right_shift(layer.qweight, 4, out=codes[:, 1])
    values = _scratch("values", (rows, cols), torch.float32)
    values.copy_(codes.view(rows, cols))
    by_group = values.view(rows, 2, groups, group_size // 2)
    by_group.mul_(layer.scales.view(rows, 1, groups, 1)).add_(layer.int4_offsets.view(rows, 1, groups, 1))
    dtype = torch.bfloat16 if dense_bfloat16() else torch.float32
    weight = values if dtype == torch.float32 else _scratch("weight", (rows, cols), dtype).copy_(values)
    tokens = x2d.shape[0]
    xs = torch.empty(tokens, 2, half, dtype=dtype)
    xs.copy_(x2d.reshape(tokens, half, 2).transpose(1, 2))  # even columns, then odd ones
    return F.linear(xs.view(tokens, cols), weight)


def dense_bfloat16() -> bool:
    """Whether oneDNN multiplies bfloat16 on this CPU in its own kernels (AVX-512 or AMX); elsewhere a dequantized
    W is multiplied in float32."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check is not None and torch.backends.mkldnn.is_available() and check())


_SCRATCH = threading.local()  # the dense path's buffers, by name: as large as the largest layer yet


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    buffer = getattr(_SCRATCH, name, None)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable in and outside inference mode alike
            buffer = torch.empty(numel, dtype=dtype)
        setattr(_SCRATCH, name, buffer)
    return buffer[:numel].view(shape)


def check_group_alignment(layer: nn.Module, group_size: int, kind: str) -> None:
    """Groups of input columns can be split over ranks only whole: the layer's input features, and the first of
    this rank's columns, must be multiples of the group size."""
    if layer.in_features % group_size:
        raise ValueError(f"{layer.in_features} input features do not divide into {kind} groups of {group_size}")
    for part in layer.parts.values():
        if part.source_cols is not None and part.source_cols[0] % group_size:
            raise ValueError(f"this rank's columns start at {part.source_cols[0]}, inside a {kind} group of "
                             f"{group_size}; this split of a group-quantized checkpoint is not supported")


def check_param(layer: nn.Module, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
                kind: str) -> None:
    param = getattr(layer, name)
    if tuple(param.shape) != shape or param.dtype not in dtypes:
        allowed = " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"an {kind} linear layer needs a {shape} {allowed} {name}, has {tuple(param.shape)} "
                         f"{str(param.dtype).removeprefix('torch.')}")


# ----------------------------------------------------------------------------- a weight without a layer: LM heads


# Greedy tokens of up to this many rows come from the op (a decode step's sampled rows); more multiply by the dense
# weight. The default model's Q8_0 head (49,152 x 576, two planes) on a 2-core VM: the op ~1.4 ms a row plus ~0.4 ms
# each further row, the float32 product ~2.7 ms for 1 to 4 rows (more where the layers' weights left the caches).
INT4_HEAD_MAX_TOKENS = 4


class CpuInt4OpWeight:
    """x W^T through torch's CPU int4 op for a weight held only as the op's operands, in bfloat16: a GGUF LM head's
    copy, which finds greedy tokens (``greedy_tokens``).

    Built from the int4 form (codes in [0, 15], W = (q - 8) s + z; ``from_int4``) or from an int8 form (codes q in
    [-128, 127], W = q s + z; ``from_int8``), which is held exactly as two 4-bit planes along K: with q + 128 =
    16 h + l (h, l in [0, 15]), W = (h - 8)(16 s) + (l - 8) s + (8 s + z), so the product of [x, x] with the
    planes [h | l] (scales 16 s and s, zeros 0 and 8 s + z) is x W^T: 8 bits a weight, read once.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, planes: int,
                 term_bounds: torch.Tensor):
        self.packed, self.scales_zeros = int4_op_operands(codes, scales, zeros, torch.bfloat16)
        self.group_size, self.planes = group_size, planes
        self.out_features = codes.shape[0]
        # [in / group, out] float32: per group of W's columns, the largest magnitude a term of the op's dequantized
        # sum takes ((q - 8) s and z of each plane), which bounds what rounding them to bfloat16 costs
        self.term_bounds = term_bounds.t().contiguous()

    @staticmethod
    def usable(out_features: int, group_size: int) -> bool:
        return (int4_cpu_op_available() and group_size in INT4_CPU_GROUP_SIZES
                and out_features % INT4_CPU_OUT_MULTIPLE == 0)

    @classmethod
    def from_int4(cls, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int) -> CpuInt4OpWeight:
        """From ``Int4LinearMethod``'s parameters: packed codes [out, in / 2], scales and zeros [out, groups]."""
        bounds = 8 * scales.float().abs() + zeros.float().abs()
        return cls(unpack_int4(qweight), scales, zeros, group_size, 1, bounds)

    @classmethod
    def from_int8(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  group_size: int) -> CpuInt4OpWeight:
        """From ``Int8LinearMethod``'s form: codes [out, in] int8, scales and zeros (or None) [out, groups]."""
        shifted = codes.to(torch.int32) + 128
        planes = torch.cat((shifted >> 4, shifted & 15), dim=1)  # [out, 2 * in]: the high plane, then the low
        scales = scales.float()
        low_zeros = 8 * scales + (zeros.float() if zeros is not None else 0)
        plane_scales = torch.cat((16 * scales, scales), dim=1)
        plane_zeros = torch.cat((torch.zeros_like(scales), low_zeros), dim=1)
        bounds = 136 * scales.abs() + low_zeros.abs()  # |h - 8| 16 |s| + |l - 8| |s| + |8 s + z|
        return cls(planes, plane_scales, plane_zeros, group_size, 2, bounds)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] -> x W^T [n, out] in x's dtype."""
        xb = x.to(torch.bfloat16)
        if self.planes == 2:
            xb = torch.cat((xb, xb), dim=-1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), self.packed, self.group_size,
                                                         self.scales_zeros)
        return out.to(x.dtype)

    def error_bounds(self, x: torch.Tensor, products: torch.Tensor) -> torch.Tensor:
        """[n, out] float32: bounds on |products - x W^T| for this op's ``products`` of ``x``. Rounding x, the scales
        and zeros, the dequantized terms and the outputs to bfloat16 each errs by at most 2^-9 of what is rounded:
        3 * 2^-9 * sum_k |x_k| (term bound of k's group) for the first three, 2^-8 |product| for the last, doubled
        for the float32 sums' own rounding and a margin."""
        x_groups = x.float().abs().view(x.shape[0], -1, self.group_size).sum(-1)  # [n, in / group]
        return 2 * (3 * 2.0**-9 * (x_groups @ self.term_bounds) + 2.0**-8 * products.abs())

    def greedy_tokens(self, x: torch.Tensor, dense_weight: torch.Tensor) -> torch.Tensor:
        """argmax_v (x W^T)[:, v] for x [n, in], exactly as from the dense float ``dense_weight`` [out, in] (ties to
        the lowest column, as torch.argmax): the op's products and their error bounds leave the rows a few
        candidates each (those whose upper bound reaches the best lower bound), which are multiplied exactly."""
        approx = self(x).float()
        bounds = self.error_bounds(x, approx)
        floor = (approx - bounds).amax(dim=-1, keepdim=True)
        rows, cols = torch.nonzero(approx + bounds >= floor, as_tuple=True)  # row-major: columns ascending per row
        exact = (x[rows].to(dense_weight.dtype) * dense_weight[cols]).sum(-1)
        best = torch.full((x.shape[0],), float("-inf"), dtype=exact.dtype).scatter_reduce(0, rows, exact, "amax")
        # The first candidate column of each row reaching its row's best value.
        hits = exact == best[rows]
        first = torch.full((x.shape[0],), dense_weight.shape[0], dtype=torch.int64)
        first = first.scatter_reduce(0, rows[hits], cols[hits], "amin")
        if bool((first == dense_weight.shape[0]).any()):  # no candidate: a NaN in the row; as torch.argmax does
            return F.linear(x.to(dense_weight.dtype), dense_weight).argmax(dim=-1)
        return first
