"""The vision encoder's part of a step: the images the scheduler names are encoded (and projected) into the
encoder cache, their embeddings kept by content hash until the scheduler lets them go.

Images of one size (LLaVA) go in a batch per pixel shape; images with a patch grid (Qwen2.5-VL) all at once,
their patches concatenated, with their grids. The step's placeholder tokens then take their rows of these
embeddings (``StepInputPreparer``).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.worker.step_buffers import upload


class ImageEncoder:
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 encoder_cache: dict[str, torch.Tensor]):
        self.model = model
        self.dtype = dtype
        self.device = device
        self.encoder_cache = encoder_cache  # [image tokens, hidden] per content hash

    def encode(self, images: list) -> None:
        """Encode the step's new images (``ImageInput``s) into the encoder cache."""
        by_shape: dict[tuple[int, ...], list] = {}
        for mm in images:
            key = () if mm.grid_thw is not None else tuple(mm.pixel_values.shape)  # images with grids: one batch
            by_shape.setdefault(key, []).append(mm)
        for group in by_shape.values():
            pixels = [mm.pixel_values.to_numpy() for mm in group]
            if group[0].grid_thw is None:
                embeds = self.model.encode_images(upload(np.stack(pixels), self.device).to(self.dtype))
            else:
                grids = upload(np.array([mm.grid_thw for mm in group], dtype=np.int64), self.device)
                embeds = self.model.encode_images(upload(np.concatenate(pixels), self.device).to(self.dtype), grids)
            for mm, rows in zip(group, embeds):  # [tokens of the image, hidden] each
                if rows.shape[0] != mm.length:
                    raise RuntimeError(f"an image encoded to {rows.shape[0]} embeddings for {mm.length} tokens")
                self.encoder_cache[mm.content_hash] = rows

    def free(self, content_hashes: list[str]) -> None:
        """Drop the embeddings no request needs any more (the scheduler's word)."""
        for content_hash in content_hashes:
            self.encoder_cache.pop(content_hash, None)
