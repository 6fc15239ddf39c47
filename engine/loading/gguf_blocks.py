"""GGUF's quantized blocks as the int4 and int8 linear methods hold them (``engine.models.linear.int4`` and
``int8``), so that a GGUF file's weights can be served without dequantizing them: the blocks of 32 here (Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0), the K-quants' super-blocks of 256 in ``engine.loading.gguf_kquants``.

Input: a tensor's data as ``gguf.GGUFReader`` gives it, uint8 [..., rows' bytes] (for a weight, [out, in / 32 *
block bytes]). Every block covers 32 consecutive elements of a row and starts with its float16 scale d:

    Q4_0  18 bytes: d, then 16 bytes of codes: byte j holds element j (low nibble) and j + 16 (high); W = d (q - 8)
    Q4_1  20 bytes: d, the float16 minimum m, 16 bytes of codes as Q4_0's; W = d q + m
    Q5_0  22 bytes: d, 4 bytes of high bits (bit j of the little-endian word: element j's fifth bit), 16 bytes
          of low nibbles as Q4_0's; W = d (q - 16)
    Q5_1  24 bytes: d, m, then the high bits and nibbles as Q5_0's; W = d q + m
    Q8_0  34 bytes: d, then 32 int8 codes; W = d q

Output, with the leading dims of the input and float32 scales and zeros (a loader casts them to the compute dtype):

    *_to_int4  (qweight [..., in / 2] uint8 as ``pack_int4`` packs it, scales [..., in / 32], zeros [..., in / 32]):
               W = (q - 8) * s + z, so Q4_0's z = 0, Q4_1's z = m + 8 d
    *_to_int8  (qweight [..., in] int8, scales [..., in / group], zeros [..., in / group] or None): W = q * s + z,
               the codes the block's own less its offset (Q4_0's q - 8, Q5_0's q - 16), s = d, z = m or none

Every type that converts to int4 converts to int8 too (a fused layer whose parts are of different types holds them
all in int8). In float32 the int8 forms give exactly the weights ``gguf`` dequantizes: a code times a float16
scale is exact, and z is added once, as ``gguf`` adds m. The int4 form of Q4_1 adds z = m + 8 d, itself rounded
where m and 8 d lie far apart in magnitude (a quantizer makes m about -8 d), so a weight can be one float32
rounding away there (as Q4_K's, ``gguf_kquants``).

Pure functions of the bytes: nothing is read from a file here.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.models.linear import pack_int4

GGUF_BLOCK = 32  # elements a block of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0


def q4_0_to_int4(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = blocks_of(data, 18, "Q4_0")
    scales = float16(blocks[..., 0:2])
    codes = _nibbles(blocks[..., 2:18])
    return packed(codes, data), out(scales, data), out(np.zeros_like(scales), data)


def q4_1_to_int4(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = blocks_of(data, 20, "Q4_1")
    scales, minimum = float16(blocks[..., 0:2]), float16(blocks[..., 2:4])
    codes = _nibbles(blocks[..., 4:20])
    return packed(codes, data), out(scales, data), out(minimum + np.float32(8) * scales, data)


def q4_0_to_int8(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, None]:
    blocks = blocks_of(data, 18, "Q4_0")
    codes = _nibbles(blocks[..., 2:18]).astype(np.int8) - np.int8(8)
    return out(codes, data), out(float16(blocks[..., 0:2]), data), None


def q4_1_to_int8(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = blocks_of(data, 20, "Q4_1")
    codes = _nibbles(blocks[..., 4:20]).astype(np.int8)
    return out(codes, data), out(float16(blocks[..., 0:2]), data), out(float16(blocks[..., 2:4]), data)


def q5_0_to_int8(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, None]:
    blocks = blocks_of(data, 22, "Q5_0")
    codes = _five_bits(blocks[..., 2:6], blocks[..., 6:22]).astype(np.int8) - np.int8(16)
    return out(codes, data), out(float16(blocks[..., 0:2]), data), None


def q5_1_to_int8(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = blocks_of(data, 24, "Q5_1")
    codes = _five_bits(blocks[..., 4:8], blocks[..., 8:24]).astype(np.int8)
    return out(codes, data), out(float16(blocks[..., 0:2]), data), out(float16(blocks[..., 2:4]), data)


def q8_0_to_int8(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, None]:
    blocks = blocks_of(data, 34, "Q8_0")
    codes = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(blocks.shape[0], -1)
    return out(codes, data), out(float16(blocks[..., 0:2]), data), None


def blocks_of(data: np.ndarray, block_bytes: int, name: str) -> np.ndarray:
    """[..., bytes] -> [rows, blocks, block_bytes] uint8."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim == 0 or data.shape[-1] % block_bytes:
        raise ValueError(f"{name} data must be uint8 with rows of whole {block_bytes}-byte blocks, is "
                         f"{data.dtype} {data.shape}")
    return data.reshape(-1, data.shape[-1] // block_bytes, block_bytes)


def float16(raw: np.ndarray) -> np.ndarray:
    """[rows, blocks, 2] bytes -> [rows, blocks] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] bytes -> [rows, blocks * 32] codes in element order: a block's low nibbles are its first
    16 elements, its high nibbles the next 16."""
    return np.concatenate((raw & 15, raw >> 4), axis=-1).reshape(raw.shape[0], -1)


def _five_bits(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """Q5's [rows, blocks, 4] high bits and [rows, blocks, 16] nibbles -> [rows, blocks * 32] codes 0-31."""
    fifth = np.unpackbits(np.ascontiguousarray(high), axis=-1, bitorder="little")  # [rows, blocks, 32]
    return _nibbles(low) | (fifth.reshape(high.shape[0], -1) << 4)


def packed(codes: np.ndarray, data: np.ndarray) -> torch.Tensor:
    """[rows, n] codes -> [..., n / 2] uint8 as ``pack_int4`` packs them."""
    return pack_int4(out(codes, data))


def out(values: np.ndarray, data: np.ndarray) -> torch.Tensor:
    """[rows, n] -> a tensor of the input's leading dims."""
    return torch.from_numpy(np.ascontiguousarray(values).reshape(*np.shape(data)[:-1], values.shape[-1]))
