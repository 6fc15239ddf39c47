"""FP8 KV cache and FP8 weights through the engine, on tiny random models (CPU, float32 compute).

The CPU runs the same quantization the GPU does (float8_e4m3 K/V with a scale per token and head;
weights per output channel or per 128 x 128 block, activations per token and 128 columns), followed by float32
arithmetic, so these tests pin down the numerics; the GPU tests compare the kernels with it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.loading import fp8_weights
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from engine.models import fp8
from kvcache.paged_cache import PagedKVCache
from tests.helpers import PagedRunner, save_checkpoint, save_tiny_model, set_use_triton
from tests.test_engine import make_prompts

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import TINY_MODEL_NAME, start_server, tiny_server_args  # noqa: E402

pytest_plugins = ["tests.server_helpers"]

# Dimensions that are whole 128 x 128 blocks, as FP8 checkpoints need for q|k|v and gate|up.
BLOCK_CONFIG = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6,
                    tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama-fp8"))


@pytest.fixture(scope="module")
def block_dirs(tmp_path_factory):
    """(float32 checkpoint, the same weights as an FP8 checkpoint in Hugging Face's block format)."""
    dense = save_checkpoint(transformers.LlamaConfig(**BLOCK_CONFIG), tmp_path_factory.mktemp("dense"))
    quantized = tmp_path_factory.mktemp("fp8-blocks")
    tensors = {}
    for name, tensor in load_file(dense / "model.safetensors").items():
        if name.endswith("proj.weight"):
            values, scales = quantize_blocks(tensor, 128)
            tensors[name], tensors[name + "_scale_inv"] = values, scales
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    save_file(tensors, quantized / "model.safetensors")
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(config))
    return dense, quantized


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How FP8 checkpoints store a weight: float8 values and a float32 scale per block x block tile."""
    rows, cols = w.shape
    tiles = w.float().view(rows // block, block, cols // block, block)
    scales = tiles.abs().amax(dim=(1, 3)) / 448.0
    values = (tiles / scales[:, None, :, None]).to(torch.float8_e4m3fn).view(rows, cols)
    return values, scales


def hf_logits(model_dir, prompt: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


def our_logits(model, prompt: list[int]) -> torch.Tensor:
    return PagedRunner(model).step([(0, prompt)])[0]


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


# ------------------------------------------------------------------------------------ FP8 KV cache


def test_fp8_pool_holds_about_twice_the_tokens():
    """K/V at one byte plus a float32 scale per (token, head): 128-dim heads hold 1.94x bfloat16's tokens."""
    budget = 2**30
    dense = PagedKVCache.num_blocks_for_budget(budget, 28, 16, 8, 128, torch.bfloat16)
    small = PagedKVCache.num_blocks_for_budget(budget, 28, 16, 8, 128, torch.float8_e4m3fn)
    assert small / dense == pytest.approx(2 * 128 / 132, rel=1e-3)
    cache = PagedKVCache(2, 4, 16, 2, 64, torch.float8_e4m3fn, "cpu")
    assert cache.layer_scales(1)[0].shape == (4, 16, 2) and "float8_e4m3" in cache.describe()
    assert cache.nbytes == 4 * PagedKVCache.bytes_per_block(2, 16, 2, 64, torch.float8_e4m3fn)
    assert PagedKVCache(2, 4, 16, 2, 64, torch.float32, "cpu").layer_scales(0) is None


def test_fp8_kv_logits_stay_close_and_cache_copies_carry_scales(llama_dir):
    """Prefill logits with an FP8 cache are within FP8's rounding of float32's (not equal: it does quantize);
    copying a block (beam search's copy-on-write) copies its scales with it."""
    prompt = make_prompts(320, lens=[60], seed=5)[0]
    model = load_model(ModelConfig.from_pretrained(llama_dir), torch.float32, "cpu")
    exact = hf_logits(llama_dir, prompt)
    runner = PagedRunner(model)
    for attn in model.attention_layers():
        shape = attn.k_cache.shape
        attn.bind_kv_cache(torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.zeros(shape, dtype=torch.float8_e4m3fn),
                           (torch.ones(shape[:3]), torch.ones(shape[:3])))
    ours = runner.step([(0, prompt[:40])])[0]
    ours = torch.cat([ours, runner.step([(0, prompt[40:])])[0]])  # the second chunk reads the first from the cache
    error = relative_error(ours, exact)
    assert 0 < error < 0.08, f"FP8 KV logits are {error:.4f} (relative) from float32's"
    cache = PagedKVCache(2, 4, 16, 2, 64, torch.float8_e4m3fn, "cpu")
    cache.kv[:, :, 1] = torch.randn(2, 2, 16, 2, 64).to(torch.float8_e4m3fn)
    cache.scales[:, :, 1] = torch.rand(2, 2, 16, 2)
    cache.copy_blocks([(1, 3)])
    assert torch.equal(cache.kv[:, :, 3].view(torch.uint8), cache.kv[:, :, 1].view(torch.uint8))
    assert torch.equal(cache.scales[:, :, 3], cache.scales[:, :, 1])


def test_fp8_kv_engine_gives_the_same_tokens_through_chunks_prefix_hits_and_preemption(llama_dir):
    """The engine on an FP8 cache: chunked prefill, prefix-cache hits, preemption and overlapped steps give the
    tokens of a plain run of the same FP8 engine (every path reads the same quantized K/V)."""
    prompts = make_prompts(320, lens=[70, 45, 90, 33, 61], seed=9)
    prompts.append(prompts[0][:48] + prompts[2][:30])  # three full blocks shared with prompts[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    roomy = LLM(str(llama_dir), kv_cache_dtype="fp8", max_model_len=256, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(batch, params, use_tqdm=False)]
    tight = LLM(str(llama_dir), kv_cache_dtype="fp8", max_model_len=256, num_kvcache_blocks=22,
                max_num_batched_tokens=32, overlap_steps=True, async_scheduling=True)
    assert tight.engine.runner.kv_cache.scales is not None
    tight.generate(batch[:1], params, use_tqdm=False)  # prompts[0]'s blocks are now cached
    got = [o.outputs[0].token_ids for o in tight.generate(batch, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert tight.engine.stats().kv.prefix_cache_hits >= 48
    assert got == expected


@pytest.mark.server
def test_the_server_takes_both_fp8_flags(tmp_path, tiny_model_path):
    """``minivllm serve --kv-cache-dtype fp8 --quantization fp8``: the start-up log says what was quantized and how
    many tokens the pool holds, /metrics names the cache dtype, and the SDK gets answers."""
    import openai

    server = start_server(tmp_path, "fp8", tiny_server_args(tiny_model_path)
                          + ["--kv-cache-dtype", "fp8", "--quantization", "fp8"])
    try:
        log = server.log_path.read_text()
        assert "float8_e4m3 K/V with a float32 scale per token and KV head" in log
        assert "quantized 8 linear layers to FP8" in log
        with server.client(timeout=30) as http:
            assert 'cache_dtype="fp8"' in http.get("/metrics").text
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=TINY_MODEL_NAME, max_tokens=6, temperature=0,
                                               messages=[{"role": "user", "content": "Hello"}],
                                               extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 6 and reply.choices[0].finish_reason == "length"
    finally:
        assert server.stop() == 0


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="quantization"):
        EngineConfig(quantization="awq")


# ------------------------------------------------------------------------------------ FP8 weights


def test_reference_fp8_linear_is_the_scaled_product():
    """The CPU path computes exactly (x rounded through FP8 per row and 128 columns) @ (W's FP8 values times
    their scales)^T, for per-channel and block scales alike, and stays within FP8's rounding of the exact
    product."""
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(7, 256, generator=gen), torch.randn(384, 256, generator=gen) / 16, torch.randn(384)
    exact = x @ w.T + bias
    values, scales = fp8.quantize_per_channel(w)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (384,)
    xq, xs = fp8.quantize_rows(x, 128)
    assert xs.shape == (7, 2)
    manual = (xq.float() * xs.repeat_interleave(128, 1)) @ (values.float() * scales[:, None]).T + bias
    torch.testing.assert_close(fp8.fp8_linear(x, values, scales, bias), manual, atol=1e-5, rtol=1e-5)
    assert 0 < relative_error(manual, exact) < 0.05
    block_values, block_scales = quantize_blocks(w, 128)
    ours = fp8.fp8_linear(x, block_values, block_scales, bias, (128, 128))
    xq, xs = fp8.quantize_rows(x, 128)
    manual = (xq.float() * xs.repeat_interleave(128, 1)) @ fp8.dequantize_weight(
        block_values, block_scales, (128, 128), torch.float32).T + bias
    torch.testing.assert_close(ours, manual, atol=1e-5, rtol=1e-5)
    assert 0 < relative_error(ours, exact) < 0.05


def test_cublas_scale_layouts_describe_the_same_weight_and_tiles_serve_large_batches_only():
    """cuBLAS takes a weight's scales per row and 128 columns ([groups, out]) or per 128 x 128 tile. Both layouts
    must give every (row, group) its scale: block scales repeated over their rows, or per-channel scales as
    tiles of ones whose rows' scales then multiply the output. The tile layout serves only products of at least
    ``BLOCK_SCALES_MIN_ROWS`` tokens (its kernels are the slower ones at decode batch sizes)."""
    gen = torch.Generator().manual_seed(5)
    tiles = torch.rand(3, 4, generator=gen) + 0.1  # a [384, 512] weight in 128 x 128 blocks
    layouts = fp8.CublasScales.of(tiles, (128, 128), 4)
    rows = torch.arange(384)
    assert layouts.groups.shape == (4, 384) and layouts.groups.is_contiguous()
    assert torch.equal(layouts.groups, tiles[rows // 128].t())
    assert torch.equal(layouts.tiles, tiles.t()) and layouts.rows is None
    assert layouts.for_rows(fp8.BLOCK_SCALES_MIN_ROWS - 1) == (layouts.groups, None)
    assert layouts.for_rows(fp8.BLOCK_SCALES_MIN_ROWS) == (layouts.tiles, None)
    channels = torch.rand(384, generator=gen)
    layouts = fp8.CublasScales.of(channels, None, 4)
    assert torch.equal(layouts.groups, channels.expand(4, 384))
    assert torch.equal(layouts.tiles, torch.ones(4, 3)) and layouts.rows is channels
    assert layouts.for_rows(16384) == (layouts.tiles, channels) and layouts.for_rows(8) == (layouts.groups, None)
    assert fp8.CublasScales.of(torch.rand(320), None, 4).tiles is None  # rows that are not whole tiles
    # Wide products move to the tiles sooner (gate|up- and q|k|v-sized weights of an 8B model).
    for rows, first in ((28672, 160), (6144, 224), (4096, fp8.BLOCK_SCALES_MIN_ROWS)):
        layouts = fp8.CublasScales.of(torch.rand(rows, generator=gen), None, 4)
        assert layouts.for_rows(first - 1)[0] is layouts.groups and layouts.for_rows(first)[0] is layouts.tiles
    layouts = fp8.CublasScales.of(torch.rand(224, 4, generator=gen), (128, 128), 4)  # 28,672 rows in blocks
    assert layouts.min_rows == 160 and layouts.for_rows(160) == (layouts.tiles, None)


@pytest.mark.parametrize("m, n, k, block, config", [
    (5, 96, 320, None, (16, 32, 2, 2)),          # K cut in two at a group, a partial last group, partial tiles
    (37, 64, 384, None, (16, 32, 3, 2)),         # three splits, token tiles past the last row
    (5, 256, 256, (128, 128), (16, 64, 1, 2)),   # block scales, no split
    (20, 256, 640, (128, 128), (32, 64, 2, 2)),  # block scales, an uneven split (3 + 2 groups)
])
def test_scaled_matmul_kernel_matches_the_reference_product(m, n, k, block, config):
    """The Triton FP8 matmul (run by Triton's interpreter here, on the GPU in tests/test_gpu.py) computes what
    the CPU path computes: the same FP8 operands and scales, split over K or not."""
    from engine.ops import fp8 as fp8_kernels

    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / 16
    values, scales = quantize_blocks(w, 128) if block else fp8.quantize_per_channel(w)
    xq, xs = fp8.quantize_rows(x, 128)
    block_m, block_n, split, stages = config
    ours = fp8_kernels.scaled_matmul(xq, xs, values, scales, block, torch.float32,
                                     fp8_kernels.MatmulConfig(block_m, block_n, split, 4, stages))
    torch.testing.assert_close(ours, fp8._reference_fp8_linear(x, values, scales, block), atol=1e-5, rtol=1e-5)


def test_matmul_configs_split_k_for_decode_batches_only():
    from engine.ops.fp8 import matmul_config

    decode = matmul_config(8, 4096, 4096, num_sms=132)  # an 8B o_proj at batch 8: 64 tiles without a split
    assert decode.block_m == 16 and decode.split > 1
    programs = -(-4096 // decode.block_n) * decode.split
    assert 1.8 * 132 <= programs and 4096 // 128 // decode.split >= 4  # two per SM, four groups per split
    assert matmul_config(8, 28672, 4096, num_sms=132).split == 1  # gate|up: 448 tiles already
    prefill = matmul_config(4096, 4096, 4096, num_sms=132)
    assert prefill.split == 1 and prefill.block_m >= 64


def test_quantization_fp8_halves_the_weights_and_keeps_the_logits(llama_dir, block_dirs):
    """``quantization="fp8"`` turns every attention and MLP projection into FP8 with a scale per output channel
    (embeddings, norms and the LM head stay float32), and the logits stay within FP8's rounding."""
    dense_dir = block_dirs[0]
    config = ModelConfig.from_pretrained(dense_dir)
    plain = load_model(config, torch.float32, "cpu")
    quantized = load_model(config, torch.float32, "cpu", quantization="fp8")
    linears = dict(fp8_weights.quantizable_linears(quantized))
    assert len(linears) == 4 * config.num_hidden_layers
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale_inv.shape == (m.weight.shape[0],)
               for m in linears.values())
    assert quantized.lm_head.weight.dtype == torch.float32
    assert quantized.model.embed_tokens.weight.dtype == torch.float32
    linear_bytes = lambda m: sum(p.numel() * p.element_size() for n, p in m.named_parameters()  # noqa: E731
                                 if "proj" in n)
    assert linear_bytes(quantized) / linear_bytes(plain) < 0.26  # float32 -> 1 byte, plus scales
    prompt = make_prompts(384, lens=[50], seed=2)[0]
    exact = hf_logits(dense_dir, prompt)
    torch.testing.assert_close(our_logits(plain, prompt), exact, atol=2e-4, rtol=2e-4)
    error = relative_error(our_logits(quantized, prompt), exact)
    assert 0 < error < 0.2, f"FP8-weight logits are {error:.4f} (relative) from float32's"


def test_fp8_block_checkpoint_loads_as_stored_and_matches_its_dequantized_weights(block_dirs):
    """An FP8 checkpoint in Hugging Face's format (``weight_scale_inv`` per 128 x 128 block) loads without being
    dequantized: q|k|v and gate|up hold the stored bytes and scales side by side; its logits are the dequantized
    checkpoint's within the activations' FP8 rounding, and greedy generation runs on it."""
    dense_dir, fp8_dir = block_dirs
    config = ModelConfig.from_pretrained(fp8_dir)
    assert config.quantization_config["weight_block_size"] == [128, 128]
    model = load_model(config, torch.float32, "cpu")
    stored = load_file(fp8_dir / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.method.block == (128, 128)
    k_rows = qkv.shard_slices["k_proj"]
    assert torch.equal(qkv.weight[k_rows].view(torch.uint8),
                       stored["model.layers.1.self_attn.k_proj.weight"].view(torch.uint8))
    assert torch.equal(qkv.weight_scale_inv[k_rows.start // 128:k_rows.stop // 128],
                       stored["model.layers.1.self_attn.k_proj.weight_scale_inv"])
    down = model.model.layers[0].mlp.down_proj
    assert torch.equal(down.weight_scale_inv, stored["model.layers.0.mlp.down_proj.weight_scale_inv"])
    # The reference: transformers on the checkpoint's weights dequantized to float32.
    dequantized = {name: tensor.float() for name, tensor in stored.items() if not name.endswith("_scale_inv")}
    for name in list(dequantized):
        if name + "_scale_inv" in stored:
            dequantized[name] = fp8.dequantize_weight(stored[name], stored[name + "_scale_inv"], (128, 128),
                                                      torch.float32)
    reference_dir = dense_dir.parent / "dequantized"
    reference_dir.mkdir(exist_ok=True)
    save_file(dequantized, reference_dir / "model.safetensors")
    (reference_dir / "config.json").write_text((dense_dir / "config.json").read_text())
    prompt = make_prompts(384, lens=[40], seed=4)[0]
    error = relative_error(our_logits(model, prompt), hf_logits(reference_dir, prompt))
    assert 0 < error < 0.2, f"FP8 checkpoint logits are {error:.4f} (relative) from its dequantized weights'"
    llm = LLM(str(fp8_dir), max_model_len=256)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_unsupported_quantization_configs_are_refused_by_name(block_dirs, tmp_path):
    dense_dir = block_dirs[0]
    for quant, match in (({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
                         ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme"),
                         ({"quant_method": "fp8", "fmt": "e5m2"}, "format"),
                         ({"quant_method": "fp8", "weight_block_size": [128, 64]}, "weight_block_size")):
        config = json.loads((dense_dir / "config.json").read_text())
        config["quantization_config"] = quant
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_pretrained(tmp_path)


def test_scale_columns_kernel_multiplies_each_column_in_float32_and_rounds_once():
    """The kernel that applies per-channel weight scales to a product's columns (run by Triton's interpreter here,
    on the GPU in tests/test_gpu.py): each column times its scale, in place, for partial tiles and row strides."""
    from engine.ops import fp8 as fp8_kernels

    gen = torch.Generator().manual_seed(7)
    base = torch.randn(37, 300, generator=gen)
    untouched = base[:, 290:].clone()
    x = base[:, :290]  # rows contiguous, a stride past the columns
    scales = torch.rand(290, generator=gen) + 0.5
    want = base[:, :290] * scales
    assert fp8_kernels.scale_columns_(x, scales) is x
    torch.testing.assert_close(x, want, atol=0, rtol=0)
    assert torch.equal(base[:, 290:], untouched)  # nothing past the columns is written
    with pytest.raises(ValueError, match="float32 scales"):
        fp8_kernels.scale_columns_(x, scales[:10])


def stand_in_for_cublas(monkeypatch) -> list[tuple[int, bool]]:
    """cuBLAS's block-scaled product stood in for by float32 arithmetic on the same operands (its layout checked),
    so that the decoder's FP8-input wiring runs on the CPU; returns the list each product appends (tokens, whether
    the channel scales were left to the caller) to."""
    from kvcache.paged_cache import fp8_to_float32

    products = []

    def cublas_stand_in(xq, x_scales, num_rows, weight, channel_scales, dtype):
        assert xq.shape[0] % 4 == 0 and x_scales.stride(0) == 1  # cuBLAS's layout
        x = fp8_to_float32(xq) * x_scales.repeat_interleave(fp8.ACTIVATION_GROUP, 1)
        out = torch.nn.functional.linear(x, fp8_to_float32(weight)).to(dtype)[:num_rows]
        # the 128 x 128 tiles' case: channel scales left over
        deferred = num_rows >= fp8.block_scales_min_rows(weight.shape[0])
        products.append((num_rows, deferred))
        return (out, channel_scales) if deferred else ((out.float() * channel_scales).to(dtype), None)

    monkeypatch.setattr(fp8, "fp8_gemm_available", lambda device: True)
    monkeypatch.setattr(fp8, "cublas_weight_scales", lambda weight, scale, block: scale)
    monkeypatch.setattr(fp8, "_cublas_product", cublas_stand_in)
    return products


def run_with_fp8_inputs(monkeypatch, model_dir, prompts, fused: bool, **options):
    """Greedy tokens and logprobs of ``prompts`` with FP8 weights, the layers taking inputs quantized by the kernels
    before them (``fused``) or quantizing them themselves."""
    from engine.models.linear import Fp8LinearMethod

    monkeypatch.setattr(Fp8LinearMethod, "takes_fp8_input", lambda self, layer: fused)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=512, quantization="fp8", num_kvcache_blocks=128,
              **options)
    set_use_triton(llm.engine.runner.model, True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.close()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


NEEDS_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU tensors need TRITON_INTERPRET=1 "
    "(conftest sets it without CUDA); on a GPU, tests/test_gpu.py covers this")


@NEEDS_INTERPRETER
@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_projections_taking_inputs_quantized_by_norms_and_swiglu_compute_the_same(arch, tmp_path, monkeypatch):
    """The decoder's wiring of FP8 inputs: norms and SwiGLU writing ``Fp8Activation``s (padded rows, residual sums,
    the first layer without one), and in a prefill past ``BLOCK_SCALES_MIN_ROWS`` tokens the deferred channel scales
    (gate|up's applied by SwiGLU, q|k|v's by the rope kernel and the KV write, o's and down's by the next add-norm; a
    mixture-of-experts layer's norm too), give bit for bit the tokens and logprobs of quantizing before each product.
    cuBLAS's block-scaled product is stood in for by float32 arithmetic on the same operands, the norm, SwiGLU and
    quantization kernels run in Triton's interpreter."""
    products = stand_in_for_cublas(monkeypatch)
    # The tiles from 32 tokens on rather than 256, so that a 35-token prefill crosses over (the interpreter runs
    # the norm, rope and quantization kernels a program per token).
    monkeypatch.setattr(fp8, "BLOCK_SCALES_MIN_ROWS", 32)
    assert fp8.block_scales_min_rows(512) == 32
    if arch == "llama":
        config = transformers.LlamaConfig(**{**BLOCK_CONFIG, "intermediate_size": 384})
    else:  # layer 0 routes to experts (which stay unquantized), layer 1 is dense
        config = transformers.Qwen3MoeConfig(**{**BLOCK_CONFIG, "intermediate_size": 384}, moe_intermediate_size=128,
                                             num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                                             mlp_only_layers=[1])
    from engine.models.linear import LinearOutput
    from engine.models.norm import RMSNorm

    norms_given_scales = []  # per norm call in the fused run: whether it applied a product's column scales
    norm_forward = RMSNorm.forward

    def spy(self, x, residual=None, fp8_out=False):
        norms_given_scales.append(isinstance(x, LinearOutput) and x.column_scales is not None)
        return norm_forward(self, x, residual, fp8_out)

    monkeypatch.setattr(RMSNorm, "forward", spy)
    model_dir = save_checkpoint(config, tmp_path)
    prompts = make_prompts(config.vocab_size, lens=[24, 6, 5])
    got = run_with_fp8_inputs(monkeypatch, model_dir, prompts, fused=True)
    fused_products = list(products)
    # In the 35-token prefill: o's scales to both layers' post-attention norms, down's (layer 1) to the final norm.
    assert sum(norms_given_scales) == (4 if arch == "llama" else 3)
    products.clear()
    want = run_with_fp8_inputs(monkeypatch, model_dir, prompts, fused=False)
    assert fused_products == products and (35, True) in products and (3, False) in products
    assert got == want


@NEEDS_INTERPRETER
def test_o_proj_takes_its_input_quantized_by_the_decode_kernels(tmp_path, monkeypatch):
    """With heads 128 wide, decode steps hand o_proj the attention output already quantized by the Triton decode
    kernels (one scale per token and head); prefill steps quantize it in o_proj. Tokens and logprobs are bit for bit
    those of quantizing every input in its layer (cuBLAS stood in for as above, kernels in the interpreter)."""
    import engine.attention.triton_backend as triton_backend

    stand_in_for_cublas(monkeypatch)
    quantized_outputs = []  # per layer and step: whether attention returned its output quantized
    forward = triton_backend.TritonAttentionBackend.forward

    def spy(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        quantized_outputs.append(isinstance(out, tuple))
        return out

    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "forward", spy)
    config = transformers.LlamaConfig(**{**BLOCK_CONFIG, "hidden_size": 256, "num_attention_heads": 2,
                                         "num_key_value_heads": 1, "head_dim": 128, "intermediate_size": 256})
    model_dir = save_checkpoint(config, tmp_path)
    # Contexts split by the capacity of their block tables: with 64-token blocks a 67-token context has two blocks,
    # 128 keys, and splits in two, both pieces holding keys.
    prompts = make_prompts(config.vocab_size, lens=[66, 12])
    options = dict(attention_backend="triton", kvcache_block_size=64)
    got = run_with_fp8_inputs(monkeypatch, model_dir, prompts, fused=True, **options)
    assert any(quantized_outputs) and not all(quantized_outputs)  # decode-only steps, not the prefill
    quantized_outputs.clear()
    want = run_with_fp8_inputs(monkeypatch, model_dir, prompts, fused=False, **options)
    assert quantized_outputs and not any(quantized_outputs)
    assert got == want
