"""What every vision-language model here shares: a vision side in front of one of the project's language models.

A subclass builds ``self.language_model`` (a causal LM with paged attention) and its vision modules, and
gives ``encode_images``, ``num_image_tokens``, ``dummy_images``, ``forward`` and ``_renamed`` (its
checkpoint names to this module's). The model runner calls ``encode_images`` when a prefill reaches an
image, then ``embed_input_ids`` for the step's tokens; logits and the attention layers are the language
model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.attention.layer import Attention
from engine.models.weight_loading import load_checkpoint_weights


class ImageTextModel(nn.Module):
    accepts_images = True

    def embed_input_ids(self, input_ids: torch.Tensor, image_positions: torch.Tensor,
                        image_embeds: torch.Tensor) -> torch.Tensor:
        """Token embeddings [num_tokens, hidden_size], the rows ``image_positions`` [K] replaced by ``image_embeds``
        [K, hidden_size]."""
        embeds = self.language_model.model.embed_tokens(input_ids)
        return embeds.index_copy_(0, image_positions, image_embeds.to(embeds.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return self.language_model.attention_layers()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a checkpoint in any of the namings ``_renamed`` knows; return the names used."""
        skip = {"language_model.lm_head.weight"} if self.config.tie_word_embeddings else set()
        return load_checkpoint_weights(self, self._renamed(weights), skip)

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError


@contextlib.contextmanager
def without_transformers_init():
    """Build transformers modules (a vision-language model's vision tower) without their random initialisation:
    every weight is loaded after."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield
