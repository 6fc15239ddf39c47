"""The paged KV cache tensors: K and V for every layer, addressed by block id and slot.

One tensor holds everything::

    kv[layer, 0 (K) | 1 (V), block_id, slot_in_block, kv_head, head_dim]

A block id names the same slot range in every layer, so one block table serves all
layers. Under tensor parallelism each rank builds its own cache with its share of the
KV heads (``num_kv_heads`` is the per-rank count).
"""

from __future__ import annotations

import torch

_GIB = 1024**3


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

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer: views into ``kv``, each contiguous
        ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer {layer_idx} out of range for {self.num_layers} layers")
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks, every layer's K and V: ``(source, destination)`` block ids (copy-on-write)."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long).to(self.kv.device, non_blocking=True)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long).to(self.kv.device, non_blocking=True)
        self.kv[:, :, dst] = self.kv[:, :, src]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensor."""
        return self.kv.numel() * self.kv.element_size()

    @property
    def num_slots(self) -> int:
        """Token slots across all blocks, the null block included."""
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """One line for start-up logs, e.g. ``2048 blocks x 16 tokens = 32768 tokens, 3.50 GiB``."""
        return (
            f"{self.num_blocks} blocks x {self.block_size} tokens = {self.num_slots} tokens, "
            f"{self.nbytes / _GIB:.2f} GiB"
        )

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block across all layers, K and V."""
        _check_positive(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element_bytes

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
