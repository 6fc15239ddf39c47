"""``FeedsLinear``: a layer that knows which linear layer reads its output next, so that its GPU kernel may ask the
L2 cache for that layer's weight before the product runs (``engine.ops.l2_prefetch``)."""

from __future__ import annotations

import torch
from torch import nn


class FeedsLinear:
    """Mixed into a module whose output a linear layer reads next (an add-norm, SwiGLU, attention)."""

    def feeds(self, linear: nn.Module) -> None:
        """Name that linear layer; kept as a plain attribute, not a submodule, so the weight stays its own."""
        self.__dict__["_feeds"] = linear

    def _next_weight(self) -> torch.Tensor | None:
        linear = self.__dict__.get("_feeds")
        return linear.weight if linear is not None else None
