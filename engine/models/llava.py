"""LLaVA (``LlavaForConditionalGeneration``): a vision tower, a projector and a Llama language model.

    pixel values [images, 3, S, S] ─ vision tower (CLIP / SigLIP) ─ hidden states of vision_feature_layer
        ─ drop CLS ("default" strategy) ─ projector: linear_1, GELU, linear_2 ─ [images, tokens, hidden]
    prompt: text ... <image> x tokens ... text ─ token embeddings, the image rows replaced ─ Llama

The vision tower and the projector are transformers' own modules (``CLIPVisionModel`` /
``SiglipVisionModel`` and ``LlavaMultiModalProjector``), so an image's embeddings are exactly
transformers'; the tower has no KV cache and runs once per image, at prefill (the model runner keeps
the result in its encoder cache). The tower's layers past the last one LLaVA reads are not built.
The language model is the project's Llama with paged attention: its prefill takes input
embeddings in which the image placeholder tokens carry the image embeddings, and its decode steps
(token ids only) run as any Llama's, CUDA graphs included.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator

import torch

from engine.attention.metadata import AttentionMetadata
from engine.loading.model_config import ModelConfig
from engine.models.image_text import ImageTextModel, without_transformers_init
from engine.models.llama import LlamaForCausalLM

# Checkpoint name prefixes, by where transformers puts them: in memory under transformers 5
# (``model.language_model.*``, ``lm_head.*``), and as saved (``language_model.model.*``,
# ``language_model.lm_head.*``); the vision tower with or without its ``vision_model.`` level.
_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


class LlavaForConditionalGeneration(ImageTextModel):
    """LLaVA over a flat token batch: ``encode_images`` for the prompts' images, then ``embed_input_ids`` and
    ``forward`` as a causal LM whose input embeddings carry them."""


    def __init__(self, config: ModelConfig):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        mm = config.multimodal
        if mm is None:
            raise ValueError(f"{config.architecture} needs a LLaVA config (with a vision_config)")
        self.config = config
        self.mm = mm
        hf = mm.hf_config
        vision = copy.deepcopy(hf.vision_config)
        if mm.vision_model_type == "siglip_vision_model":
            vision.vision_use_head = False  # the pooling head feeds nothing LLaVA reads
        num_layers = vision.num_hidden_layers
        layers = mm.vision_feature_layer if isinstance(mm.vision_feature_layer, tuple) else (mm.vision_feature_layer,)
        # hidden_states[0] is the embeddings' output, hidden_states[i] layer i's: index i needs i layers.
        self._feature_indices = tuple(i if i >= 0 else num_layers + 1 + i for i in layers)
        if not all(0 <= i <= num_layers for i in self._feature_indices):
            raise ValueError(f"vision_feature_layer {mm.vision_feature_layer} is outside the tower's {num_layers} "
                             f"layers")
        self._num_tower_layers = max(self._feature_indices)
        vision.num_hidden_layers = self._num_tower_layers
        with without_transformers_init():
            self.vision_tower = AutoModel.from_config(vision, attn_implementation="sdpa",
                                                      dtype=torch.get_default_dtype())
            self.multi_modal_projector = LlavaMultiModalProjector(hf)
        self.language_model = LlamaForCausalLM(config)
        self._tower_has_vision_model = hasattr(self.vision_tower, "vision_model")  # transformers < 5 nests it
        self._has_cls = mm.vision_model_type == "clip_vision_model"
        self.image_input_shape = (int(getattr(vision, "num_channels", 3)), mm.image_size, mm.image_size)

    # ------------------------------------------------------------------ images

    def num_image_tokens(self, pixel_shape: tuple[int, ...], grid_thw: tuple[int, int, int] | None = None) -> int:
        """The embeddings one image of these pixel values makes; ValueError for a shape the tower does not take."""
        if grid_thw is not None:
            raise ValueError(f"an image with a patch grid {tuple(grid_thw)}, but LLaVA's images are all one size")
        if tuple(pixel_shape) != self.image_input_shape:
            raise ValueError(f"pixel values of shape {tuple(pixel_shape)}, but the vision tower takes "
                             f"{self.image_input_shape} (the model's processor makes them)")
        patches = (self.mm.image_size // self.mm.patch_size) ** 2
        return patches + int(self._has_cls) - int(self.mm.vision_feature_select_strategy == "default")

    def dummy_images(self, max_tokens: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor]:
        """``encode_images``' arguments for its largest batch in a step of ``max_tokens`` image tokens (at least one
        image), zeros: what the memory profile runs."""
        num_images = max(1, max_tokens // self.num_image_tokens(self.image_input_shape))
        return (torch.zeros(num_images, *self.image_input_shape, dtype=dtype, device=device),)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, S, S] pixel values -> [images, tokens per image, hidden_size] embeddings for the prompt."""
        out = self.vision_tower(pixel_values, output_hidden_states=True)
        features = [out.hidden_states[i] for i in self._feature_indices]
        if self.mm.vision_feature_select_strategy == "default":
            features = [f[:, 1:] for f in features]  # the CLS position
        return self.multi_modal_projector(features[0] if len(features) == 1 else torch.cat(features, dim=-1))

    # ------------------------------------------------------------- language model

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden_size]: embed_input_ids' with images
    ) -> torch.Tensor:
        """Final-normed hidden states, [num_tokens, hidden_size]."""
        return self.language_model(input_ids, positions, meta, inputs_embeds)

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors under this module's names, without the tower layers and parts that are not built."""
        for name, tensor in weights:
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if name.startswith("vision_tower."):
                rest = name[len("vision_tower."):].removeprefix("vision_model.")
                if rest.endswith("position_ids") or rest.startswith("head."):
                    continue  # a buffer older checkpoints stored; SigLIP's pooling head
                if rest.startswith("encoder.layers.") and int(rest.split(".")[2]) >= self._num_tower_layers:
                    continue  # past the last layer LLaVA reads
                name = "vision_tower." + ("vision_model." if self._tower_has_vision_model else "") + rest
            yield name, tensor
