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
