"""The benchmark's roofline arithmetic, on cases small enough to work out by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from roofline import Ceilings, ModelCosts, roofline  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

CEIL = Ceilings(copy_bytes_per_s=1000.0, matmul_flops_per_s=100.0)
COSTS = ModelCosts(weight_bytes=100, matmul_params=2, kv_bytes_per_token=10, attn_flops_per_pair=1)


def test_two_requests_by_hand():
    # Prompts 2 and 3, outputs 3 and 1; vocab 5, hidden 2.
    r = roofline([2, 3], [3, 1], COSTS, CEIL, vocab=5, hidden=2)
    # Prefill: 2*2*(2+3) + 1*(3 + 6) causal pairs + 2*5*2*2 logits = 20 + 9 + 40 = 69 FLOPs.
    assert r["prefill_s"] == pytest.approx(69 / 100)
    # Decode steps 1 and 2 serve only the first request (output 3): it reads 100 + 10*(2+1), then 100 + 10*(2+2).
    assert r["decode_s"] == pytest.approx((130 + 140) / 1000)
    assert r["tok_s"] == pytest.approx(4 / (0.69 + 0.27))


def test_w1_on_qwen3_shape_matches_the_quoted_roofline():
    """With the issue's ceilings (4.27 TB/s, 783 TFLOP/s) W1 on Qwen3-0.6B comes to about 35,900 tok/s."""
    prompts, outputs = WORKLOADS["W1"].sample(151936)
    layer = 1024 * 4096 + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
    costs = ModelCosts(weight_bytes=(151936 * 1024 + 28 * layer + 1024) * 2, matmul_params=28 * layer,
                       kv_bytes_per_token=2 * 28 * 8 * 128 * 2, attn_flops_per_pair=4 * 28 * 16 * 128)
    r = roofline([len(p) for p in prompts], outputs, costs, Ceilings(4.27e12, 783e12), 151936, 1024)
    assert sum(outputs) == 148756
    assert 34_000 < r["tok_s"] < 37_000
    assert r["decode_s"] > 10 * r["prefill_s"]  # decode-bound, as the issue says


def test_tensor_parallel_roofline_by_hand():
    """Two GPUs: each reads half the weights and, with the KV heads split, half the KV, does half the FLOPs,
    and each decode step pays its all-reduces (here 2 of 0.01 s per active request)."""
    r = roofline([2, 3], [3, 1], COSTS, CEIL, vocab=5, hidden=2, num_gpus=2, all_reduce_s=lambda b: 0.01 * b,
                 num_all_reduces=2)
    assert r["prefill_s"] == pytest.approx(69 / 2 / 100)
    assert r["decode_s"] == pytest.approx(((50 + 10 * 3 / 2) + (50 + 10 * 4 / 2)) / 1000)
    assert r["all_reduce_s"] == pytest.approx(2 * 2 * 0.01)
    assert r["tok_s"] == pytest.approx(4 / (0.345 + 0.135 + 0.04))


@pytest.mark.parametrize("tied", [False, True])
def test_costs_from_the_config_equal_the_ones_counted_on_the_model(tmp_path, tied):
    import torch
    import transformers
    from roofline import full_model_costs, model_costs

    from engine.loading.loader import load_model
    from engine.loading.model_config import ModelConfig

    hf = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                                  architectures=["LlamaForCausalLM"])
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    model = load_model(config, torch.float32, "cpu", load_format="dummy")
    assert full_model_costs(config, elem=4) == model_costs(model, config)


def test_moe_decode_reads_the_experts_its_tokens_are_routed_to():
    """Of 100 weight bytes, 80 are 4 experts of which each token takes 1 (k/E = 1/4): one token reads 20 + 80/4,
    two read 20 + 80 * (1 - (3/4)^2); a large batch reads nearly all of them."""
    costs = ModelCosts(weight_bytes=100, matmul_params=2, kv_bytes_per_token=10, attn_flops_per_pair=1,
                       expert_bytes=80, num_experts=4, top_k=1)
    assert costs.step_weight_bytes(1) == pytest.approx(40)
    assert costs.step_weight_bytes(2) == pytest.approx(20 + 80 * 7 / 16)
    assert costs.step_weight_bytes(1000) == pytest.approx(100)
    r = roofline([2, 3], [3, 1], costs, CEIL, vocab=5, hidden=2)
    assert r["decode_s"] == pytest.approx((40 + 30 + 40 + 40) / 1000)  # steps 1 and 2: one active request


def test_moe_costs_count_k_experts_per_token(tmp_path):
    import torch
    import transformers
    from roofline import model_costs

    from engine.loading.loader import load_model
    from engine.loading.model_config import ModelConfig

    hf = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     num_experts=8, num_experts_per_tok=2, architectures=["Qwen3MoeForCausalLM"])
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    costs = model_costs(load_model(config, torch.float32, "cpu", load_format="dummy"), config)
    expert_params = 2 * 8 * 3 * 32 * 16  # two layers of 8 experts: gate, up and down of 32 x 16
    assert costs.expert_bytes == expert_params * 4 and (costs.num_experts, costs.top_k) == (8, 2)
    # A layer: q|k|v 32 x (32 + 16 + 16), o 32 x 32, q/k norms 8 + 8, two norms of 32, the router 8 x 32.
    layers = 2 * (32 * 64 + 32 * 32 + 2 * 8 + 2 * 32 + 8 * 32)
    embed = head = 64 * 32  # untied
    assert costs.weight_bytes == (embed + layers + 32 + head + expert_params) * 4
    assert costs.matmul_params == layers + 32 + expert_params * 2 // 8
