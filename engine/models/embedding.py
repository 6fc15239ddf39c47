"""The vocabulary's two ends, split over the tensor-parallel ranks by token id: the input embedding and the
output projection (the LM head). Tied, they are the same tensor; both stay in the model dtype whatever the
linear layers' weight method; a head may hold a quantized copy beside it that finds greedy tokens faster."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_gather_last_dim, all_reduce, shard_range, tp_size


class ArgmaxForm(Protocol):
    def greedy_tokens(self, x: torch.Tensor, dense_weight: torch.Tensor) -> torch.Tensor:
        """argmax of x dense_weight^T per row, exactly, ties to the lowest column."""


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
        # A quantized copy of the weight that finds greedy tokens (``greedy_tokens``), set after loading where one
        # is faster than the dense product (a GGUF head's blocks on the CPU: ``gguf_weights.keep_lm_head``), and the
        # most rows it takes at once.
        self.argmax_form: ArgmaxForm | None = None
        self.argmax_max_rows = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(F.linear(hidden, self.weight))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax of ``forward(hidden)`` exactly (ties to the lowest id), found with the quantized copy
        without the dense product; None where there is no copy, or more rows than it takes."""
        if self.argmax_form is None or hidden.shape[0] > self.argmax_max_rows:
            return None
        return self.argmax_form.greedy_tokens(hidden, self.weight)
