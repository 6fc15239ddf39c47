"""GGUF's quantized blocks as the int4 and int8 linear methods hold them (``engine.models.linear.int4`` and
``int8``), so that a GGUF file's Q4_0, Q4_1 and Q8_0 weights can be served without dequantizing them.

Input: a tensor's data as ``gguf.GGUFReader`` gives it, uint8 [..., rows' bytes] (for a weight, [out, in / 32 *
block bytes]). Every block covers 32 consecutive elements of a row and starts with its float16 scale d:

    Q4_0  18 bytes: d, then 16 bytes of codes: byte j holds element j (low nibble) and j + 16 (high); W = d (q - 8)
    Q4_1  20 bytes: d, the float16 minimum m, 16 bytes of codes as Q4_0's; W = d q + m
    Q8_0  34 bytes: d, then 32 int8 codes; W = d q

Output, with the leading dims of the input and float32 scales and zeros (a loader casts them to the compute dtype):

    q4_0_to_int4, q4_1_to_int4  (qweight [..., in / 2] uint8 as ``pack_int4`` packs it, scales [..., in / 32],
                                 zeros [..., in / 32]): W = (q - 8) * s + z, so Q4_0's z = 0, Q4_1's z = m + 8 d
    q8_0_to_int8                (qweight [..., in] int8, scales [..., in / 32]): W = q * s

Pure functions of the bytes: nothing is read from a file here.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.models.linear import pack_int4

GGUF_BLOCK = 32  # elements a block of Q4_0, Q4_1 and Q8_0


def q4_0_to_int4(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = _blocks(data, 18, "Q4_0")
    scales = _float16(blocks[..., 0:2])
    codes = _nibbles(blocks[..., 2:18])
    return _packed(codes, data), _out(scales, data), _out(np.zeros_like(scales), data)


def q4_1_to_int4(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = _blocks(data, 20, "Q4_1")
    scales, minimum = _float16(blocks[..., 0:2]), _float16(blocks[..., 2:4])
    codes = _nibbles(blocks[..., 4:20])
    return _packed(codes, data), _out(scales, data), _out(minimum + np.float32(8) * scales, data)


def q8_0_to_int8(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(data, 34, "Q8_0")
    scales = _float16(blocks[..., 0:2])
    codes = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8).reshape(blocks.shape[0], -1)
    return _out(codes, data), _out(scales, data)


INT4_BLOCK_TYPES = {"Q4_0": q4_0_to_int4, "Q4_1": q4_1_to_int4}  # by ``GGMLQuantizationType`` name
INT8_BLOCK_TYPES = {"Q8_0": q8_0_to_int8}


def _blocks(data: np.ndarray, block_bytes: int, name: str) -> np.ndarray:
    """[..., bytes] -> [rows, blocks, block_bytes] uint8."""
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim == 0 or data.shape[-1] % block_bytes:
        raise ValueError(f"{name} data must be uint8 with rows of whole {block_bytes}-byte blocks, is "
                         f"{data.dtype} {data.shape}")
    return data.reshape(-1, data.shape[-1] // block_bytes, block_bytes)


def _float16(raw: np.ndarray) -> np.ndarray:
    """[rows, blocks, 2] bytes -> [rows, blocks] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] bytes -> [rows, blocks * 32] codes in element order: a block's low nibbles are its first
    16 elements, its high nibbles the next 16."""
    return np.concatenate((raw & 15, raw >> 4), axis=-1).reshape(raw.shape[0], -1)


def _packed(codes: np.ndarray, data: np.ndarray) -> torch.Tensor:
    """[rows, n] codes -> [..., n / 2] uint8 as ``pack_int4`` packs them."""
    return pack_int4(_out(codes, data))


def _out(values: np.ndarray, data: np.ndarray) -> torch.Tensor:
    """[rows, n] -> a tensor of the input's leading dims."""
    return torch.from_numpy(np.ascontiguousarray(values).reshape(*np.shape(data)[:-1], values.shape[-1]))
