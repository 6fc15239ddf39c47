"""GGUF's K-quants Q4_K, Q5_K and Q6_K as the int4 and int8 linear methods hold them (the blocks of 32, and the
conventions of the output, are ``engine.loading.gguf_blocks``'s).

A K-quant block is a super-block of 256 consecutive elements of a row, cut into sub-blocks with a 6- or 8-bit
scale each, under float16 super-block scales:

    Q4_K  144 bytes: d, dmin (float16), 12 bytes of eight 6-bit scales sc and mins m, 128 bytes of codes: bytes
          32c to 32c + 31 hold sub-block 2c (low nibbles) and 2c + 1 (high nibbles); sub-blocks of 32:
          W = d sc q - dmin m
    Q5_K  176 bytes: d, dmin, the scales and mins as Q4_K's, 32 bytes of high bits (bit s of byte l: element l of
          sub-block s), 128 bytes of low nibbles as Q4_K's codes; sub-blocks of 32: W = d sc q - dmin m
    Q6_K  210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales sc, d (float16 last); each
          half of 128 elements takes 64 nibble bytes (byte l: element l low, l + 64 high) and 32 pair bytes
          (bits 2k, 2k + 1 of byte l: element 32k + l); sub-blocks of 16: W = d sc (q - 32)

The 12 bytes of scales and mins: bytes 0-3 hold sc 0-3 (low 6 bits) and the top 2 bits of sc 4-7, bytes 4-7 m 0-3
and the top bits of m 4-7, bytes 8-11 the low 4 bits of sc 4-7 (low nibble) and of m 4-7 (high).

    q4_k_to_int4   codes q, s = d sc, z = 8 s - dmin m (W = (q - 8) s + z), groups of 32
    q4_k_to_int8, q5_k_to_int8   codes q, s = d sc, z = -dmin m, groups of 32
    q6_k_to_int8   codes q - 32, s = d sc, no zeros, groups of 16

d sc and dmin m are exact in float32 (11 bits of mantissa times 6 or 8), and so is a code times s: the int8 forms
give exactly the weights ``gguf`` dequantizes. The int4 form of Q4_K adds z = 8 s - dmin m, itself rounded where
the two terms lie far apart: over random codes, scales and mins every weight is exact while dmin / d stays
between about 2^-4 and 2^10 (a quantizer's is near 8, the mins cancelling the codes' mean); beyond, a weight can
be one float32 rounding away.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.loading.gguf_blocks import blocks_of, float16, out, packed

K_BLOCK = 256  # elements a K-quant super-block


def q4_k_to_int4(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, scales, mins = _q4_k(data)
    return packed(codes, data), out(scales, data), out(np.float32(8) * scales - mins, data)


def q4_k_to_int8(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, scales, mins = _q4_k(data)
    return out(codes.astype(np.int8), data), out(scales, data), out(-mins, data)


def q5_k_to_int8(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    blocks = blocks_of(data, 176, "Q5_K")
    scales, mins = _scales_mins(blocks)
    high = (blocks[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [rows, blocks, 8, 32]
    codes = _sub_block_nibbles(blocks[..., 48:176]) | (high.reshape(blocks.shape[0], -1) << 4)
    return out(codes.astype(np.int8), data), out(scales, data), out(-mins, data)


def q6_k_to_int8(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, None]:
    blocks = blocks_of(data, 210, "Q6_K")
    rows, count = blocks.shape[:2]
    low = blocks[..., 0:128].reshape(rows, count, 2, 64)  # per half: byte l, elements l and l + 64
    low = np.stack((low & 15, low >> 4), axis=-2)  # [rows, blocks, half, 2, 64]: elements 0-63, 64-127
    pairs = blocks[..., 128:192].reshape(rows, count, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    codes = low.reshape(rows, -1) | ((pairs & 3).reshape(rows, -1) << 4)
    sub_scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, blocks, 16]
    scales = float16(blocks[..., 208:210])[..., None] * sub_scales
    return out(codes.astype(np.int8) - np.int8(32), data), out(scales.reshape(rows, -1), data), None


def _q4_k(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K -> codes [rows, in] (0-15), d sc and dmin m [rows, in / 32] float32."""
    blocks = blocks_of(data, 144, "Q4_K")
    scales, mins = _scales_mins(blocks)
    return _sub_block_nibbles(blocks[..., 16:144]), scales, mins


def _scales_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's [rows, blocks, bytes] -> d sc and dmin m, [rows, blocks * 8] float32."""
    packed_bytes = blocks[..., 4:16]
    low, high, rest = packed_bytes[..., 0:4], packed_bytes[..., 4:8], packed_bytes[..., 8:12]
    sc = np.concatenate((low & 63, (rest & 15) | (low >> 6 << 4)), axis=-1)
    m = np.concatenate((high & 63, (rest >> 4) | (high >> 6 << 4)), axis=-1)
    d, dmin = float16(blocks[..., 0:2])[..., None], float16(blocks[..., 2:4])[..., None]
    rows = blocks.shape[0]
    return (d * sc.astype(np.float32)).reshape(rows, -1), (dmin * m.astype(np.float32)).reshape(rows, -1)


def _sub_block_nibbles(raw: np.ndarray) -> np.ndarray:
    """[rows, blocks, 128] bytes -> [rows, blocks * 256] codes: chunk c of 32 bytes holds sub-block 2c in its low
    nibbles, 2c + 1 in its high ones."""
    chunks = raw.reshape(*raw.shape[:2], 4, 1, 32)
    return np.concatenate((chunks & 15, chunks >> 4), axis=-2).reshape(raw.shape[0], -1)
