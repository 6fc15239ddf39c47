"""Mixture of experts: the sparse MLP of Qwen3-MoE and Mixtral, and the models built from it.

    router (a linear to num_experts) -> softmax (float32) -> top-k experts per token [-> renormalised]
    each expert: down(silu(gate(x)) * up(x)), weighted by its routing weight, summed per token

The experts live in two fused weights, ``w13`` [experts, 2 * intermediate, hidden] (gate | up) and ``w2``
[experts, hidden, intermediate]; ``weight_targets`` maps each checkpoint's per-expert tensors into them.
With tensor parallelism every rank holds every expert's share of the intermediate size (as a dense MLP is
split) and one all-reduce sums the partial outputs.

Two paths for the experts. The torch reference gathers tokens per expert, as transformers does it, so that
float32 outputs match it closely; it reads the routing on the host (a data-dependent loop), so a model on it
runs eagerly. On CUDA the experts run ``engine.ops.moe.fused_moe`` instead: routing sorted on the
device and two grouped-GEMM Triton kernels, no host sync, so MoE models capture CUDA graphs like dense ones.
``FusedExperts.use_triton`` picks the path: ``None`` (the default) means Triton for CUDA tensors when triton is
installed and ``MINIVLLM_MOE_BACKEND`` is not ``torch``; True or False forces one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine import settings
from engine.distributed import all_reduce, shard_range, tp_size
from engine.loading.model_config import ModelConfig
from engine.models.fused_path import triton_installed
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.models.weight_loading import copy_weight, take


def moe_backend() -> str:
    """``$MINIVLLM_MOE_BACKEND``: ``triton`` (the default: the fused kernels on CUDA) or ``torch`` (the reference)."""
    backend = settings.moe_backend()
    if backend not in ("triton", "torch"):
        raise ValueError(f"MINIVLLM_MOE_BACKEND must be 'triton' or 'torch', got {backend!r}")
    return backend


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.source_start, self.intermediate = shard_range(intermediate_size)  # this rank's columns
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate))
        self.use_triton: bool | None = None  # see the module docstring

    def uses_triton(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` runs the fused Triton path for input ``x`` (``use_triton`` resolved)."""
        if self.use_triton is not None:
            return self.use_triton
        return x.is_cuda and triton_installed() and moe_backend() == "triton"

    def weight_targets(self, prefix: str) -> dict:
        """Checkpoint name -> loader for every expert's ``gate_proj``, ``up_proj`` and ``down_proj``."""
        span = (self.source_start, self.intermediate) if tp_size() > 1 else None
        targets = {}
        for e in range(self.num_experts):
            name = f"{prefix}.{e}"
            targets[f"{name}.gate_proj.weight"] = self._loader(self.w13, e, slice(0, self.intermediate), 0, span)
            targets[f"{name}.up_proj.weight"] = self._loader(self.w13, e, slice(self.intermediate, None), 0, span)
            targets[f"{name}.down_proj.weight"] = self._loader(self.w2, e, slice(None), 1, span)
        return targets

    @staticmethod
    def _loader(param: nn.Parameter, expert: int, rows: slice, dim: int, span):
        def load(name: str, tensor) -> None:
            copy_weight(param.data[expert, rows], take(tensor, dim, span), name)

        return load

    def forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden]; top_ids and top_weights [tokens, k]. Returns this rank's partial sum."""
        if self.uses_triton(x):
            from engine.ops.moe import fused_moe  # imported on first use: the torch path needs no triton

            return fused_moe(x, self.w13, self.w2, top_ids, top_weights)
        return self.reference_forward(x, top_ids, top_weights)

    def reference_forward(self, x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor) -> torch.Tensor:
        """The torch reference: a host loop over the experts that got tokens."""
        out = torch.zeros_like(x)
        hit = torch.bincount(top_ids.reshape(-1), minlength=self.num_experts).nonzero()[:, 0].tolist()
        for expert in hit:
            token_idx, slot = torch.where(top_ids == expert)
            gate, up = F.linear(x[token_idx], self.w13[expert]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.w2[expert])
            out.index_add_(0, token_idx, (h * top_weights[token_idx, slot, None]).to(out.dtype))
        return out


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: the router (``gate``, replicated on every rank) and the experts."""

    takes_fp8_input = False  # the router and the experts read the normed hidden states in the model dtype

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_in_hidden_dtype = moe.weights_in_hidden_dtype
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = FusedExperts(moe.num_experts, config.hidden_size, moe.expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        top_weights, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        if self.weights_in_hidden_dtype:
            top_weights = top_weights.to(x.dtype)
        return all_reduce(self.experts(x, top_ids, top_weights))


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama decoder whose sparse layers (``config.moe.sparse_layers``) have experts for an MLP."""

    @property
    def supports_cuda_graphs(self) -> bool:
        """True when every layer's experts run the fused Triton path (no host sync) on this model's device.

        Read by the model runner after the weights are on their device; the torch reference loops over the
        routing on the host, which a CUDA graph cannot capture.
        """
        return all(m.uses_triton(m.w13) for m in self.modules() if isinstance(m, FusedExperts))

    @classmethod
    def make_mlp(cls, config: ModelConfig, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(config) if layer_idx in config.moe.sparse_layers else LlamaMLP(config)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def attention_spec(cls, config: ModelConfig):
        from engine.models.llama import AttentionSpec

        return AttentionSpec(qkv_bias=config.attention_bias, o_proj_bias=config.attention_bias, qk_norm=True)


# Mixtral's checkpoint names for the same pieces.
_MIXTRAL_NAMES = {"block_sparse_moe.": "mlp.", ".w1.weight": ".gate_proj.weight", ".w3.weight": ".up_proj.weight",
                  ".w2.weight": ".down_proj.weight"}


class MixtralForCausalLM(MoEForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed():
            for name, tensor in weights:
                for old, new in _MIXTRAL_NAMES.items():
                    name = name.replace(old, new)
                yield name, tensor

        return super().load_weights(renamed())
