"""The vocabulary's two ends, split over the tensor-parallel ranks by token id: the input embedding and the
output projection (the LM head). Tied, they are the same tensor; both stay in the model dtype whatever the
linear layers' weight method."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_gather_last_dim, all_reduce, shard_range, tp_size


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows split over the ranks by token id; a token's row comes from the rank holding it, the
    others contribute zeros, and an all-reduce puts it together."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        self.vocab_start, local = shard_range(num_embeddings)
        super().__init__(local, embedding_dim)
        self.weight.source_range = (0, self.vocab_start, local)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside[:, None], 0))


class ParallelLMHead(nn.Linear):
    """The output projection with its vocabulary rows split over the ranks (the same split as the
    embedding, so tied weights are the same tensor); the logit slices are gathered in rank order."""

    def __init__(self, hidden_size: int, vocab_size: int):
        start, local = shard_range(vocab_size)
        super().__init__(hidden_size, local, bias=False)
        self.weight.source_range = (0, start, local)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(F.linear(hidden, self.weight))
