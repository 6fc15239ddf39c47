"""The fused-MoE Triton path (``engine.ops.moe``) against the torch reference of ``FusedExperts``.

The routing layout is checked directly (every (token, slot) pair once, expert-pure ``BLOCK_M``-aligned
segments, padding and the blocks past the end marked), then ``fused_moe`` against ``FusedExperts``' reference
in float32 on Mixtral-like (top-2 of 4) and Qwen3-MoE-like (top-8 of 16) routings, experts that get no token,
sizes that are not multiples of the tiles, an empty batch, and a whole tiny Qwen3-MoE model.

On a GPU the kernels run compiled on CUDA tensors; without one, in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, which conftest sets on hosts without CUDA). Sizes are tiny for the interpreter.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import transformers

pytest.importorskip("triton")

from engine.loading.loader import load_model  # noqa: E402
from engine.loading.model_config import ModelConfig  # noqa: E402
from engine.models import moe as moe_module  # noqa: E402
from engine.models.moe import FusedExperts  # noqa: E402
from engine.ops.moe import MoEBlocks, align_routing, choose_blocks, fused_moe, max_padded_rows  # noqa: E402
from tests.helpers import VOCAB, PagedRunner  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU: run with TRITON_INTERPRET=1 to test the kernels on the CPU", allow_module_level=True)


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int, experts: list[int] | None = None):
    """Softmax / top-k / renormalise over random logits, as ``SparseMoeBlock`` routes; ``experts`` restricts
    the choice to those experts (the others get no token)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if experts is not None:
        allowed = torch.zeros(num_experts, dtype=torch.bool)
        allowed[experts] = True
        logits = logits.masked_fill(~allowed, float("-inf"))
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return ids.to(DEVICE), (weights / weights.sum(dim=-1, keepdim=True)).to(DEVICE)


def _experts(num_experts: int, hidden: int, inter: int, seed: int = 0) -> FusedExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = FusedExperts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(experts.w13.shape, generator=gen) / hidden**0.5)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) / inter**0.5)
    return experts.to(DEVICE)


# ----------------------------------------------------------------------------------------------
# Routing layout


def _expected_layout(top_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """The layout of ``align_routing``'s docstring, in plain Python."""
    experts = top_ids.reshape(-1).tolist()
    num_pairs = len(experts)
    rows, blocks = [], []
    for e in range(num_experts):
        segment = [p for p in range(num_pairs) if experts[p] == e]
        padding = -len(segment) % block_m
        rows += segment + [num_pairs] * padding
        blocks += [e] * ((len(segment) + padding) // block_m)
    num_rows = max_padded_rows(num_pairs, num_experts, block_m)
    return rows + [num_pairs] * (num_rows - len(rows)), blocks + [-1] * (num_rows // block_m - len(blocks))


def test_align_routing_matches_the_docstring_example():
    top_ids = torch.tensor([[0, 2], [2, 3], [0, 2], [2, 0], [2, 3]], device=DEVICE)
    sorted_pairs, block_experts = align_routing(top_ids, num_experts=4, block_m=4)
    pad = 10
    expected = [0, 4, 7, pad, 1, 2, 5, 6, 8, pad, pad, pad, 3, 9, pad, pad] + [pad] * 8
    assert sorted_pairs.tolist() == expected
    assert block_experts.tolist() == [0, 2, 2, 3, -1, -1]
    assert sorted_pairs.dtype == block_experts.dtype == torch.int32


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m,experts", [
    (1, 4, 2, 16, None),
    (13, 4, 2, 4, None),  # several blocks per expert
    (9, 16, 8, 16, None),
    (37, 32, 8, 16, None),
    (600, 4, 2, 16, None),  # more pairs than the routing kernels take at a time (1024)
    (20, 6, 2, 8, [1, 4]),  # four experts get nothing; not a power of two
], ids=["one-token", "multi-block", "qwen3-like", "e32", "long", "empty-experts"])
def test_align_routing_layout(num_tokens, num_experts, top_k, block_m, experts):
    top_ids, _ = _routing(num_tokens, num_experts, top_k, seed=num_tokens, experts=experts)
    sorted_pairs, block_experts = align_routing(top_ids, num_experts, block_m)
    assert (sorted_pairs.tolist(), block_experts.tolist()) == _expected_layout(top_ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    assert sorted_pairs.shape == (max_rows,) and block_experts.shape == (max_rows // block_m,)
    assert max_rows <= num_pairs + num_experts * (block_m - 1) + block_m - 1

    pairs = sorted_pairs.cpu().view(-1, block_m)
    owners = block_experts.cpu()
    flat_ids = top_ids.reshape(-1).cpu()
    real = sorted_pairs[sorted_pairs < num_pairs].cpu()
    assert sorted(real.tolist()) == list(range(num_pairs)), "every (token, slot) pair exactly once"
    assert ((sorted_pairs >= 0) & (sorted_pairs <= num_pairs)).all(), "padding rows hold num_pairs"

    used = owners >= 0
    num_used = int(used.sum())
    assert used[:num_used].all() and not used[num_used:].any(), "the blocks past the end come last"
    assert (pairs[~used] == num_pairs).all(), "blocks past the end hold only padding"
    assert (owners[:num_used][1:] >= owners[:num_used][:-1]).all(), "segments in expert order"
    counts = torch.bincount(flat_ids, minlength=num_experts)
    blocks_per_expert = torch.bincount(owners[used].long(), minlength=num_experts)
    assert torch.equal(blocks_per_expert, (counts + block_m - 1) // block_m), "BLOCK_M-aligned, no empty block"
    for b in range(num_used):
        row = pairs[b]
        valid = row[row < num_pairs]
        assert len(valid) > 0, "every used block holds a pair"
        assert (flat_ids[valid.long()] == owners[b]).all(), "each block belongs to one expert"
        assert (row[len(valid):] == num_pairs).all(), "padding at the end of a segment"
        assert (valid[1:] > valid[:-1]).all(), "pairs in order within an expert (a stable sort)"


def test_block_sizes_follow_the_rows_per_expert():
    assert choose_blocks(8, 128, torch.bfloat16).block_m == 16  # one decode token, top-8
    assert choose_blocks(256 * 8, 128, torch.bfloat16).block_m == 16  # a large decode batch: 16 rows per expert
    assert choose_blocks(8192 * 8, 128, torch.bfloat16).block_m == 128  # a prefill chunk
    assert max_padded_rows(8, 128, 16) == 8 * 16  # only the 8 experts hit can be padded


# ----------------------------------------------------------------------------------------------
# The fused MoE against the torch reference


CASES = {
    # name: (tokens, experts, top_k, hidden, intermediate, only these experts, block override)
    "one-token": (1, 4, 2, 64, 32, None, None),
    "mixtral-like": (7, 4, 2, 64, 64, None, None),
    "qwen3-like": (5, 16, 8, 64, 32, None, None),
    "ragged-sizes": (6, 4, 2, 48, 40, None, None),  # hidden and intermediate not multiples of the 32-wide tiles
    "empty-experts": (9, 8, 2, 32, 32, [0, 5, 7], None),
    "multi-block": (24, 4, 2, 32, 32, None, MoEBlocks(16, 32, 32)),  # up to 3 blocks per expert
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_moe_matches_the_torch_reference(name):
    num_tokens, num_experts, top_k, hidden, inter, only, blocks = CASES[name]
    experts = _experts(num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    top_ids, top_weights = _routing(num_tokens, num_experts, top_k, seed=2, experts=only)
    with torch.no_grad():
        got = fused_moe(x, experts.w13, experts.w2, top_ids, top_weights, blocks)
        ref = experts.reference_forward(x, top_ids, top_weights)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_empty_batch_deterministic_output_and_the_module_switch():
    experts = _experts(4, 32, 32)
    empty = torch.empty(0, 32, device=DEVICE)
    ids0 = torch.empty(0, 2, dtype=torch.long, device=DEVICE)
    with torch.no_grad():
        assert fused_moe(empty, experts.w13, experts.w2, ids0, torch.empty(0, 2, device=DEVICE)).shape == (0, 32)
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        top_ids, top_weights = _routing(3, 4, 2, seed=4)
        first = fused_moe(x, experts.w13, experts.w2, top_ids, top_weights)
        assert torch.equal(first, fused_moe(x, experts.w13, experts.w2, top_ids, top_weights)), "deterministic"
        experts.use_triton = True
        assert torch.equal(experts(x, top_ids, top_weights), first)
        experts.use_triton = False
        torch.testing.assert_close(experts(x, top_ids, top_weights), first, atol=1e-5, rtol=1e-5)


def test_backend_choice_and_cuda_graph_support(monkeypatch):
    experts = FusedExperts(4, 32, 32)
    cpu, cuda = torch.empty(0), types.SimpleNamespace(is_cuda=True)  # only the input's device is read
    assert not experts.uses_triton(cpu), "CPU tensors take the torch reference by default"
    assert experts.uses_triton(cuda), "CUDA tensors take the Triton path by default"
    experts.use_triton = False
    assert not experts.uses_triton(cuda), "use_triton forces a path"
    experts.use_triton = None
    monkeypatch.setenv("MINIVLLM_MOE_BACKEND", "torch")
    assert not experts.uses_triton(cuda)
    monkeypatch.setenv("MINIVLLM_MOE_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="MINIVLLM_MOE_BACKEND"):
        experts.uses_triton(cuda)


def test_tiny_qwen3_moe_model_with_triton_experts_matches_the_reference():
    """A prefill, then a mixed step of a decode and a new prompt: logits of the Triton experts match the
    reference's; the model reports CUDA-graph support exactly when its experts run the Triton path."""
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=128, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=True,
                                         architectures=["Qwen3MoeForCausalLM"])
    model = load_model(ModelConfig.from_hf_config(config, "tiny-qwen3-moe"), torch.float32, DEVICE, "dummy")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights that keep activations near unit variance, so the tolerance means something
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (11, 6)]
    steps = [[(0, prompts[0][:-1]), (1, prompts[1])], [(0, prompts[0][-1:]), (2, prompts[1][:3])]]
    outputs = {}
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    for use_triton in (False, True):
        for m in experts:
            m.use_triton = use_triton
        assert model.supports_cuda_graphs == use_triton
        runner = PagedRunner(model)
        outputs[use_triton] = [runner.step(chunks) for chunks in steps]
    for ref_step, got_step in zip(outputs[False], outputs[True]):
        for ref, got in zip(ref_step, got_step):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for m in experts:
        m.use_triton = None
    assert model.supports_cuda_graphs == (DEVICE == "cuda" and moe_module.moe_backend() == "triton")
