"""End to end on a CUDA GPU: Triton attention + CUDA graphs against the torch reference and transformers.

These need a GPU, so they are deselected by default; run them with ``pytest -m gpu`` on a GPU host.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from tests.helpers import TINY_CONFIGS, VOCAB, PagedRunner, random_image, save_checkpoint, save_tiny_model
from tests.test_gguf_models import default_tokenizer, vocabulary  # noqa: F401  (fixtures of the GGUF kernel test)

pytestmark = pytest.mark.gpu

PROMPT_LENS = [3, 17, 31, 40, 9, 64, 23, 50, 120, 77]


def _prompts(vocab: int, lens=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def _greedy(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("rows", [1, 151, 256])
@pytest.mark.parametrize("vocab", [151936, 128256, 1000])
def test_greedy_kernels_give_torch_argmax_tokens_on_bfloat16_logits(rows, vocab):
    """The sampler's two-pass argmax (``engine.ops.greedy``) on the GPU: ties planted across chunks go to the first."""
    from engine.ops.greedy import greedy_tokens

    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, vocab, device="cuda", generator=gen).bfloat16()
    logits[:, -1] = logits.max(dim=-1).values
    logits[0, :] = 1.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))


def test_greedy_tokens_taken_inside_decode_graphs_match_torch_argmax_after_them(tmp_path, monkeypatch):
    """Decode graphs that take their rows' argmax themselves (``MINIVLLM_GREEDY_ARGMAX=graph``) give
    the tokens of torch.argmax after the replay (``torch``), in bf16, for greedy rows, seeded sampled rows beside
    them, and rows whose logits a bias or a penalty changes before the argmax."""
    config = TINY_CONFIGS["qwen3"]()
    model_dir = save_checkpoint(config, tmp_path)
    prompts = _prompts(VOCAB, [5, 150, 40, 90, 12, 200, 31, 1])
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={3: 2.0}),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3)]

    def run(setting: str) -> list[list[int]]:
        monkeypatch.setenv("MINIVLLM_GREEDY_ARGMAX", setting)
        llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256, num_kvcache_blocks=256,
                  max_num_batched_tokens=256)
        try:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.greedy == (setting != "torch")
            greedy = _greedy(llm, prompts, 24)
            mixed = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 [params[i % len(params)] for i in range(len(prompts))], use_tqdm=False)
            return greedy + [o.outputs[0].token_ids for o in mixed]
        finally:
            llm.engine.close()

    assert run("graph") == run("torch")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_triton_with_cuda_graphs_matches_torch_eager_float32(tmp_path, async_scheduling):
    model_dir = save_tiny_model("qwen3", tmp_path)
    prompts = _prompts(VOCAB)
    common = dict(device="cuda", dtype="float32", max_model_len=256, num_kvcache_blocks=256)
    fast = LLM(str(model_dir), attention_backend="triton", async_scheduling=async_scheduling, **common)
    assert fast.engine.runner.graphs is not None, "CUDA graphs should be captured"
    reference = LLM(str(model_dir), attention_backend="torch", enforce_eager=True, **common)
    fast.engine.measure_steps(True)
    got = _greedy(fast, prompts, 40)
    assert any(t.graph for t in fast.engine.step_timings), "decode steps should replay graphs"
    assert (fast.engine.num_steps_planned_ahead > 0) == async_scheduling
    assert got == _greedy(reference, prompts, 40)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_steps_replay_graphs_with_the_tokens_of_eager_steps(tmp_path, async_scheduling):
    """With a 64-token step budget prompts are cut into chunks that share steps with decodes: every such step
    replays a mixed-step graph, every decode-only step a decode graph, and the tokens are torch eager's (float32),
    greedy and seeded; no block is left held."""
    model_dir = save_tiny_model("qwen3", tmp_path)
    prompts = _prompts(VOCAB)
    common = dict(device="cuda", dtype="float32", max_model_len=256, num_kvcache_blocks=256,
                  max_num_batched_tokens=64)
    fast = LLM(str(model_dir), attention_backend="triton", async_scheduling=async_scheduling, **common)
    mixed = fast.engine.runner.mixed_graphs
    assert mixed is not None and mixed.sizes == [16, 32, 48, 64]
    reference = LLM(str(model_dir), attention_backend="torch", enforce_eager=True, **common)
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    fast.engine.measure_steps(True)
    got = _greedy(fast, prompts, 40)
    got_seeded = [o.outputs[0].token_ids for o in fast.generate([{"prompt_token_ids": p} for p in prompts], seeded,
                                                                  use_tqdm=False)]
    assert mixed.replays >= 7 and fast.engine.runner.graphs.replays > 10  # 434 prompt tokens, 64 a step
    assert all(t.graph for t in fast.engine.step_timings), "every step fits a graph"
    assert got == _greedy(reference, prompts, 40)
    assert got_seeded == [o.outputs[0].token_ids for o in reference.generate(
        [{"prompt_token_ids": p} for p in prompts], seeded, use_tqdm=False)]
    assert fast.engine.kv_manager.get_stats().num_used_blocks == 0


def test_fp8_kv_cache_and_weights_on_cuda_match_the_torch_reference(tmp_path):
    """Triton attention on an FP8 cache with CUDA graphs, and FP8 linears through the Triton scaled matmul (per
    channel and block scales, K split or not), give the CPU reference's arithmetic: the same quantized values,
    float32 accumulation; greedy tokens equal torch eager on the same FP8 cache."""
    from engine.attention.torch_backend import write_kv
    from engine.models import fp8
    from engine.ops import fp8 as fp8_kernels
    from engine.ops.attention import write_paged_kv

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(50, 2, 64, generator=gen).cuda() * 3, torch.randn(50, 2, 64, generator=gen).cuda() / 40
    slots = torch.randperm(64, generator=gen)[:50].cuda()
    caches = [[torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2)] for _ in range(2)]
    scales = [tuple(torch.ones(4, 16, 2, device="cuda") for _ in range(2)) for _ in range(2)]
    write_paged_kv(k, v, *caches[0], slots, scales[0])
    write_kv(*caches[1], k, v, slots, scales[1])
    assert torch.equal(caches[0][1].view(torch.uint8), caches[1][1].view(torch.uint8)), "V rounds as in torch"
    # K is rotated first: sums in another order may move a value on a rounding boundary by one float8 step.
    ours, theirs = caches[0][0].float(), caches[1][0].float()
    step = torch.exp2(torch.floor(torch.log2(theirs.abs().clamp_min(2**-6))) - 3)
    assert ((ours - theirs).abs() <= step).all() and (ours != theirs).float().mean() < 0.01
    x = torch.randn(37, 512, generator=gen).cuda().bfloat16()
    w = (torch.randn(384, 512, generator=gen) / 20).cuda()
    xq, xs = fp8_kernels.quantize_rows(x)
    ref_q, ref_s = fp8.quantize_rows(x)
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.allclose(xs, ref_s, rtol=1e-6)
    gq, gs = fp8_kernels.quantize_rows(x, 128)
    ref_gq, ref_gs = fp8.quantize_rows(x, 128)
    assert torch.equal(gq.view(torch.uint8), ref_gq.view(torch.uint8)) and torch.allclose(gs, ref_gs, rtol=1e-6)
    values, channel_scales = fp8.quantize_per_channel(w)
    for m in (1, 5, 37):
        ours = fp8.fp8_linear(x[:m], values, channel_scales, None)
        ref = fp8._reference_fp8_linear(x[:m].float(), values, channel_scales, None)
        assert _rel_err(ours.float(), ref) < 1e-2
        for config in ((16, 64, 2, 4, 3), (16, 32, 4, 4, 4), (64, 128, 1, 8, 4)):
            ours = fp8_kernels.scaled_matmul(*fp8_kernels.quantize_rows(x[:m], 128), values, channel_scales, None,
                                             torch.float32, fp8_kernels.MatmulConfig(*config))
            # Hopper's FP8 tensor cores keep fewer accumulator bits within one 128-column group (the kernel
            # adds each group's product into float32), hence more than float32's rounding.
            assert _rel_err(ours, ref) < 1e-3, config
    # cuBLAS's block-scaled product (Hopper with torch >= 2.9) with the same scales, rows padded to a multiple of 4.
    cublas = fp8.cublas_weight_scales(values, channel_scales, None)
    assert cublas is not None, "this torch or GPU has no block-scaled _scaled_mm"
    for m in (1, 5, 65, 300, fp8.BLOCK_SCALES_MIN_ROWS + 5):  # the last as tiles of ones, rows' scales after
        xm = torch.randn(m, 512, generator=gen).cuda().bfloat16()
        ours = fp8.fp8_linear(xm, values, channel_scales, None, cublas_scales=cublas)
        assert ours.shape == (m, 384)
        assert _rel_err(ours.float(), fp8._reference_fp8_linear(xm.float(), values, channel_scales, None)) < 1e-2
    block_scales = (w.view(3, 128, 4, 128).abs().amax(dim=(1, 3)) / 448).contiguous()
    block_values = (w.view(3, 128, 4, 128) / block_scales[:, None, :, None]).to(torch.float8_e4m3fn).view(384, 512)
    for m in (1, 7, 37):
        ours = fp8.fp8_linear(x[:m], block_values, block_scales, None, (128, 128))
        ref = fp8._reference_fp8_linear(x[:m].float(), block_values, block_scales, (128, 128))
        assert _rel_err(ours.float(), ref) < 1e-2
    cublas = fp8.cublas_weight_scales(block_values, block_scales, (128, 128))
    for m in (200, fp8.BLOCK_SCALES_MIN_ROWS + 3):  # the tiles' scales repeated per row, then as 128 x 128 tiles
        xm = torch.randn(m, 512, generator=gen).cuda().bfloat16()
        ours = fp8.fp8_linear(xm, block_values, block_scales, None, (128, 128), cublas_scales=cublas)
        ref = fp8._reference_fp8_linear(xm.float(), block_values, block_scales, (128, 128))
        assert ours.shape == (m, 384) and _rel_err(ours.float(), ref) < 1e-2

    model_dir = save_tiny_model("qwen3", tmp_path)
    prompts = _prompts(VOCAB)
    common = dict(device="cuda", dtype="float32", max_model_len=256, num_kvcache_blocks=256, kv_cache_dtype="fp8")
    fast = LLM(str(model_dir), attention_backend="triton", **common)
    assert fast.engine.runner.graphs is not None and fast.engine.runner.kv_cache.scales is not None
    reference = LLM(str(model_dir), attention_backend="torch", enforce_eager=True, **common)
    assert _greedy(fast, prompts, 40) == _greedy(reference, prompts, 40)
    quantized = LLM(str(model_dir), device="cuda", max_model_len=256, quantization="fp8", kv_cache_dtype="fp8")
    assert quantized.engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert all(len(t) == 40 for t in _greedy(quantized, prompts, 40))


@pytest.mark.parametrize("num_tokens", [151, 300])  # 1 x 128 weight scales; 128 x 128 tiles, channel scales after
def test_fp8_inputs_quantized_by_norms_and_swiglu_agree_with_separate_kernels(num_tokens, monkeypatch):
    """With FP8 weights the norms and SwiGLU write the next projection's input already quantized, and SwiGLU
    applies gate|up's channel scales from 256 tokens on: one norm and MLP (bf16, compiled kernels, cuBLAS) give
    what separate kernels give. The compiled norms may sum a row's squares in another order, which moves an FP8
    rounding now and then, so the outputs agree to FP8's noise, not bit for bit; tests/test_fp8.py checks the
    decoder's wiring bit for bit on the CPU. (Whole tiny models are no check here: with FP8 a change of 1e-6 in
    one norm's scales already changes greedy tokens of a random 2-layer model.)"""
    from types import SimpleNamespace

    from engine.loading import fp8_weights
    from engine.models import fp8
    from engine.models.llama import LlamaMLP
    from engine.models.norm import RMSNorm

    torch.manual_seed(0)
    with torch.device("cuda"):
        mlp = LlamaMLP(SimpleNamespace(hidden_size=512, intermediate_size=1024)).to(torch.bfloat16)
        norm = RMSNorm(512, 1e-5).to(torch.bfloat16)
        for p in (*mlp.parameters(), norm.weight):
            p.data.normal_(0.0, 0.05 if p.dim() > 1 else 1.0)
        assert fp8_weights.quantize_model_weights(mlp) == 2
        x, residual = torch.randn(2, num_tokens, 512, dtype=torch.bfloat16).unbind(0)

    def run():
        h, new_residual = norm(x, residual, fp8_out=mlp.takes_fp8_input)
        return mlp(h).finished(), new_residual, isinstance(h, fp8.Fp8Activation)

    got, got_residual, fused = run()
    # From 256 tokens down's channel scales are left to the next add-norm, which gives what applying them gives.
    h, new_residual = norm(x, residual, fp8_out=True)
    act = mlp.act_fn(mlp.gate_up_proj.forward_deferred(h), fp8_out=True)
    out = mlp.down_proj.forward_deferred(act)
    assert (out.column_scales is not None) == (num_tokens >= fp8.block_scales_min_rows(512))
    for fp8_out in (False, True):
        deferred = norm(out, new_residual, fp8_out=fp8_out)
        applied = norm(mlp.down_proj(act), new_residual, fp8_out=fp8_out)
        assert torch.equal(deferred[1], applied[1])
        if fp8_out:
            assert torch.equal(deferred[0].values.view(torch.uint8), applied[0].values.view(torch.uint8))
            assert torch.equal(deferred[0].scales, applied[0].scales)
        else:
            assert torch.equal(deferred[0], applied[0])
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        monkeypatch.setattr(layer, "takes_fp8_input", False)
    want, want_residual, unfused = run()
    assert fused and not unfused
    assert torch.equal(got_residual, want_residual)
    assert got.shape == want.shape == (num_tokens, 512)
    assert _rel_err(got.float(), want.float()) < 1e-2


@pytest.mark.parametrize("num_tokens", [151, 2048])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["bf16_cache", "fp8_cache"])
def test_rope_fused_into_the_kv_write_matches_rope_then_write(fp8_cache, qk_norm, num_tokens):
    """Compiled, on Llama-3.1-8B's heads in bf16: the KV-cache write given the rope q and k still need (Qwen3's
    norms, the FP8 product's column scales first) against the rope kernel, the column-scale pass and the plain
    write. As the engine calls it, bit for bit. The FP8 write kernel roping q and K itself (``fuse_rope``): V and
    its scales bit for bit, K's rotation summed as two dots may put a rare value one float8 step away and the
    rotated queries one bf16 rounding away."""
    from engine.models.norm import RMSNorm
    from engine.models.rotary import get_rope
    from engine.ops import fused as fused_ops
    from engine.ops.attention import write_paged_kv
    from engine.ops.attention.kv_write import _launch_write
    from engine.ops.fp8 import scale_columns_

    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(num_tokens + 5, width, device="cuda", generator=gen).bfloat16() * 3  # 5 padding rows
    positions = torch.randint(0, 8192, (num_tokens + 5,), device="cuda", generator=gen)
    column_scales = torch.rand(width, device="cuda", generator=gen) + 0.5
    with torch.device("cuda"):
        rope = get_rope(head_dim, 8192, 5e5)
        norms = [RMSNorm(head_dim, 1e-6).bfloat16() for _ in range(2)] if qk_norm else []
    for norm in norms:
        norm.weight.data.uniform_(0.5, 1.5, generator=gen)
    pending = rope.pending(*norms).at(positions, column_scales)
    slots = torch.randperm(4 * num_tokens, device="cuda", generator=gen)[:num_tokens] + block
    slots[::17] = -1
    num_blocks = 5 * num_tokens // block + 2
    shape = (num_blocks, block, kv_heads, head_dim)
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def split(t):
        q, k, v = t.split(sizes, dim=-1)
        return q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)

    results = []
    for variant in ("reference", "engine", "fused") if fp8_cache else ("reference", "engine"):
        if fp8_cache:
            caches = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2)]
            scales = tuple(torch.ones(shape[:3], device="cuda") for _ in range(2))
        else:
            caches, scales = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)], None
        if variant != "reference":
            q, k, v = split(qkv)
            q_out = _launch_write(k, v, *caches, slots, scales, q=q, rope=pending,
                                  fuse_rope=True if variant == "fused" else None)
        else:
            q, k, v = split(scale_columns_(qkv.clone(), column_scales))
            if qk_norm:
                q, k = fused_ops.qk_norm_rotary(positions, q, k, norms[0].weight, norms[1].weight, 1e-6,
                                                rope.cos_sin_cache)
            else:
                q, k = fused_ops.rotary(positions, q, k, rope.cos_sin_cache)
            q_out = write_paged_kv(k, v, *caches, slots, scales, q=q)
        results.append((q_out, caches, scales))
    (q_ref, caches_ref, scales_ref), (q_engine, caches_engine, scales_engine) = results[:2]
    assert torch.equal(q_engine, q_ref)
    for ours, theirs in zip(caches_engine, caches_ref):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    if not fp8_cache:
        return
    assert torch.equal(scales_engine[0], scales_ref[0]) and torch.equal(scales_engine[1], scales_ref[1])
    q_fused, caches_fused, scales_fused = results[2]
    assert torch.equal(caches_fused[1].view(torch.uint8), caches_ref[1].view(torch.uint8))
    assert torch.equal(scales_fused[1], scales_ref[1])
    # Qwen3's norm sums a row's squares over other tiles than the rope kernel: a normed value may round one bf16
    # step the other way now and then, which moves its row's scale by far less than a step of its own.
    torch.testing.assert_close(scales_fused[0], scales_ref[0], atol=0, rtol=1e-2 if qk_norm else 1e-6)
    ours, theirs = caches_fused[0].float(), caches_ref[0].float()
    step = torch.exp2(torch.floor(torch.log2(theirs.abs().clamp_min(2**-6))) - 3)
    assert ((ours - theirs).abs() <= step).all() and (ours != theirs).float().mean() < 0.01
    a, b = q_fused.float(), q_ref.float()
    assert ((a - b).abs() <= b.abs() * 2**-7 + 1e-6).all() and (a != b).float().mean() < 0.01


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _compiled_variants(kernel) -> set[str]:
    """The specialization keys a Triton kernel has compiled (shown in full when a test fails)."""
    caches = getattr(kernel, "device_caches", None)  # triton >= 3.0
    if caches is not None:
        return {str(key) for entry in caches.values() for key in entry[0]}
    return {str(key) for c in kernel.cache.values() for key in c}


def test_prompt_logprobs_and_beam_search_on_cuda_match_transformers(tmp_path):
    """Scoring and beam search on the CUDA path (Triton attention, CUDA graphs, steps planned ahead), in
    float32, against transformers on the same GPU."""
    model_dir = save_tiny_model("qwen3", tmp_path)
    prompts = _prompts(VOCAB, lens=[30, 45, 21])
    llm = LLM(str(model_dir), device="cuda", dtype="float32", max_model_len=256, num_kvcache_blocks=128,
              max_num_batched_tokens=32)
    assert llm.engine.runner.graphs is not None and llm.engine.async_scheduling
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    scored = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2),
                          use_tqdm=False)
    for prompt, out in zip(prompts, scored):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt]).cuda()).logits[0].float(), dim=-1).cpu()
        got = [e.logprob for e in out.prompt_logprobs[1:]]
        expected = [ref[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        assert got == pytest.approx(expected, abs=1e-3)
    beams = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(n=3, use_beam_search=True, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, beams):
        ids = torch.tensor([prompt]).cuda()
        seqs = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3,
                           num_return_sequences=3, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
        assert [c.token_ids for c in out.outputs] == [s[len(prompt):].tolist() for s in seqs]


def test_sliding_window_gemma_and_experts_on_cuda_match_transformers(tmp_path):
    """Mistral's sliding window, Gemma 2's soft-capping and query scale, Gemma 3's local RoPE base and q/k norms
    through the Triton kernels, and Qwen3-MoE's fused Triton experts, all under CUDA graphs, in float32 against
    transformers on the same GPU; start-up compiled every MoE kernel variant the steps pick."""
    from engine.ops import moe as moe_kernels

    small = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    configs = {
        "mistral": transformers.MistralConfig(**small, sliding_window=24),
        "gemma2": transformers.Gemma2Config(**small, head_dim=32, sliding_window=24, query_pre_attn_scalar=48,
                                            attn_logit_softcapping=8.0, final_logit_softcapping=5.0),
        "gemma3": transformers.Gemma3TextConfig(
            **small, head_dim=32, sliding_window=20, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
        "qwen3-moe": transformers.Qwen3MoeConfig(**{**small, "intermediate_size": 256}, moe_intermediate_size=64,
                                                 head_dim=32, num_experts=4, num_experts_per_tok=2),
    }
    prompts = _prompts(VOCAB, lens=[60, 17, 100, 33])
    for name, config in configs.items():
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(config).eval()
        path = tmp_path / name
        hf.save_pretrained(path)
        hf = hf.cuda()
        llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=512, num_kvcache_blocks=128)
        assert llm.engine.runner.graphs is not None, name
        compiled = _compiled_variants(moe_kernels._grouped_gemm_kernel)
        got = _greedy(llm, prompts, 20)
        assert _compiled_variants(moe_kernels._grouped_gemm_kernel) == compiled, "an MoE kernel compiled mid-run"
        for prompt, tokens in zip(prompts, got):
            ids = torch.tensor([prompt]).cuda()
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                                   min_new_tokens=20, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert tokens == expected, name
        llm.engine.close()


def _engine_kernels() -> dict:
    """Every Triton kernel of the engine's modules, by name."""
    import sys

    from triton.runtime.jit import JITFunction

    from engine.ops import attention, fp8, fused, moe  # noqa: F401  (imported so that they are listed)

    return {f"{name}.{attr}": obj for name, module in list(sys.modules.items()) if name.startswith("engine.")
            for attr, obj in vars(module).items() if isinstance(obj, JITFunction)}


@pytest.mark.parametrize("fp8", [False, True])
def test_no_kernel_compiles_after_start_up(tmp_path, fp8):
    """Start-up compiles every variant of every Triton kernel a step can pick: a mixed workload of decode
    batches and prompt chunks of many sizes (1, multiples of 16 and others, across the FP8 layers' switches at
    256 and 1,024 tokens) compiles nothing new. With FP8 weights and KV cache on a shape whose products take
    FP8 inputs (cuBLAS's block scaling) and defer their column scales."""
    from engine.models import fp8 as fp8_module
    from engine.ops.fused import activation

    # cuBLAS's block scaling takes inner sizes of 4 x 128 columns and more.
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model_dir = save_checkpoint(config, tmp_path / "llama")
    options = dict(quantization="fp8", kv_cache_dtype="fp8") if fp8 else {}
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_model_len=2048, num_kvcache_blocks=1024,
              max_num_batched_tokens=2048, **options)
    if fp8:
        assert llm.engine.runner.model.model.layers[0].mlp.gate_up_proj.takes_fp8_input
    assert activation._SWIGLU_ROWS_FROM < 2048 and fp8_module.BLOCK_SCALES_MIN_ROWS < 1000
    kernels = _engine_kernels()
    assert {"fused.rope._rope_kernel", "fused.activation._silu_and_mul_kernel", "fused.norm._rms_norm_kernel"} <= {
        name.removeprefix("engine.ops.") for name in kernels}
    before = {name: _compiled_variants(k) for name, k in kernels.items()}
    # Alone and chunked at 2,048 next to decodes: 1,0xx-token steps (not multiples of 16), 300-900, under 256.
    for lens, max_tokens in (([1037], 3), ([700, 333], 5), ([1500, 1200, 900, 17, 1, 64], 30),
                             ([3, 180, 17, 150, 1, 64, 129, 8, 200, 33, 90, 5], 40)):
        params = [SamplingParams(temperature=0.0, max_tokens=max_tokens - i, ignore_eos=True)
                  for i in range(len(lens))]
        llm.generate([{"prompt_token_ids": p} for p in _prompts(VOCAB, lens)], params, use_tqdm=False)
    after = {name: _compiled_variants(k) for name, k in kernels.items()}
    assert {name: after[name] - before[name] for name in kernels if after[name] != before[name]} == {}
    llm.engine.close()


def test_steps_never_synchronize_the_stream(tmp_path):
    """The only wait per step is on the step's own event: no op in scheduling, input building,
    feeding tokens of a step in flight, sampling, logprobs or graph replay synchronizes the CUDA
    stream (torch raises on one in sync debug mode)."""
    model_dir = save_tiny_model("qwen3", tmp_path)
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_model_len=256, num_kvcache_blocks=512,
              max_num_batched_tokens=128)
    assert llm.engine.async_scheduling, "async scheduling is the CUDA default"
    prompts = _prompts(VOCAB, [5, 150, 40, 90, 12, 200])
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, top_k=20, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=30, ignore_eos=True, logprobs=3)] * 2
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [len(o.outputs[0].token_ids) for o in outs] == [30] * 6
    assert all(len(o.outputs[0].logprobs) == 30 for o in outs[2::3])
    assert llm.engine.num_steps_planned_ahead > 0


def test_decode_products_split_along_k_under_cuda_graphs_give_the_same_tokens(tmp_path, monkeypatch):
    """``MINIVLLM_DECODE_KSPLIT=2`` (q|k|v, o, gate|up and down of decode-sized steps as partial products of K's
    slices, added by the KV-cache write, add-norm and SwiGLU kernels that read them) and the default ``auto`` (o and
    down only here, whose K is at least their width) in CUDA-graph replays give the greedy tokens of whole products
    (float32)."""
    from engine.models.linear import unquantized
    from tests.helpers import SMALL_CONFIG

    config = transformers.Qwen3Config(**{**SMALL_CONFIG, "hidden_size": 128, "intermediate_size": 256}, head_dim=32,
                                      tie_word_embeddings=False)  # every K a multiple of 2 x 64
    model_dir = save_checkpoint(config, tmp_path)
    prompts = _prompts(VOCAB)
    made = {}
    real_k_slice_products = unquantized.k_slice_products
    monkeypatch.setattr(unquantized, "k_slice_products", lambda x, weight, slices: made[setting].add(
        (tuple(weight.shape), slices)) or real_k_slice_products(x, weight, slices))
    tokens = {}
    for setting in ("0", "2", "auto"):
        monkeypatch.setenv("MINIVLLM_DECODE_KSPLIT", setting)
        made[setting] = set()
        llm = LLM(str(model_dir), device="cuda", dtype="float32", max_model_len=256, num_kvcache_blocks=256)
        try:
            assert llm.engine.runner.graphs is not None
            llm.engine.measure_steps(True)
            tokens[setting] = _greedy(llm, prompts, 40)
            assert any(t.graph for t in llm.engine.step_timings)
        finally:
            llm.engine.close()
    # Weights [out, in]: q|k|v (256, 128), o (128, 128), gate|up (512, 128), down (128, 256).
    assert made["2"] == {((256, 128), 2), ((128, 128), 2), ((512, 128), 2), ((128, 256), 2)}, "every product cut"
    assert made["auto"] == {((128, 128), 2), ((128, 256), 4)}, "o into 2 (K of 128), down into 4"
    assert not made["0"]
    assert tokens["2"] == tokens["0"] and tokens["auto"] == tokens["0"]


@pytest.mark.parametrize("ksplit", ["0", "2"])
def test_bf16_logits_on_a_real_shaped_model_stay_within_tolerance(tmp_path, monkeypatch, ksplit):
    """Qwen3-0.6B shape, random weights: our bf16 Triton path against transformers in float32; also with decode-sized
    steps' products split along K (``MINIVLLM_DECODE_KSPLIT``), the 24-token step here."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from workloads import MODEL_SHAPES

    (tmp_path / "config.json").write_text(json.dumps(MODEL_SHAPES["qwen3-0.6b"]))
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).cuda().eval()
    monkeypatch.setenv("MINIVLLM_DECODE_KSPLIT", ksplit)
    ours = load_model(ModelConfig.from_pretrained(tmp_path), torch.bfloat16, torch.device("cuda"), "dummy")
    ours.load_weights((name, t.detach()) for name, t in hf.state_dict().items())
    from engine.attention.triton_backend import TritonAttentionBackend

    runner = PagedRunner(ours, num_blocks=256, block_size=16, max_blocks_per_req=64)
    for layer in ours.attention_layers():
        layer.set_backend(TritonAttentionBackend())
    prompts = _prompts(hf_config.vocab_size, lens=[200, 333, 64])
    # One prefill step of three prompts, then a chunk with a cached prefix, then decodes.
    logits = runner.step([(i, p[:-8]) for i, p in enumerate(prompts)])
    logits_tail = runner.step([(i, p[-8:]) for i, p in enumerate(prompts)])
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p], device="cuda")).logits[0].float()
            mine = torch.cat([logits[i], logits_tail[i]])
            err = _rel_err(mine, ref)
            assert err < 2e-2, f"prompt {i}: relative error {err:.2e}"
            assert (mine.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


# ------------------------------------------------------------------ the server on CUDA


def test_server_on_cuda_with_steps_planned_ahead(tmp_path, tokenizer_dir):
    """A real server on the GPU (bf16, Triton, CUDA graphs, overlapped steps and async scheduling, the
    CUDA defaults) answers the ``openai`` SDK with the offline engine's greedy text, streamed or not,
    and many cancelled streams leave no KV block in use."""
    import asyncio

    import httpx
    import openai

    from tests.server_helpers import build_tiny_model, start_server, wait_until_idle

    model_dir = build_tiny_model(tmp_path / "tiny", tokenizer_dir, head_dim=64)
    args = ["--model", str(model_dir), "--served-model-name", "tiny", "--max-model-len", "512",
            "--num-kvcache-blocks", "1024"]
    server = start_server(tmp_path, "cuda-server", args)
    try:
        log = server.log_path.read_text()
        assert "overlap_steps=True, async_scheduling=True" in log and "on cuda" in log, log[-3000:]
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "1, 2, 3,"]
        params = dict(temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
        # One request at a time on both paths: the same batches, so the same bf16 rounding.
        served = [client.completions.create(model="tiny", prompt=p, **params).choices[0].text for p in prompts]
        streamed = ["".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=p, stream=True, **params) if c.choices) for p in prompts]
        assert streamed == served
        llm = LLM(str(model_dir), device="cuda", max_model_len=512, num_kvcache_blocks=256)
        offline = [o.outputs[0].text for o in (
            llm.generate([p], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
            for p in prompts)]
        assert served == offline
        del llm
        # Structured output on the GPU path (masks applied by xgrammar's CUDA kernel, sampling deferred
        # behind steps planned ahead): every reply parses and validates.
        import json

        import jsonschema

        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
        fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}
        for seed in range(6):
            reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                                   response_format=fmt, seed=seed, temperature=1.0, max_tokens=100)
            jsonschema.validate(json.loads(reply.choices[0].message.content), schema)

        async def cancel_streams(num: int) -> None:
            body = {"model": "tiny", "prompt": "stream", "max_tokens": 400, "ignore_eos": True, "stream": True}
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                async def one(i):
                    async with http.stream("POST", "/v1/completions", json={**body, "prompt": f"s {i}"}) as r:
                        assert r.status_code == 200
                        seen = 0
                        async for line in r.aiter_lines():
                            seen += line.startswith("data: ")
                            if seen == 5:
                                return
                await asyncio.gather(*(one(i) for i in range(num)))

        asyncio.run(cancel_streams(64))
        idle = wait_until_idle(server.url, timeout_s=30)
        assert idle["minivllm:kv_cache_blocks_used"] == 0 and idle["minivllm:num_requests_running"] == 0
    finally:
        assert server.stop() == 0


# ------------------------------------------------------------------ the fused MoE kernels


@pytest.mark.parametrize("num_tokens", [1, 37, 512])
def test_fused_moe_matches_the_torch_reference_in_bf16(num_tokens):
    """Qwen3-30B-A3B's expert shapes (128 experts, top-8, hidden 2048, intermediate 768), random weights: the
    Triton fused MoE in bf16 stays as close to the float32 reference as the bf16 torch reference does, runs
    with no host sync, and replays from a CUDA graph with new routing exactly as it runs eagerly."""
    import copy

    from engine.models.moe import FusedExperts
    from engine.ops.moe import fused_moe

    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    gen = torch.Generator().manual_seed(0)
    experts32 = FusedExperts(num_experts, hidden, inter)
    with torch.no_grad():
        experts32.w13.copy_(torch.randn(experts32.w13.shape, generator=gen) / hidden**0.5)
        experts32.w2.copy_(torch.randn(experts32.w2.shape, generator=gen) / inter**0.5)
    experts = copy.deepcopy(experts32).cuda().bfloat16()
    experts32 = experts32.cuda()

    def routing(seed):  # as Qwen3-MoE routes: softmax, top-k, renormalised, weights in the hidden dtype
        logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)).cuda()
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        return ids, (weights / weights.sum(dim=-1, keepdim=True)).bfloat16()

    x = torch.randn(num_tokens, hidden, generator=gen).cuda().bfloat16()
    top_ids, top_weights = routing(1)
    with torch.no_grad():
        exact = experts32.reference_forward(x.float(), top_ids, top_weights.float())
        reference = experts.reference_forward(x, top_ids, top_weights)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = fused_moe(x, experts.w13, experts.w2, top_ids, top_weights)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        err, ref_err = _rel_err(got.float(), exact), _rel_err(reference.float(), exact)
        assert err < 1e-2 and err < 1.5 * ref_err + 1e-3, f"fused {err:.2e}, torch reference {ref_err:.2e}"
        assert _rel_err(got.float(), reference.float()) < 1e-2
        assert torch.equal(got, experts(x, top_ids, top_weights)), "FusedExperts on CUDA takes the Triton path"

        graph = torch.cuda.CUDAGraph()
        fused_moe(x, experts.w13, experts.w2, top_ids, top_weights)  # compiled and warm outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            replayed = fused_moe(x, experts.w13, experts.w2, top_ids, top_weights)
        new_ids, new_weights = routing(2)
        top_ids.copy_(new_ids)
        top_weights.copy_(new_weights)
        x.copy_(torch.randn(num_tokens, hidden, generator=gen).cuda().bfloat16())
        graph.replay()
        assert torch.equal(replayed, fused_moe(x, experts.w13, experts.w2, top_ids, top_weights))


def test_qwen2_vl_under_cuda_graphs_matches_transformers(tmp_path, tokenizer_dir):
    """Qwen2.5-VL on CUDA (float32, Triton attention and rope, decode CUDA graphs): the M-RoPE positions reach the
    rope kernel through the graphs' [3, tokens] buffer, and greedy tokens equal transformers' on the same GPU for
    concurrent prompts with images of different sizes, chunks cutting through them."""
    from tests.test_qwen2_vl import VISION, write_tiny_qwen2_vl

    # head_dim 32, the smallest the Triton attention kernels take: 16 rotary frequencies in sections 4, 6, 6.
    model_dir = write_tiny_qwen2_vl(tmp_path, tokenizer_dir, hidden_size=128, rope_parameters={
        "rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0})
    llm = LLM(str(model_dir), device="cuda", dtype="float32", attention_backend="triton", max_model_len=160,
              num_kvcache_blocks=128, kvcache_block_size=16, max_num_batched_tokens=32)
    assert llm.engine.runner.graphs is not None, "CUDA graphs should be captured"

    prompts = [(f"see {VISION} and say", [random_image(0, 112, 140)]),
               (f"compare {VISION} to {VISION} please", [random_image(1, 56, 56), random_image(2, 112, 84)]),
               (f"what is in {VISION}?", [random_image(3, 56, 84)])]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm.engine.measure_steps(True)
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts],
                        params, use_tqdm=False)
    assert any(t.graph for t in llm.engine.step_timings), "decode steps should replay graphs"
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    for (text, images), out in zip(prompts, outs):
        inputs = processor(text=text, images=images, return_tensors="pt").to("cuda")
        ref = hf.generate(**inputs, do_sample=False, max_new_tokens=32, min_new_tokens=32, eos_token_id=None,
                          pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
    assert llm.engine.kv_manager.get_stats().num_used_blocks == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_host_tier_on_cuda_gives_the_tokens_of_the_device_pool_alone(tmp_path, mode, kv_cache_dtype):
    """Blocks saved to pinned host memory and loaded back on a side stream, under CUDA graphs and steps planned
    ahead, with a pool small enough that requests are preempted and cached blocks evicted all along: the same
    greedy tokens as without the tier, and no copy synchronizes the stream."""
    model_dir = save_tiny_model("qwen3", tmp_path)
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(0, VOCAB, (48,), generator=gen).tolist()
    prompts = [system + p for p in _prompts(VOCAB, [30, 70, 9, 55, 41, 90, 17, 62])]
    common = dict(device="cuda", dtype="float32", max_model_len=192, num_kvcache_blocks=14, kvcache_block_size=16,
                  max_num_batched_tokens=48, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    reference = LLM(str(model_dir), **common)
    expected = _greedy(reference, prompts, 40)
    gib = 64 * reference.engine.runner.bytes_per_block() / 2**30
    reference.shutdown()
    llm = LLM(str(model_dir), kv_offloading_size_gib=gib, preemption_mode=mode, **common)
    assert llm.engine.async_scheduling and llm.engine.runner.graphs is not None
    assert llm.engine.runner.offloader.host_kv.is_pinned()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _greedy(llm, prompts, 40)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got == expected
    host = llm.engine.kv_manager.get_stats().host
    assert host.num_blocks_saved > 0 and host.num_blocks_loaded > 0
    assert (host.num_swapped_in_blocks > 0) == (mode == "swap")
    torch.cuda.synchronize()
    transfers = llm.engine.stats().kv_transfers
    assert transfers.seconds_to_host > 0 and transfers.seconds_to_device > 0


@pytest.fixture(scope="module")
def default_model_path(tokenizer_dir):
    """The GGUF tests' vocabulary is cut from the default model's tokenizer: on a GPU host, its tokenizer folder."""
    return tokenizer_dir


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-q4km"])
def test_int4_and_int8_kernels_under_cuda_graphs_match_the_dequantized_reference(tmp_path, arch, vocabulary):
    """A tiny GGUF of every kept block type served from its blocks on CUDA (``engine.ops.quant_matmul``: decode
    steps in CUDA graphs, K cut into slices whose partial products the next kernels add): in float32 (IEEE products)
    the prompt logprobs and greedy tokens of transformers holding what the file holds (decode steps through the
    one-token GEMV); in bfloat16 the prompt logprobs of the same file dequantized to bfloat16 (``quantization=
    "none"``) within bfloat16's tolerance."""
    from engine.models.linear import Int4LinearMethod, Int8LinearMethod, linear_layers
    from tests.test_gguf_models import TinyModel, write_tiny_gguf
    from tests.test_gguf_quantized import BFLOAT16_TOLERANCE, TINY, _check_logprobs, _prompts

    tiny = TINY[arch]  # hidden 256: heads of 64, which the Triton attention (and so the CUDA graphs) takes
    model = TinyModel(arch=tiny.arch, config={**tiny.config, "hidden_size": 256}, types=tiny.types,
                      chat_template=tiny.chat_template)
    path, reference, _ = write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", model, vocabulary)
    dense_bf16 = None
    for dtype, quantization in (("float32", "gguf"), ("bfloat16", "none"), ("bfloat16", "gguf")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
            llm = LLM(str(path), device="cuda", dtype=dtype, quantization=quantization, max_model_len=128,
                      num_kvcache_blocks=24)
        try:
            if quantization == "none":  # the same file dequantized to bfloat16: the reference of the bf16 kernels
                dense_bf16 = _prompt_logprobs(llm)
                continue
            layers = [layer for _, layer in linear_layers(llm.engine.runner.model)
                      if isinstance(layer.method, (Int4LinearMethod, Int8LinearMethod))]
            assert layers and all(layer.quant_weight is not None and layer.dequantized_weight is None
                                  for layer in layers), "every int4/int8 layer runs the Triton kernels"
            assert llm.engine.runner.graphs is not None
            if dtype == "bfloat16":
                # a whole bfloat16 model (activations, norms, attention), so not against the float32 reference:
                # against the same model dequantized, whose products differ from the kernels' only in rounding. One
                # product rounded otherwise moves the hidden state's roundings in every later layer: the largest
                # difference over the prompts was 0.07-0.08 nats (H100); a wrong code, scale or group costs nats
                diff = (_prompt_logprobs(llm) - dense_bf16).abs()
                assert diff.max() < 2 * BFLOAT16_TOLERANCE and diff.mean() < BFLOAT16_TOLERANCE / 2, (
                    f"bfloat16 logprobs {diff.max():.3f} (mean {diff.mean():.4f}) from the dequantized model's")
                continue
            _check_logprobs(llm, reference, 1e-4, top=True)
            prompts = _prompts(llm.tokenizer)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
            for prompt, out in zip(prompts, outs):
                ids = torch.tensor([prompt])
                expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                              do_sample=False, eos_token_id=None, pad_token_id=0)
                assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()
        finally:
            llm.engine.close()


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    """Every prompt token's logprob of ``tests.test_gguf_quantized``'s prompts, concatenated."""
    from tests.test_gguf_quantized import _prompts

    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(llm.tokenizer)],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([entry.logprob for out in outs for entry in out.prompt_logprobs[1:]])
