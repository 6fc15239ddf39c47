"""Pooling requests' outputs in the runner (``SamplingParams.pooling``): the final hidden state of a prompt's last
token, taken in the step that computes it (the request's sampled row, whose sampled token the engine drops).

That hidden state is what the model's LM head would read (after its final norm): a decoder embedding model's
last-token pooling (Qwen3-Embedding, E5-Mistral, GTE-Qwen). It is cut to the request's ``dimensions`` (a Matryoshka
model's leading dimensions) and L2-normalised in float32, as sentence-transformers does for these models. A sequence
classifier's output is its score head's logits of that hidden state (``engine.models.classification``), raw: the
caller turns them into a score (a sigmoid for one label).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.worker.input_batch import InputBatch


def pooled_rows(batch: InputBatch, sampled_rows: np.ndarray, hidden: torch.Tensor,
                model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """``hidden`` [sampled rows, hidden size]: the sampled rows' final hidden states. Returns each pooling
    row's output by its index among the sampled rows (float32, on the device; empty where none pools)."""
    if not batch.pooling:
        return {}
    classifier = model.config.num_labels > 0
    out = {}
    for i, row in enumerate(sampled_rows.tolist()):
        params = batch.pooling.get(row)
        if params is None:
            continue
        if classifier:
            out[i] = model.compute_logits(hidden[i : i + 1])[0].float()
            continue
        vector = hidden[i, : params.dimensions].float()
        out[i] = F.normalize(vector, dim=-1) if params.normalize else vector
    return out
