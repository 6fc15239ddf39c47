"""The paged KV cache tensors: K and V for every layer, addressed by block id and slot.

One tensor holds everything::

    kv[layer, 0 (K) | 1 (V), block_id, slot_in_block, kv_head, head_dim]

A block id names the same slot range in every layer, so one block table serves all
layers. Under tensor parallelism each rank builds its own cache with its share of the
KV heads (``num_kv_heads`` is the per-rank count).

An FP8 cache (``dtype=torch.float8_e4m3fn``) stores each token's K and V rows quantized per
KV head, with one float32 scale per (token, head) beside them::

    scales[layer, 0 (K) | 1 (V), block_id, slot_in_block, kv_head]
    K[..., d] ~= float(kv[layer, 0, ..., d]) * scales[layer, 0, ...]

The scale is the row's absolute maximum over 448 (float8_e4m3's largest value), computed when
the token is written, so no calibration is needed and an outlier in one token or head costs
nothing elsewhere. A block's scales travel with it: prefix hits and copies see the same values.

K is stored rotated (``rotate_heads``): each head's row times the normalized Hadamard matrix
H / sqrt(head_dim), which is orthogonal, and every reader rotates its queries the same way, so
q . k is unchanged. Keys have a few large channels that barely change from token to token (the
slow rotary frequencies); float8_e4m3 rounds each value to 3 mantissa bits, so those channels
carry most of the error. Rotated, every channel mixes all of them. On the default model the FP8
cache's perplexity cost went from +2.3% to -0.1% (``tests/test_fp8_accuracy.py``); offsets
calibrated per channel, or 4 scales per row, reached +0.7-1.9%. V, already close to its float32
result in FP8, is stored as it is. Head dims that are not powers of two are not rotated.
"""

from __future__ import annotations

import functools

import torch

_GIB = 1024**3
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPE = torch.float32


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (float8_e4m3 values, float32 scales of shape ``x.shape[:-1]``): each row of the last dim scaled so that
    its absolute maximum maps to 448, so ``values * scales[..., None]`` gives it back. The one rounding the FP8 KV
    cache (a row per token and head) and the FP8 linears (a row per weight channel or activation token) share.
    ``amax`` (float32, ``x.shape[:-1]``, at least each row's own): the maxima to scale by instead, for rows whose
    other columns are elsewhere (a tensor-parallel rank's share of a weight's input columns)."""
    x32 = x.float()
    if amax is None:
        amax = x32.abs().amax(dim=-1)
    scales = (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (x32 / scales[..., None]).to(FP8_DTYPE), scales


def rotates_keys(head_dim: int) -> bool:
    """Whether an FP8 cache stores keys of this head dim rotated (a power of two: Sylvester's Hadamard matrix)."""
    return head_dim > 0 and head_dim & (head_dim - 1) == 0


@functools.lru_cache(maxsize=None)
def hadamard(head_dim: int, device: torch.device) -> torch.Tensor:
    """Sylvester's [head_dim, head_dim] matrix of +-1, float32: entry (i, j) is -1 where ``i & j`` has an odd
    number of set bits. Symmetric, and H @ H = head_dim * I."""
    idx = torch.arange(head_dim)
    both = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(both)
    while bool(both.any()):
        parity ^= both & 1
        both = both >> 1
    return (1 - 2 * parity).float().to(device)


def rotate_heads(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., head_dim] times H / sqrt(head_dim) (``hadamard``), in float32: what an FP8 cache stores for K,
    and the queries that read it. Unchanged where ``rotates_keys`` is false."""
    head_dim = x.shape[-1]
    if not rotates_keys(head_dim):
        return x.float()
    return (x.float() @ hadamard(head_dim, x.device)) * head_dim**-0.5


@functools.lru_cache(maxsize=None)
def _fp8_values(device: torch.device) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float().to(device)


def fp8_to_float32(x: torch.Tensor) -> torch.Tensor:
    """``x.float()`` for a float8_e4m3 tensor; on the CPU through a 256-entry table indexed by the bytes, 1.7x as
    fast as the element-wise conversion there."""
    if x.device.type != "cpu":
        return x.float()
    return _fp8_values(x.device).index_select(0, x.view(torch.uint8).reshape(-1).int()).view(x.shape)


class PagedKVCache:
    """The KV tensors of all layers, allocated once and zero-initialised.

    Zeros rather than uninitialised memory: attention masks unused slots by
    multiplying with zero weights, and 0 * NaN garbage would still be NaN.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        _check_positive(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )
        # [num_layers, 2, num_blocks, block_size, num_kv_heads]: an FP8 cache's dequantization scales
        self.scales: torch.Tensor | None = None
        if is_fp8(dtype):
            self.scales = torch.ones((num_layers, 2, num_blocks, block_size, num_kv_heads), dtype=SCALE_DTYPE,
                                     device=device)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer: views into ``kv``, each contiguous
        ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer {layer_idx} out of range for {self.num_layers} layers")
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scales, v_scales) of one layer, each ``[num_blocks, block_size, num_kv_heads]`` float32, for
        an FP8 cache; None otherwise."""
        if self.scales is None:
            return None
        self.layer(layer_idx)  # the range check
        return self.scales[layer_idx, 0], self.scales[layer_idx, 1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks, every layer's K and V (and scales): ``(source, destination)`` block ids
        (copy-on-write)."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long).to(self.kv.device, non_blocking=True)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long).to(self.kv.device, non_blocking=True)
        # Through a byte view: indexed copies of float8 tensors are not implemented everywhere.
        kv = self.kv.view(torch.uint8) if is_fp8(self.dtype) else self.kv
        kv[:, :, dst] = kv[:, :, src]
        if self.scales is not None:
            self.scales[:, :, dst] = self.scales[:, :, src]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors (the scales included)."""
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.kv.numel() * self.kv.element_size() + scales

    def bytes_per_block_all_layers(self) -> int:
        """Bytes of one of this cache's blocks across all layers, K and V (and scales)."""
        return self.nbytes // self.num_blocks

    @property
    def num_slots(self) -> int:
        """Token slots across all blocks, the null block included."""
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """One line for start-up logs, e.g. ``2048 blocks x 16 tokens = 32768 tokens, 3.50 GiB``."""
        text = (f"{self.num_blocks} blocks x {self.block_size} tokens = {self.num_slots} tokens, "
                f"{self.nbytes / _GIB:.2f} GiB")
        if self.scales is not None:
            rotated = ", K rotated by a Hadamard matrix" if rotates_keys(self.kv.shape[-1]) else ""
            text += f" (float8_e4m3 K/V with a float32 scale per token and KV head{rotated})"
        return text

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V (and an FP8 cache's scales)."""
        _check_positive(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
        element_bytes = torch.empty((), dtype=dtype).element_size()
        row_bytes = head_dim * element_bytes + (SCALE_DTYPE.itemsize if is_fp8(dtype) else 0)
        return 2 * num_layers * block_size * num_kv_heads * row_bytes

    @staticmethod
    def num_blocks_for_budget(
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many whole blocks fit in ``budget_bytes`` (floor). At least 2 must fit:
        block 0 is reserved, so fewer could not hold a single request."""
        bytes_per_block = PagedKVCache.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        num_blocks = int(budget_bytes) // bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"KV cache budget of {int(budget_bytes)} bytes ({budget_bytes / _GIB:.2f} GiB) fits {num_blocks} "
                f"blocks of {bytes_per_block} bytes each; at least 2 are needed (block 0 is reserved). "
                "Free more memory or lower block_size."
            )
        return num_blocks


def _check_positive(**sizes: int) -> None:
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
