"""Fused Triton ops (norms, rope, SwiGLU) against the torch code of ``engine.models`` (norm, rotary, activation), the
reference.

On a GPU they run as compiled kernels on CUDA tensors. Without one they run in Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, which conftest sets on hosts without CUDA).

The interpreter casts float32 to bfloat16 by truncation instead of rounding to nearest, so
bfloat16 is checked only loosely there (indexing, not rounding); float32 and float16 are tight.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.loading.loader import load_model  # noqa: E402
from engine.loading.model_config import ModelConfig  # noqa: E402
from engine.models.activation import SiluAndMul  # noqa: E402
from engine.models.linear import LinearOutput  # noqa: E402
from engine.models.norm import RMSNorm  # noqa: E402
from engine.models.rotary import get_rope  # noqa: E402
from engine.ops import fused as fused_ops  # noqa: E402
from tests.helpers import VOCAB, PagedRunner, save_tiny_model, set_use_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU: run with TRITON_INTERPRET=1 to test the kernels on the CPU", allow_module_level=True)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return dict(atol=1e-6, rtol=1e-6)
    if dtype == torch.float16 or DEVICE == "cuda":
        return dict(atol=1e-2, rtol=1e-2)
    return dict(atol=6e-2, rtol=6e-2)  # the interpreter's bfloat16 truncation, a few times over


def _assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Close, and for 16-bit dtypes rounded in the same order: nearly every element bit-identical.

    Only float32 reduction order and rsqrt/exp differ, which flip a 16-bit rounding rarely; rounding
    at a different step (say, the weight multiplied before the cast back) changes a large fraction.
    """
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, **_tol(got.dtype))
    if got.dtype == torch.float16 or (got.dtype == torch.bfloat16 and DEVICE == "cuda"):
        identical = (got == ref).float().mean().item()
        assert identical > 0.99, f"only {identical:.1%} of elements bit-identical: different rounding order?"


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def _strided_rows(num_tokens: int, width: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[num_tokens, width] whose rows are ``width + 24`` elements apart and start 8 in: not contiguous."""
    return _randn(num_tokens, width + 24, dtype=dtype, seed=seed, scale=scale)[:, 8 : 8 + width]


def _torch_norm(hidden_size: int, dtype: torch.dtype, seed: int, eps: float = 1e-6) -> RMSNorm:
    norm = RMSNorm(hidden_size, eps).to(device=DEVICE, dtype=dtype)
    norm.use_triton = False
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.empty(hidden_size).uniform_(0.5, 1.5, generator=gen))
    return norm


# ----------------------------------------------------------------------------------------------
# RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [576, 1024, 96])
def test_rms_norm_matches_torch(dtype, hidden_size):
    norm = _torch_norm(hidden_size, dtype, seed=1)
    x = _strided_rows(7, hidden_size, dtype, seed=2)
    _assert_matches(fused_ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    x = _randn(5, hidden_size, dtype=dtype, seed=3, scale=30.0)  # large values: the float32 sum must not lose them
    _assert_matches(fused_ops.rms_norm(x, norm.weight, norm.eps), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [576, 1024])
def test_fused_add_rms_norm_matches_torch(dtype, hidden_size):
    norm = _torch_norm(hidden_size, dtype, seed=4, eps=1e-5)
    x = _strided_rows(9, hidden_size, dtype, seed=5)
    residual = _strided_rows(9, hidden_size, dtype, seed=6)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_ops.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    ref_out, ref_residual = norm(x, residual)
    # The sum is one correctly rounded add on both paths (except under the interpreter's bfloat16 truncation).
    interpreted_bf16 = dtype == torch.bfloat16 and DEVICE == "cpu"
    exact = dict(atol=0, rtol=0)
    torch.testing.assert_close(new_residual, ref_residual, **(_tol(dtype) if interpreted_bf16 else exact))
    _assert_matches(out, ref_out)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not be written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_slices", [2, 3])
def test_fused_add_rms_norm_adds_partial_products_first(dtype, num_slices):
    """Partial products of K's slices ([slices, tokens, hidden], ``LinearOutput.partials``) give what the norm gives
    on their sum rounded once, and the module takes them on either path."""
    norm = _torch_norm(576, dtype, seed=9)
    slices = torch.stack([_randn(6, 576, dtype=dtype, seed=10 + i) for i in range(num_slices)])
    residual = _randn(6, 576, dtype=dtype, seed=20)
    whole = slices.float().sum(0).to(dtype)
    ref_out, ref_residual = norm(whole, residual)
    out, new_residual = fused_ops.fused_add_rms_norm(slices, residual, norm.weight, norm.eps)
    _assert_matches(new_residual, ref_residual)
    _assert_matches(out, ref_out)
    torch_out, torch_residual = norm(LinearOutput(slices[0], partials=slices), residual)
    torch.testing.assert_close(torch_out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(torch_residual, ref_residual, atol=0, rtol=0)
    norm.use_triton = True
    got_out, got_residual = norm(LinearOutput(slices[0], partials=slices), residual)
    _assert_matches(got_out, ref_out)
    _assert_matches(got_residual, ref_residual)
    _assert_matches(norm(LinearOutput(slices[0], partials=slices)), norm(whole))  # without a residual: added up first


def test_rms_norm_module_uses_the_kernel_on_3d_views():
    """The module flattens leading dims (a qkv view here) and restores them."""
    norm = _torch_norm(32, torch.float32, seed=7)
    qkv = _randn(5, 3 * 4 * 32, dtype=torch.float32, seed=8)
    q = qkv[:, : 4 * 32].reshape(5, 4, 32)
    ref = norm(q)
    norm.use_triton = True
    torch.testing.assert_close(norm(q), ref, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# Rotary embedding (+ Qwen3's per-head q/k norm)


def _qk_views(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, seed: int):
    """q, k as strided views of one fused qkv projection output, as the attention module passes them."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=seed, scale=2.0)
    q = qkv[:, :q_size].reshape(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    return q, k


# (num_heads, num_kv_heads, head_dim): Qwen3-0.6B-like GQA, SmolLM2's 9/3 x 64, a head_dim whose half
# is not a power of two, and more heads than one tile holds (the kernel loops over head groups).
ROPE_SHAPES = [(16, 8, 128), (9, 3, 64), (6, 2, 96), (40, 8, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "qk_norm_rope"])
def test_rotary_matches_torch(dtype, shape, with_norm):
    num_heads, num_kv_heads, head_dim = shape
    rope = get_rope(head_dim, 4096, 1e6).to(DEVICE)
    rope.use_triton = False
    positions = torch.tensor([3, 4095, 0, 17, 17, 1000, 2], device=DEVICE)  # out of order, repeated
    q, k = _qk_views(len(positions), num_heads, num_kv_heads, head_dim, dtype, seed=head_dim)
    q_before, k_before = q.clone(), k.clone()
    if with_norm:
        q_norm, k_norm = _torch_norm(head_dim, dtype, seed=10), _torch_norm(head_dim, dtype, seed=11)
        got = fused_ops.qk_norm_rotary(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, rope.cos_sin_cache)
        ref = rope(positions, q, k, q_norm, k_norm)
    else:
        got = fused_ops.rotary(positions.to(torch.int32), q, k, rope.cos_sin_cache)
        ref = rope(positions, q, k)
    for g, r in zip(got, ref):
        assert g.is_contiguous()
        _assert_matches(g, r)
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "inputs must not be written"


def test_rotary_with_llama3_table_and_strided_heads():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rope = get_rope(64, 512, 5e5, scaling).to(DEVICE)
    rope.use_triton = False
    positions = torch.tensor([511, -1, 0, -1, 100, -1, 63], device=DEVICE)[::2]  # strided too
    # MHA (as many kv heads as q heads), and heads that are not adjacent: strided in dims 0 and 1.
    q = _randn(4, 4, 80, dtype=torch.float32, seed=12)[:, :, 16:]
    k = _randn(4, 8, 64, dtype=torch.float32, seed=13)[:, ::2]
    for g, r in zip(fused_ops.rotary(positions, q, k, rope.cos_sin_cache), rope(positions, q, k)):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# SwiGLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter_size", [300, 1536])  # 1536: more than one column block per row
def test_silu_and_mul_matches_torch(dtype, inter_size):
    x = _strided_rows(6, 2 * inter_size, dtype, seed=13, scale=3.0)  # well into silu's curved range
    ref_module = SiluAndMul()
    ref_module.use_triton = False
    _assert_matches(fused_ops.silu_and_mul(x), ref_module(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_slices", [2, 3])
def test_silu_and_mul_adds_partial_products_first(dtype, num_slices):
    """Partial products of gate|up ([slices, tokens, 2 * inter], ``LinearOutput.partials``) give the SwiGLU of their
    sum rounded once, plain and as an FP8 linear's input, and the module takes them on either path."""
    slices = torch.stack([_randn(5, 2 * 384, dtype=dtype, seed=30 + i, scale=2.0) for i in range(num_slices)])
    whole = slices.float().sum(0).to(dtype)
    torch_path = SiluAndMul()
    torch_path.use_triton = False
    ref = torch_path(whole)
    _assert_matches(fused_ops.silu_and_mul(slices), ref)
    assert torch.equal(torch_path(LinearOutput(slices[0], partials=slices)), ref)
    fused_path = SiluAndMul()
    fused_path.use_triton = True
    _assert_matches(fused_path(LinearOutput(slices[0], partials=slices)), ref)
    values, scales = fused_ops.silu_and_mul_fp8(slices)
    want_values, want_scales = fused_ops.silu_and_mul_fp8(whole)
    if dtype != torch.bfloat16 or DEVICE == "cuda":  # the interpreter truncates the sum's rounding to bfloat16
        assert _same_bits(values, want_values) and torch.equal(scales, want_scales)
    with pytest.raises(ValueError, match="1 to 16 partial products, got 17"):
        fused_ops.silu_and_mul(whole.expand(17, *whole.shape))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _assert_same_quantization(values, scales, want_values, want_scales) -> None:
    """FP8 rows and their group scales as ``quantize_rows`` gives them for rows normed in another kernel. The
    compiler may sum a row's squares in another order there (its layouts follow the stores), which can move a
    rounding: nearly every byte identical, each scale within a bf16 step, each value within one FP8 step."""
    assert values.shape == want_values.shape and scales.shape == want_scales.shape and scales.stride(0) == 1
    identical = (values.view(torch.uint8) == want_values.view(torch.uint8)).float().mean().item()
    assert identical > 0.95, f"only {identical:.1%} of the FP8 bytes identical"
    torch.testing.assert_close(scales, want_scales, rtol=1e-2, atol=0)
    got = values.float() * scales.repeat_interleave(128, 1)
    want = want_values.float() * want_scales.repeat_interleave(128, 1)
    assert ((got - want).abs() <= want.abs() / 8 + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 6, 8])  # padded to 4, 8 and 8 rows for cuBLAS
@pytest.mark.parametrize("swiglu_rows_from", [1024, 1])  # 1: SwiGLU takes 4 rows a program, as prefill steps do
def test_fp8_outputs_are_what_the_linear_would_quantize(dtype, num_tokens, swiglu_rows_from, monkeypatch):
    """The norms and SwiGLU written as an FP8 linear's input: the float8 values and scales of quantizing their
    ordinary output with ``fp8_kernels.quantize_rows`` (SwiGLU's bit for bit), the padding rows zeros, the residual
    sum unchanged."""
    from engine.ops import fp8 as fp8_kernels
    from engine.ops.fused import activation

    monkeypatch.setattr(activation, "_SWIGLU_ROWS_FROM", swiglu_rows_from)

    hidden, inter = 384, 640  # 3 and 5 groups of 128; SwiGLU's columns in blocks of 1024, so one partial block
    x = _strided_rows(num_tokens, hidden, dtype, seed=21, scale=2.0)
    residual = _randn(num_tokens, hidden, dtype=dtype, seed=22)
    weight = _randn(hidden, dtype=dtype, seed=23).abs() + 0.5
    for res in (None, residual):
        values, scales, new_residual = fused_ops.rms_norm_fp8(x, weight, 1e-5, res)
        if res is None:
            normed, want_residual = fused_ops.rms_norm(x, weight, 1e-5), None
        else:
            normed, want_residual = fused_ops.fused_add_rms_norm(x, res, weight, 1e-5)
        want_values, want_scales = fp8_kernels.quantize_rows(normed, 128, cublas_layout=True)
        assert values.shape == (-(-num_tokens // 4) * 4, hidden)
        _assert_same_quantization(values, scales, want_values, want_scales)
        assert not values[num_tokens:].float().any()
        assert (new_residual is None) == (res is None)
        if res is not None:
            assert torch.equal(new_residual, want_residual)
    # The down projection's per-channel weight scales, left on its product for the next add-norm to apply.
    hidden_scales = _randn(hidden, dtype=torch.float32, seed=26).abs() + 0.1
    scaled_x = fp8_kernels.scale_columns_(x.clone(), hidden_scales)
    got = fused_ops.fused_add_rms_norm(x, residual, weight, 1e-5, column_scales=hidden_scales)
    want = fused_ops.fused_add_rms_norm(scaled_x, residual, weight, 1e-5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    values, scales, new_residual = fused_ops.rms_norm_fp8(x, weight, 1e-5, residual, column_scales=hidden_scales)
    want_values, want_scales, want_residual = fused_ops.rms_norm_fp8(scaled_x, weight, 1e-5, residual)
    assert _same_bits(values, want_values) and torch.equal(scales, want_scales)
    assert torch.equal(new_residual, want_residual)
    torch_norm = RMSNorm(hidden, 1e-5).to(dtype)
    torch_norm.weight.data.copy_(weight)
    torch_norm.use_triton = False
    got = torch_norm(LinearOutput(x, column_scales=hidden_scales), residual)
    want = torch_norm((x.float() * hidden_scales).to(dtype), residual)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gate_up = _strided_rows(num_tokens, 2 * inter, dtype, seed=24, scale=3.0)
    values, scales = fused_ops.silu_and_mul_fp8(gate_up)
    want_values, want_scales = fp8_kernels.quantize_rows(fused_ops.silu_and_mul(gate_up), 128, cublas_layout=True)
    assert _same_bits(values, want_values) and torch.equal(scales, want_scales)
    assert not values[num_tokens:].float().any()
    # gate|up's per-channel weight scales, left on the product for SwiGLU to apply (prefill's 128 x 128 tiles).
    column_scales = _randn(2 * inter, dtype=torch.float32, seed=25).abs() + 0.1
    scaled = fp8_kernels.scale_columns_(gate_up.clone(), column_scales)
    assert torch.equal(fused_ops.silu_and_mul(gate_up, column_scales=column_scales), fused_ops.silu_and_mul(scaled))
    values, scales = fused_ops.silu_and_mul_fp8(gate_up, column_scales)
    want_values, want_scales = fp8_kernels.quantize_rows(fused_ops.silu_and_mul(scaled), 128, cublas_layout=True)
    assert _same_bits(values, want_values) and torch.equal(scales, want_scales)
    torch_path = SiluAndMul()
    torch_path.use_triton = False
    _assert_matches(torch_path(LinearOutput(gate_up, column_scales=column_scales)), torch_path(scaled))
    with pytest.raises(ValueError, match="multiple of 128"):
        fused_ops.rms_norm_fp8(x[:, :320], weight[:320], 1e-5)


# ----------------------------------------------------------------------------------------------
# Input checks and edge cases


def test_empty_batches_launch_nothing():
    w = torch.ones(64, device=DEVICE)
    x = torch.empty(0, 64, device=DEVICE)
    assert fused_ops.rms_norm(x, w, 1e-6).shape == (0, 64)
    assert [t.shape for t in fused_ops.fused_add_rms_norm(x, x, w, 1e-6)] == [(0, 64), (0, 64)]
    assert fused_ops.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)
    q, k = torch.empty(0, 4, 32, device=DEVICE), torch.empty(0, 2, 32, device=DEVICE)
    cache = torch.zeros(16, 32, device=DEVICE)
    q_out, k_out = fused_ops.rotary(torch.empty(0, dtype=torch.long, device=DEVICE), q, k, cache)
    assert q_out.shape == (0, 4, 32) and k_out.shape == (0, 2, 32)


def test_wrappers_reject_bad_input():
    x = torch.randn(4, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    bad_norm_calls = {
        "3-D": lambda: fused_ops.rms_norm(x[None], w, 1e-6),
        "weight size": lambda: fused_ops.rms_norm(x, torch.ones(32, device=DEVICE), 1e-6),
        "weight dtype": lambda: fused_ops.rms_norm(x, w.half(), 1e-6),
        "last dim strided": lambda: fused_ops.rms_norm(torch.randn(64, 4, device=DEVICE).t(), w, 1e-6),
        "int dtype": lambda: fused_ops.rms_norm(x.long(), w.long(), 1e-6),
        "residual shape": lambda: fused_ops.fused_add_rms_norm(x, x[:3], w, 1e-6),
        "residual dtype": lambda: fused_ops.fused_add_rms_norm(x, x.double(), w, 1e-6),
        "odd silu width": lambda: fused_ops.silu_and_mul(x[:, :63]),
    }
    _assert_all_rejected(bad_norm_calls)

    positions = torch.arange(4, device=DEVICE)
    q, k = torch.randn(4, 4, 32, device=DEVICE), torch.randn(4, 2, 32, device=DEVICE)
    cache = get_rope(32, 64, 1e4).to(DEVICE).cos_sin_cache
    bad_rope_calls = {
        "q 2-D": lambda: fused_ops.rotary(positions, q[:, 0], k, cache),
        "k tokens": lambda: fused_ops.rotary(positions, q, k[:3], cache),
        "k head_dim": lambda: fused_ops.rotary(positions, q, torch.randn(4, 2, 16, device=DEVICE), cache),
        "k dtype": lambda: fused_ops.rotary(positions, q, k.half(), cache),
        "odd head_dim": lambda: fused_ops.rotary(positions, q[..., :31], k[..., :31], cache[:, :31]),
        "positions float": lambda: fused_ops.rotary(positions.float(), q, k, cache),
        "positions length": lambda: fused_ops.rotary(positions[:3], q, k, cache),
        "cache width": lambda: fused_ops.rotary(positions, q, k, cache[:, :16]),
        "cache dtype": lambda: fused_ops.rotary(positions, q, k, cache.half()),
        "norm weight size": lambda: fused_ops.qk_norm_rotary(positions, q, k, w, w, 1e-6, cache),
        "norm weight dtype": lambda: fused_ops.qk_norm_rotary(
            positions, q, k, torch.ones(32, device=DEVICE, dtype=torch.half), torch.ones(32, device=DEVICE),
            1e-6, cache),
    }
    _assert_all_rejected(bad_rope_calls)


def _assert_all_rejected(calls: dict) -> None:
    for what, call in calls.items():
        try:
            call()
        except ValueError:
            continue
        pytest.fail(f"accepted bad input: {what}")


# ----------------------------------------------------------------------------------------------
# A whole model


@pytest.mark.parametrize("name", ["qwen3", "llama-llama3-rope"])
def test_tiny_model_fused_matches_torch_path(name, tmp_path):
    """Prefill, then a decode and a mixed step: the fused path's logits match the torch path's."""
    model = load_model(ModelConfig.from_pretrained(save_tiny_model(name, tmp_path)), torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (19, 33)]
    steps = [[(0, prompts[0][:-1]), (1, prompts[1][:-1])],
             [(0, prompts[0][-1:]), (1, prompts[1][-1:]), (2, prompts[0][:5])]]
    outputs = {}
    for use_triton in (False, True):
        set_use_triton(model, use_triton)
        runner = PagedRunner(model)
        outputs[use_triton] = [runner.step(chunks) for chunks in steps]
    for ref_step, got_step in zip(outputs[False], outputs[True]):
        for ref, got in zip(ref_step, got_step):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "fused"])
def test_decode_products_split_along_k_give_the_whole_products_logits(use_triton, tmp_path, monkeypatch):
    """``MINIVLLM_DECODE_KSPLIT``: q|k|v, o, gate|up and down of decode-sized steps as partial products of K's slices,
    added by the kernel that reads them next (the rope and KV-cache write, the add-norm, SwiGLU; on the fused path with
    the Triton attention backend), give the logits of whole products (float32), one count for all or counts by
    product; prompts longer than the decode sizes stay whole."""
    import transformers

    from engine.models.linear import decode_k_split_summary, unquantized
    from tests.helpers import SMALL_CONFIG, save_checkpoint

    config = transformers.Qwen3Config(**{**SMALL_CONFIG, "hidden_size": 128, "intermediate_size": 256}, head_dim=32,
                                      tie_word_embeddings=False)
    path = save_checkpoint(config, tmp_path)
    gen = torch.Generator().manual_seed(0)
    # Decode sizes up to 32 tokens rather than 256 (DECODE_KSPLIT_MAX_ROWS), so that a short prompt is past them (the
    # interpreter runs the rope, norm and attention kernels a program per token).
    monkeypatch.setattr(unquantized, "DECODE_KSPLIT_MAX_ROWS", 32)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (19, 30, 12)]
    steps = [[(0, prompts[0][:-1])], [(0, prompts[0][-1:]), (1, prompts[1]), (2, prompts[2])]]
    outputs, made = {}, []
    real_k_slice_products = unquantized.k_slice_products
    monkeypatch.setattr(unquantized, "k_slice_products", lambda x, weight, slices: made.append(
        (slices, tuple(weight.shape), x.shape[0])) or real_k_slice_products(x, weight, slices))
    qkv, o, gate_up, down = (256, 128), (128, 128), (512, 128), (128, 256)  # the weights, [out, in]
    cases = {  # setting: (slices, weight) of each product cut, in layer order, both layers
        "0": [],
        "2": [(2, qkv), (2, o), (2, gate_up), (2, down)] * 2,
        "4": [(4, down)] * 2,  # the others' K of 128 does not cut into 4 slices of a multiple of 64
        "gate_up=1,down=2": [(2, down)] * 2,
        " o=2, gate_up=2 ": [(2, o), (2, gate_up)] * 2,
        "qkv=2": [(2, qkv)] * 2,
    }
    summaries = {"0": "", "2": "qkv: 2 slices, o: 2 slices, gate_up: 2 slices, down: 2 slices", "4": "down: 4 slices",
                 "gate_up=1,down=2": "down: 2 slices", " o=2, gate_up=2 ": "o: 2 slices, gate_up: 2 slices",
                 "qkv=2": "qkv: 2 slices"}
    if use_triton:  # the interpreted Triton attention is the slow part: every product cut, and none
        cases = {setting: cases[setting] for setting in ("0", "2")}
    for setting, want in cases.items():
        monkeypatch.setenv("MINIVLLM_DECODE_KSPLIT", setting)
        made.clear()
        model = load_model(ModelConfig.from_pretrained(path), torch.float32, DEVICE)
        set_use_triton(model, use_triton)
        assert decode_k_split_summary(model) == summaries[setting]  # the start-up log's line
        runner = PagedRunner(model)
        if use_triton:
            for layer in model.attention_layers():
                layer.set_backend(TritonAttentionBackend())
        outputs[setting] = [runner.step(chunks) for chunks in steps]
        # Only the 18-token step is cut; the 43-token one is past the decode sizes.
        assert [(k, shape) for k, shape, _ in made] == want and {rows for _, _, rows in made} <= {18}
    for setting in cases:
        for ref_step, got_step in zip(outputs["0"], outputs[setting]):
            for ref, got in zip(ref_step, got_step):
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_decode_k_split_setting_is_checked(monkeypatch):
    from engine.models.linear import ksplit

    monkeypatch.setenv("MINIVLLM_DECODE_KSPLIT", "4")
    assert [ksplit.decode_k_slices(p, 1024) for p in ("qkv", "o", "gate_up", "down")] == [4, 4, 4, 4]
    assert ksplit.decode_k_slices("o", 192) == 1  # 4 slices of 48 columns: left whole
    monkeypatch.setenv("MINIVLLM_DECODE_KSPLIT", "o=4,down=8")
    assert [ksplit.decode_k_slices(p, 1024) for p in ("qkv", "o", "gate_up", "down")] == [1, 4, 1, 8]
    for bad, match in (("two", "'two' is not a product"), ("o=2,q=2", "'q' is not a product"),
                       ("o=2,o=4", "'o' is not a product .* or is named twice"), ("down=17", "got '17' for down"),
                       ("gate_up=", "got '' for gate_up")):
        monkeypatch.setenv("MINIVLLM_DECODE_KSPLIT", bad)
        with pytest.raises(ValueError, match=match):
            ksplit.decode_k_slices("o", 1024)
    with pytest.raises(ValueError, match="no K-split for product 'lm_head'"):
        ksplit.decode_k_slices("lm_head", 1024)


def test_decode_k_split_by_default_cuts_o_and_down_to_fill_the_gpu(monkeypatch):
    """``auto`` (the default): on a GPU, products whose K is at least their width get the most slices (a power of
    two up to 4) that keep ~2 x width / 128 output tiles times the slices within the SM count: the counts measured
    best on an H100 (132 SMs) for both benchmark shapes. Nothing is cut on the CPU."""
    from engine.models.linear import ksplit

    monkeypatch.delenv("MINIVLLM_DECODE_KSPLIT", raising=False)
    sms = {"count": 132}
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"multi_processor_count": sms["count"]})())
    cuda = torch.device("cuda")
    shapes = {  # product: (in, out) of Qwen3-0.6B, of Llama-3.1-8B
        "qkv": ((1024, 4096), (4096, 6144)), "o": ((2048, 1024), (4096, 4096)),
        "gate_up": ((1024, 6144), (4096, 28672)), "down": ((3072, 1024), (14336, 4096)),
    }
    counts = {p: tuple(ksplit.decode_k_slices(p, k, n, cuda) for k, n in pair) for p, pair in shapes.items()}
    assert counts == {"qkv": (1, 1), "o": (4, 2), "gate_up": (1, 1), "down": (4, 2)}
    assert ksplit.decode_k_slices("o", 2048, 1024, torch.device("cpu")) == 1
    assert ksplit.decode_k_slices("o", 2048, 1024) == 1  # no shape and device given: whole
    assert ksplit.decode_k_slices("o", 192, 64, cuda) == 1  # 2 slices of 96 columns: not multiples of 64
    sms["count"] = 58  # a smaller GPU: the 8B's 64 tiles of o already outnumber its SMs
    assert ksplit.decode_k_slices("o", 4096, 4096, cuda) == 1 and ksplit.decode_k_slices("o", 2048, 1024, cuda) == 2
    monkeypatch.setenv("MINIVLLM_DECODE_KSPLIT", "0")
    assert ksplit.decode_k_slices("o", 2048, 1024, cuda) == 1


class _Block(torch.nn.Module):
    """A decoder block's products as the K-split setting sees them: q|k|v, gate|up and down, each handed on to a
    kernel that may add partial products (``deferred_products``)."""

    deferred_products = ("qkv_proj", "gate_up_proj", "down_proj")

    def __init__(self, qkv_bias: bool = False):
        super().__init__()
        from engine.models.linear import FusedLinear, RowParallelLinear

        self.qkv_proj = FusedLinear(128, {"q_proj": 256, "k_proj": 64, "v_proj": 64}, bias=qkv_bias)
        self.gate_up_proj = FusedLinear(128, {"gate_proj": 256, "up_proj": 256}, bias=False)
        self.down_proj = RowParallelLinear(512, 128, bias=False)
        for param in self.parameters():
            torch.nn.init.normal_(param, std=0.05)


def _slices(layer) -> int:
    return getattr(layer.method, "k_slices", 1)


def test_row_parallel_products_are_not_cut_on_several_ranks(monkeypatch):
    """With tensor parallelism o's and down's partial products are all-reduced whole, so they are never cut along K
    (and the start-up log does not list them); one rank cuts as set."""
    from engine import distributed
    from engine.models.linear import decode_k_split_summary, use_decode_k_split

    monkeypatch.setenv("MINIVLLM_DECODE_KSPLIT", "2")
    block = _Block()
    use_decode_k_split(block)
    assert _slices(block.down_proj) == 2 and decode_k_split_summary(block).endswith("down: 2 slices")
    monkeypatch.setattr(distributed, "_state", distributed.ParallelState(rank=1, world_size=2))
    block = _Block()
    use_decode_k_split(block)
    assert block.down_proj.weight.shape == (128, 256) and _slices(block.down_proj) == 1
    assert _slices(block.gate_up_proj) == 2 and "down" not in decode_k_split_summary(block)


def test_start_up_log_lists_only_products_that_are_cut(monkeypatch):
    """A product with a bias or FP8 weights is never cut, whatever the setting: the start-up log leaves it out. A
    cut product comes as partial products at decode sizes only, and from ``forward_deferred`` only."""
    from engine.models.linear import Fp8LinearMethod, decode_k_split_summary, use_decode_k_split

    monkeypatch.setenv("MINIVLLM_DECODE_KSPLIT", "2")
    block = _Block(qkv_bias=True)
    block.down_proj.set_method(Fp8LinearMethod())
    use_decode_k_split(block)
    assert decode_k_split_summary(block) == "gate_up: 2 slices"
    x = torch.randn(3, 128)
    assert block.gate_up_proj.forward_deferred(x).partials.shape == (2, 3, 512)
    assert block.gate_up_proj.forward_deferred(torch.randn(257, 128)).partials is None  # past the decode sizes
    assert block.gate_up_proj.forward_deferred(x, partials_ok=False).partials is None
    assert block.qkv_proj.forward_deferred(x).partials is None
    torch.testing.assert_close(block.gate_up_proj.forward_deferred(x).finished(), block.gate_up_proj(x))


def test_host_integer_helpers_match_tritons():
    """The launch-sizing helpers give what triton.cdiv and triton.next_power_of_2 give, on every size a launch meets
    (0 included), including sizes handed over as numpy integers."""
    import numpy as np
    import triton

    from engine.ops.intmath import cdiv, next_power_of_2

    sizes = list(range(0, 4200)) + [2**k + d for k in range(12, 32) for d in (-1, 0, 1)]
    for n in sizes:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 128, 1000):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
    assert next_power_of_2(np.int64(300)) == 512 and cdiv(np.int64(300), 128) == 3
