"""Start-up lines about the KV cache's layout that the model runner logs."""

from __future__ import annotations

import logging

from engine.loading.model_config import ModelConfig

logger = logging.getLogger("minivllm")


def kv_outside_windows(layer_windows: tuple[int, ...], num_tokens: int) -> float:
    """The share of a ``num_tokens``-token request's KV that no attention reads: in each windowed layer, the
    tokens before its window (0 for a window of 0, i.e. full attention). What one block table for all layers
    costs against per-layer tables that free those blocks (Gemma 3 at 32k tokens: 5 layers in 6 with 1,024-token
    windows, 81%)."""
    outside = sum(max(0, num_tokens - w) for w in layer_windows if w)
    return outside / (num_tokens * len(layer_windows))


def log_sliding_windows(mc: ModelConfig, max_model_len: int) -> None:
    """What one block table for every layer costs a model with sliding windows (nothing for one without)."""
    windows = [w for w in mc.layer_windows if w]
    if windows:
        logger.info("sliding windows on %d of %d layers (%s tokens): one block table serves every layer, so a "
                    "request keeps the KV of all its tokens in every layer until it ends, where the windowed "
                    "layers read only their window's blocks; at %d tokens %.0f%% of the KV a request holds is "
                    "never read (older than its layer's window)", len(windows), mc.num_hidden_layers,
                    ", ".join(str(w) for w in sorted(set(windows))), max_model_len,
                    100 * kv_outside_windows(mc.layer_windows, max_model_len))
