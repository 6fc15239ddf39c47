"""Model classes by Hugging Face architecture name (``config.json`` ``architectures[0]``)."""

from __future__ import annotations

from torch import nn

from engine.models.classification import sequence_classifier
from engine.models.gemma import GemmaForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.llava import LlavaForConditionalGeneration
from engine.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral is Llama's architecture, with its sliding window (ModelConfig.layer_windows).
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    # A vision tower and projector (transformers' modules) in front of the Llama above; takes images.
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
    # transformers' Qwen2.5-VL vision tower in front of the Qwen2 above, whose rope takes three positions a token.
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    # Cross-encoder rerankers and other classifiers: the decoders above with a score head (--runner pooling).
    "LlamaForSequenceClassification": sequence_classifier(LlamaForCausalLM),
    "Qwen2ForSequenceClassification": sequence_classifier(Qwen2ForCausalLM),
    "Qwen3ForSequenceClassification": sequence_classifier(Qwen3ForCausalLM),
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class for an architecture name; ValueError listing the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"Unsupported architecture {architecture!r}. Supported: {supported}") from None
