"""Sequence classifiers (``*ForSequenceClassification``): a decoder whose head scores the last token's final hidden
state with one logit per label instead of one per vocabulary entry, as cross-encoder rerankers are (a query and a
document in one prompt, one relevance logit). transformers names the head ``score`` (a linear map without bias) and
pools the last token; here the head takes the LM head's place, so a pooling request's step computes it where a
generating one computes its logits (``engine.worker.pooling``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.loading.model_config import ModelConfig
from engine.models.weight_loading import load_checkpoint_weights


class ScoreHead(nn.Module):
    """[n, hidden] -> [n, num_labels] logits, in the model's dtype."""

    def __init__(self, hidden_size: int, num_labels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)

    def greedy_tokens(self, hidden: torch.Tensor) -> None:
        return None  # no quantized copy: the logits are computed


def sequence_classifier(causal_lm: type[nn.Module]) -> type[nn.Module]:
    """The classifier of a causal LM class: its decoder, with a ``ScoreHead`` as its head."""

    class SequenceClassifier(causal_lm):
        def __init__(self, config: ModelConfig):
            super().__init__(config)
            self.lm_head = ScoreHead(config.hidden_size, config.num_labels)  # (no tie with the embeddings)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            renamed = (("lm_head.weight" if name == "score.weight" else name, tensor) for name, tensor in weights)
            return load_checkpoint_weights(self, renamed, set())

    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = causal_lm.__name__.replace(
        "ForCausalLM", "ForSequenceClassification")
    return SequenceClassifier
