"""M-RoPE positions (Qwen2.5-VL): three per token, temporal, height and width, set by the prompt's images.

A text token's three positions are equal. An image's tokens are its merged grid ``t x h x w`` in
raster order, and token (i, j, k) of it is at (start + i, start + j, start + k), where ``start``
follows the text before it; the text after an image goes on from ``start + max(h, w)``. So every
token past the last image is at its index plus one per-request ``delta`` (<= 0: an image of h*w
tokens advances the positions by max(h, w) only), and so is every generated token::

    prompt     text  text  <image: merged grid 1 x 2 x 3>     text | generated
    index      0     1     2  3  4  5  6  7                   8    | 9    10 ...
    row t      0     1     2  2  2  2  2  2                   5    | 6    7
    row h      0     1     2  2  2  3  3  3                   5    | 6    7
    row w      0     1     2  3  4  2  3  4                   5    | 6    7
                                                 delta = 5 - 8 = -3: index + delta from index 8 on

This is the rule of transformers' ``get_rope_index`` for images. ``MRopePositions`` keeps the three
rows up to the end of the last image (computed once, when the request is created) and ``delta``
for everything after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class MRopePositions:
    """A prompt's M-RoPE positions: ``table`` [3, end] int64 for tokens ``0..end-1`` (``end``: the last image's
    end), and for every token ``i >= end`` the position ``i + delta`` in all three rows."""

    table: np.ndarray
    delta: int

    @property
    def end(self) -> int:
        return self.table.shape[1]

    def positions(self, num_tokens: int) -> np.ndarray:
        """The [3, num_tokens] positions of the first ``num_tokens`` tokens."""
        out = np.empty((3, num_tokens), dtype=np.int64)
        head = min(num_tokens, self.end)
        out[:, :head] = self.table[:, :head]
        out[:, head:] = np.arange(head, num_tokens) + self.delta
        return out


def mrope_positions(images: Sequence, spatial_merge_size: int) -> MRopePositions:
    """The positions of a prompt whose images (``engine.loading.multimodal.ImageInput``s with their patch grids
    ``grid_thw``, by offset) are merged ``spatial_merge_size`` x ``spatial_merge_size`` into tokens."""
    end = images[-1].end if images else 0
    table = np.empty((3, end), dtype=np.int64)
    cursor = start = 0  # the next token index, and the next text position
    for mm in images:
        if mm.grid_thw is None:
            raise ValueError("M-RoPE positions need each image's patch grid (grid_thw)")
        t, h, w = mm.grid_thw[0], mm.grid_thw[1] // spatial_merge_size, mm.grid_thw[2] // spatial_merge_size
        if t * h * w != mm.length:
            raise ValueError(f"an image of merged grid {t} x {h} x {w} at {mm.offset} has {mm.length} tokens")
        table[:, cursor:mm.offset] = start + np.arange(mm.offset - cursor)
        start += mm.offset - cursor
        idx = np.arange(mm.length)
        table[0, mm.offset:mm.end] = start + idx // (h * w)
        table[1, mm.offset:mm.end] = start + idx // w % h
        table[2, mm.offset:mm.end] = start + idx % w
        start += max(h, w)
        cursor = mm.end
    table.flags.writeable = False
    return MRopePositions(table, start - cursor)
