"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a vision tower with a patch merger, and Qwen2 with M-RoPE.

    image ─ processor: resized to multiples of patch * merge (28), cut into 14 x 14 patches of 2 frames
        ─ pixel values [t*h*w, 3*2*14*14], grid_thw (t, h, w)
        ─ vision tower: window attention, full attention in the fullatt_block_indexes blocks
        ─ merger: each merge x merge square of patches is one embedding ─ [t*h*w / merge^2, hidden]
    prompt: text <|vision_start|> <|image_pad|> x tokens <|vision_end|> text
        ─ token embeddings, the image rows replaced ─ Qwen2 (q/k/v biases), M-RoPE positions [3, num_tokens]

The vision tower is transformers' own ``Qwen2_5_VisionTransformerPretrainedModel`` (window
attention, the 2-D rotary embedding of the patches, the merger), so an image's embeddings are
transformers'; only its attention runs differently: without flash-attn transformers attends one
window at a time, here the windows of one length go in one call (``attend_within_runs``). It
takes any number of images of any sizes at once: their patches concatenated, one grid per image. The language model is the project's Qwen2 with paged
attention; its rotary embedding reads three positions per token (``engine/loading/mrope.py`` computes
them per request), and its decode steps run as any Qwen2's, CUDA graphs included.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.loading.model_config import ModelConfig
from engine.models.image_text import ImageTextModel, without_transformers_init
from engine.models.qwen2 import Qwen2ForCausalLM

# Checkpoint name prefixes: as transformers 5 holds them in memory (``model.language_model.*``,
# ``model.visual.*``), and as saved and published (``model.*`` for the language model, ``visual.*``).
_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
    ("model.", "language_model.model."),
)


class Qwen2_5_VLForConditionalGeneration(ImageTextModel):
    """Qwen2.5-VL over a flat token batch: ``encode_images`` for the prompts' images, then ``embed_input_ids``
    and ``forward`` as a causal LM whose input embeddings carry them and whose positions are M-RoPE's."""


    def __init__(self, config: ModelConfig):
        super().__init__()
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        mm = config.multimodal
        if mm is None or mm.model_type != "qwen2_5_vl" or config.mrope_section is None:
            raise ValueError(f"{config.architecture} needs a Qwen2.5-VL config (a vision_config, M-RoPE sections)")
        self.config = config
        self.mm = mm
        vision = mm.hf_config.vision_config
        with without_transformers_init():
            self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(
                vision, attn_implementation="sdpa", dtype=torch.get_default_dtype())
        # The tower's attention, batched: transformers runs it one window at a time unless flash-attn is installed.
        attention, runs = _batched_vision_attention(), {}
        for block in self.visual.blocks:
            block.attn.__class__ = attention  # same parameters and names, another forward
            block.attn.runs = runs
        self.language_model = Qwen2ForCausalLM(config)
        self.merge_size = mm.spatial_merge_size
        # One row of pixel values per patch: channels x frames x patch x patch.
        self.patch_values = int(vision.in_channels) * int(vision.temporal_patch_size) * mm.patch_size**2

    # ------------------------------------------------------------------ images

    def num_image_tokens(self, pixel_shape: tuple[int, ...], grid_thw: tuple[int, int, int] | None = None) -> int:
        """The embeddings one image of this patch grid makes (t*h*w / merge^2); ValueError for pixel values that
        are not the grid's patches or a grid the merger cannot take."""
        if grid_thw is None:
            raise ValueError("Qwen2.5-VL needs each image's patch grid (grid_thw; the model's processor gives it)")
        t, h, w = (int(n) for n in grid_thw)
        m = self.merge_size
        if min(t, h, w) < 1 or h % m or w % m:
            raise ValueError(f"a patch grid of {t} x {h} x {w}: the merger takes heights and widths in multiples "
                             f"of {m}")
        if tuple(pixel_shape) != (t * h * w, self.patch_values):
            raise ValueError(f"pixel values of shape {tuple(pixel_shape)}, but a {t} x {h} x {w} grid of patches is "
                             f"{(t * h * w, self.patch_values)} (the model's processor makes them)")
        return t * h * w // m**2

    def dummy_images(self, max_tokens: int, dtype: torch.dtype, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``encode_images``' arguments for its largest input in a step of ``max_tokens`` image tokens: one image
        of about that many tokens, as square as they come, zeros (what the memory profile runs)."""
        rows = max(1, math.isqrt(max_tokens))
        grid = (1, rows * self.merge_size, max(1, max_tokens // rows) * self.merge_size)
        pixels = torch.zeros(math.prod(grid), self.patch_values, dtype=dtype, device=device)
        return pixels, torch.tensor([grid], dtype=torch.int64, device=device)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The images' patches concatenated [patches, patch values] and their grids [images, 3] -> each image's
        embeddings, [t*h*w / merge^2, hidden_size]."""
        out = self.visual(pixel_values, grid_thw=grid_thw)
        merged = getattr(out, "pooler_output", out)  # [image tokens, hidden]; transformers 4.x returns it bare
        return merged.split((grid_thw.prod(-1) // self.merge_size**2).tolist())

    # ------------------------------------------------------------- language model

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [3, num_tokens] int64 M-RoPE positions; [num_tokens]: text, in all three rows
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size]: embed_input_ids' with images
    ) -> torch.Tensor:
        """Final-normed hidden states, [num_tokens, hidden_size]."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        return self.language_model(input_ids, positions, meta, inputs_embeds)

    @staticmethod
    def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.endswith("inv_freq"):
                continue  # rotary buffers some checkpoints stored: derived from the config here
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            yield name, tensor


def attend_within_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                       runs: dict) -> torch.Tensor:
    """Attention of q, k, v [tokens, heads, head_dim] within each run ``cu_seqlens[i]:cu_seqlens[i + 1]`` (no mask
    inside a run, nothing across runs): [tokens, heads, head_dim].

    The vision tower's runs are its windows (a few lengths: full windows and the image's edges) or whole images.
    Runs of one length are stacked into one ``scaled_dot_product_attention`` call, so a layer makes one call per
    distinct length instead of one per window. ``runs`` caches the gather indices by boundaries: every windowed
    layer of a forward has the same ones.
    """
    bounds = tuple(cu_seqlens.tolist())
    groups = runs.get(bounds)
    if groups is None:
        starts_by_length: dict[int, list[int]] = {}
        for start, end in zip(bounds, bounds[1:]):
            if end > start:
                starts_by_length.setdefault(end - start, []).append(start)
        groups = []
        for n, starts in starts_by_length.items():  # the rows of all runs of length n, run after run
            rows = torch.tensor(starts, device=q.device)[:, None] + torch.arange(n, device=q.device)
            groups.append((rows.reshape(-1), len(starts)))
        if len(runs) >= 16:
            runs.clear()
        runs[bounds] = groups
    heads, head_dim = q.shape[1:]
    out = torch.empty_like(q)
    for rows, count in groups:
        stacked = [t[rows].view(count, -1, heads, head_dim).transpose(1, 2) for t in (q, k, v)]  # [runs, heads, n, d]
        o = F.scaled_dot_product_attention(*stacked, scale=scale)
        out[rows] = o.transpose(1, 2).reshape(-1, heads, head_dim)
    return out


@functools.cache
def _batched_vision_attention() -> type:
    """transformers' Qwen2.5-VL vision attention with ``attend_within_runs`` in place of its loop over windows."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    class BatchedVisionAttention(hf.Qwen2_5_VLVisionAttention):
        def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, position_embeddings=None,
                    rotary_pos_emb=None, **kwargs) -> torch.Tensor:
            n = hidden_states.shape[0]
            q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
            if position_embeddings is None:  # releases that pass the rotary angles instead of their cos/sin
                angles = torch.cat((rotary_pos_emb, rotary_pos_emb), dim=-1)
                position_embeddings = (angles.cos(), angles.sin())
            q, k = hf.apply_rotary_pos_emb_vision(q, k, *position_embeddings)
            out = attend_within_runs(q, k, v, cu_seqlens, self.scaling, self.runs)
            return self.proj(out.reshape(n, -1))

    return BatchedVisionAttention
