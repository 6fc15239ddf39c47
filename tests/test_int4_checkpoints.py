"""AWQ, GPTQ and compressed-tensors checkpoints served quantized (``engine.loading.int_weights``; the layouts of
``engine.models.linear.awq``, ``gptq`` and ``compressed``; ``w8a8``).

Tiny random Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms) models are quantized here, group by group, and written
in each format's on-disk layout: AWQ's and GPTQ's int32 words packed as AutoAWQ and AutoGPTQ pack them (written out
below from those formats; the orders are pinned on words whose values are known), compressed-tensors' tensors by
compressed-tensors' own compressors, whose decompressors give the reference weights. The reference is transformers in
float32 holding the dequantized weights: every prompt token's logprob within float32's tolerance, and the greedy
tokens equal. W8A8's reference also rounds each projection's input per token to int8, as the layers do.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from safetensors.torch import save_file

from engine import LLM, SamplingParams, distributed
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from engine.models.linear import (
    Int4LinearMethod,
    Int8LinearMethod,
    RowParallelLinear,
    UnquantizedLinearMethod,
    dequantize_int4,
    dequantize_int8,
    linear_layers,
    process_weights_after_loading,
    w8a8,
)
from engine.models.linear.w8a8 import W8A8LinearMethod
from engine.models.weight_loading import load_checkpoint_weights
from tests.helpers import PagedRunner, spread_weights

VOCAB = 320
DIMS = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
FAMILIES = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
# Each projection's input: q|k|v read one, gate|up another, and so share an act order.
INPUTS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp", "up_proj": "mlp",
          "down_proj": "down"}
FLOAT32_TOLERANCE = 1e-4


# ------------------------------------------------------------------------------------------ quantizing


@dataclass
class Quantized:
    """W = (codes - zeros) * scales, per column's group ``g_idx``."""

    codes: torch.Tensor  # [out, in] int64, unsigned
    zeros: torch.Tensor  # [out, groups] int64
    scales: torch.Tensor  # [out, groups] float32, rounded to the dtype the checkpoint stores them in
    g_idx: torch.Tensor  # [in] int64

    def dequantized(self) -> torch.Tensor:
        return (self.codes - self.zeros[:, self.g_idx]).float() * self.scales[:, self.g_idx]


def quantize(w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool, scale_dtype=torch.float16,
             min_zero: int = 0) -> Quantized:
    """Min-max quantization of each row's groups (GPTQ's sym: zero point 2^(bits - 1))."""
    maxq, groups = (1 << bits) - 1, int(g_idx.max()) + 1
    scales, zeros = torch.empty(w.shape[0], groups), torch.empty(w.shape[0], groups, dtype=torch.long)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scale, zero = cols.abs().amax(1) * 2 / maxq, torch.full((w.shape[0],), (maxq + 1) // 2)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale = (hi - lo) / maxq
            zero = torch.round(-lo / scale).clamp(min_zero, maxq)
        scales[:, g], zeros[:, g] = scale.to(scale_dtype).float(), zero.long()
    codes = torch.clamp(torch.round(w / scales[:, g_idx]) + zeros[:, g_idx], 0, maxq).long()
    return Quantized(codes, zeros, scales, g_idx)


def pack_along(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """AutoGPTQ's packing: 32 / bits values a word along ``dim``, the first in the lowest bits."""
    per = 32 // bits
    v = values.long().movedim(dim, -1).unflatten(-1, (-1, per))
    words = torch.zeros(v.shape[:-1], dtype=torch.long)
    for j in range(per):
        words |= v[..., j] << (bits * j)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: a word's value i is channel AWQ_PACK_ORDER[i] of 8


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of [rows, channels]: 8 channels a word, in its order."""
    return pack_along(values.long().unflatten(1, (-1, 8))[..., AWQ_PACK_ORDER].flatten(1), 4, 1)


def test_the_packers_write_the_formats_words():
    """Words whose values the formats fix: AWQ's channels 0-7 holding 0-7, GPTQ's rows likewise, all 15s."""
    assert pack_awq(torch.arange(8)[None]).item() == 0x75316420
    assert pack_along(torch.arange(8)[:, None], 4, 0).item() == 0x76543210
    assert pack_along(torch.full((1, 8), 15), 4, 1).item() == -1
    assert pack_along(torch.tensor([[1, 2, 3, 255]]), 8, 1).item() == -(2**32 - 0xFF030201)


# ------------------------------------------------------------------------------------------ the formats


Encoder = Callable[[str, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def awq(group: int, zero_point: bool = True) -> tuple[dict, Encoder]:
    def encode(module: str, w: torch.Tensor):
        q = quantize(w, 4, torch.arange(w.shape[1]) // group, sym=not zero_point)
        tensors = {"qweight": pack_awq(q.codes.t()), "scales": q.scales.t().half()}
        if zero_point:
            tensors["qzeros"] = pack_awq(q.zeros.t())
        return q.dequantized(), tensors

    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": zero_point, "version": "gemm"}, encode


def act_order(module: str, columns: int, group: int) -> torch.Tensor:
    """A random order of quantization shared by the projections of one input; g_idx[perm[j]] = j // group."""
    layer, read = int(module.split(".")[2]), INPUTS[module.rsplit(".", 1)[-1]]
    seed = 16 * layer + sorted(set(INPUTS.values())).index(read)
    perm = torch.randperm(columns, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(columns, dtype=torch.long)
    g_idx[perm] = torch.arange(columns) // group
    return g_idx


def gptq(bits: int, group: int | None, sym: bool, version: int, desc_act: bool = False) -> tuple[dict, Encoder]:
    def encode(module: str, w: torch.Tensor):
        columns = w.shape[1]
        g_idx = act_order(module, columns, group) if desc_act else torch.arange(columns) // (group or columns)
        q = quantize(w, bits, g_idx, sym, min_zero=1 if version == 1 else 0)  # v1 cannot store a zero point of 0
        stored = q.zeros - (1 if version == 1 else 0)
        return q.dequantized(), {"qweight": pack_along(q.codes.t(), bits, 0), "qzeros": pack_along(stored.t(), bits, 1),
                                 "scales": q.scales.t().half(), "g_idx": g_idx.int()}

    return {"quant_method": "gptq", "bits": bits, "group_size": group or -1, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": "gptq" if version == 1 else "gptq_v2", "lm_head": False}, encode


def compressed_config(scheme: QuantizationScheme, fmt: str) -> dict:
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                                quantization_status="compressed").to_dict()
    return json.loads(json.dumps(config, default=str))


def packed(bits: int, group: int | None, sym: bool) -> tuple[dict, Encoder]:
    """compressed-tensors pack-quantized, by its own compressor (scales stored in bfloat16)."""
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", strategy="group" if group else "channel", group_size=group, symmetric=sym))

    def encode(module: str, w: torch.Tensor):
        q = quantize(w, bits, torch.arange(w.shape[1]) // (group or w.shape[1]), sym, scale_dtype=torch.bfloat16)
        state = {"weight": w, "weight_scale": q.scales.to(torch.bfloat16)}
        if not sym:
            state["weight_zero_point"] = (q.zeros - (1 << (bits - 1))).to(torch.int8)  # signed
        tensors = PackedQuantizationCompressor.compress(state, scheme)
        back = PackedQuantizationCompressor.decompress({**tensors, "weight_scale": q.scales}, scheme)["weight"]
        return back.float(), tensors

    return compressed_config(scheme, "pack-quantized"), encode


def int8_quantized(activations: bool) -> tuple[dict, Encoder]:
    """compressed-tensors int-quantized int8 weights, a scale per channel; W8A8 with int8 per-token activations."""
    inputs = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], input_activations=inputs if activations else None,
                                weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True))

    def encode(module: str, w: torch.Tensor):
        scale = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16)
        tensors = IntQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        back = IntQuantizationCompressor.decompress({**tensors, "weight_scale": scale.float()}, scheme)["weight"]
        return back.float(), tensors

    return compressed_config(scheme, "int-quantized"), encode


CASES = {
    "awq-g128-llama": ("llama", awq(128)),
    "awq-g64-qwen2": ("qwen2", awq(64)),
    "awq-g32-no-zero-point-qwen3": ("qwen3", awq(32, zero_point=False)),
    "gptq-g32-sym-qwen3": ("qwen3", gptq(4, 32, True, 1)),
    "gptq-g64-asym-v2-llama": ("llama", gptq(4, 64, False, 2)),
    "gptq-g32-asym-act-order-qwen2": ("qwen2", gptq(4, 32, False, 1, desc_act=True)),
    "gptq-channel-sym-llama": ("llama", gptq(4, None, True, 1)),
    "gptq-int8-g64-act-order-qwen2": ("qwen2", gptq(8, 64, True, 1, desc_act=True)),
    "ct-w4a16-g32-qwen3": ("qwen3", packed(4, 32, True)),
    "ct-w4a16-asym-g128-llama": ("llama", packed(4, 128, False)),
    "ct-w4a16-asym-channel-qwen2": ("qwen2", packed(4, None, False)),
    "ct-w8a16-g64-llama": ("llama", packed(8, 64, True)),
    "ct-w8a16-int-quantized-qwen3": ("qwen3", int8_quantized(activations=False)),
    "ct-w8a8-qwen2": ("qwen2", int8_quantized(activations=True)),
}
METHOD = {"awq": Int4LinearMethod, "gptq": Int4LinearMethod, "gptq-int8": Int8LinearMethod,
          "ct-w4a16": Int4LinearMethod, "ct-w8a16": Int8LinearMethod, "ct-w8a8": W8A8LinearMethod}


def expected_method(case: str) -> type:
    return next(method for prefix, method in sorted(METHOD.items(), key=lambda kv: -len(kv[0]))
                if case.startswith(prefix))


def reference_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](**DIMS), dtype=torch.float32).eval()
    spread_weights(model)
    return model


def write_checkpoint(reference: torch.nn.Module, path: Path, quant_config: dict, encode: Encoder) -> Path:
    """The reference's weights with every projection in the format's tensors; the reference then holds what they
    dequantize to."""
    state = {}
    for name, tensor in reference.state_dict().items():
        module, _, param = name.rpartition(".")
        if param == "weight" and module.rsplit(".", 1)[-1] in INPUTS:
            dequantized, tensors = encode(module, tensor)
            state |= {f"{module}.{key}": value.contiguous() for key, value in tensors.items()}
            with torch.no_grad():
                reference.get_parameter(name).copy_(dequantized)
        else:
            state[name] = tensor.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, path / "model.safetensors")
    reference.config.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config |= {"architectures": [type(reference).__name__], "quantization_config": quant_config}
    (path / "config.json").write_text(json.dumps(config))
    return path


def round_inputs_to_int8(reference: torch.nn.Module) -> None:
    """W8A8's reference: each projection's input rounded per token to int8, as ``W8A8LinearMethod`` does."""
    def hook(module, args):
        x = args[0].float()
        scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        return ((x / scale).round().clamp(-127, 127) * scale,)

    for name, module in reference.named_modules():
        if name.rsplit(".", 1)[-1] in INPUTS:
            module.register_forward_pre_hook(hook)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 21, 30)]


def checkpoint(case: str, path: Path) -> tuple[torch.nn.Module, Path]:
    """(the reference holding the dequantized weights, the checkpoint's directory) of one of ``CASES``."""
    family, (quant_config, encode) = CASES[case]
    reference = reference_model(family)
    path = write_checkpoint(reference, path, quant_config, encode)
    if case.startswith("ct-w8a8"):
        round_inputs_to_int8(reference)
    return reference, path


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request, tmp_path_factory):
    reference, path = checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    llm = LLM(str(path), max_model_len=128, num_kvcache_blocks=24)
    return SimpleNamespace(name=request.param, path=path, reference=reference, llm=llm)


def test_layers_load_quantized_and_drop_the_checkpoints_tensors(served):
    """Every projection gets the format's method; the packed words, zero points and g_idx are gone after loading
    (the int4 method's codes, scales and zeros, or the int8 weights, are what stays)."""
    model = served.llm.engine.runner.model
    method = expected_method(served.name)
    layers = dict(linear_layers(model))
    assert len(layers) == 8 and all(isinstance(layer.method, method) for layer in layers.values())
    qkv = model.model.layers[0].self_attn.qkv_proj
    params = {name for name, _ in qkv.named_parameters(recurse=False)} - {"bias"}
    if method is W8A8LinearMethod:
        assert params == {"weight", "weight_scale"} and qkv.weight.dtype == torch.int8
    elif method is Int4LinearMethod:
        assert params == {"qweight", "scales", "zeros"} and qkv.qweight.shape == (256, 64)
    else:
        assert params == {"qweight", "scales"} and qkv.qweight.dtype == torch.int8
    act_order = "act-order" in served.name
    assert all((getattr(layer, "input_perm", None) is not None) == act_order for layer in layers.values())


def check_logprobs(llm: LLM, reference: torch.nn.Module) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], SamplingParams(max_tokens=1, prompt_logprobs=5),
                        use_tqdm=False)
    for prompt, out in zip(prompts(), outs):
        with torch.no_grad():
            expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            row = expected[pos - 1]
            assert entry.logprob == pytest.approx(row[prompt[pos]].item(), abs=FLOAT32_TOLERANCE)
            assert entry.top_token_ids == row.topk(5).indices.tolist()


def check_greedy(llm: LLM, reference: torch.nn.Module) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts(), outs):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_logprobs_match_the_dequantized_weights(served):
    """Every prompt token's logprob and top 5 as transformers' in float32 holding the dequantized weights."""
    check_logprobs(served.llm, served.reference)


def test_greedy_tokens_equal_transformers(served):
    check_greedy(served.llm, served.reference)


@pytest.mark.parametrize("case", ["awq-g64-qwen2", "gptq-g32-sym-qwen3", "ct-w4a16-asym-channel-qwen2"])
def test_two_ranks_serve_the_checkpoint_as_one(case, tmp_path, one_thread_per_rank):
    """At tensor_parallel_size=2 each rank loads its rows (q|k|v, gate|up: whole words of AWQ's packed channels and
    of the zero points) or its whole groups of columns (o, down; a scale per channel is every rank's): the same
    logprobs and greedy tokens as transformers."""
    reference, path = checkpoint(case, tmp_path / case)
    with LLM(str(path), tensor_parallel_size=2, max_model_len=128, num_kvcache_blocks=24) as tp2:
        check_logprobs(tp2, reference)
        check_greedy(tp2, reference)


@pytest.mark.parametrize("int_mm", [True, False], ids=["int-mm", "emulated"])
def test_w8a8_products_quantize_each_token_to_int8(monkeypatch, int_mm):
    """x W^T with x rounded per token to int8 (a = amax|x| / 127) and W = q * s: through torch._int_mm, and by the
    float32 emulation where it does not run; an empty batch too."""
    monkeypatch.setattr(w8a8, "int_mm_available", lambda device: int_mm)
    gen = torch.Generator().manual_seed(5)
    layer = RowParallelLinear(96, 40, bias=True)
    layer.set_method(W8A8LinearMethod())
    weight = torch.randint(-127, 128, (40, 96), dtype=torch.int8, generator=gen)
    scale, bias = torch.rand(40, 1, generator=gen) * 0.01, torch.randn(40, generator=gen)
    model = torch.nn.ModuleDict({"proj": layer})
    load_checkpoint_weights(model, [("proj.weight", weight), ("proj.weight_scale", scale), ("proj.bias", bias)])
    process_weights_after_loading(model)
    assert layer.int8_mm == int_mm and (layer.widened_weight is None) == int_mm
    x = torch.randn(5, 96, generator=gen) * torch.tensor([0.1, 1, 10, 100, 1000])[:, None]
    a = x.abs().amax(1, keepdim=True) / 127
    expected = ((x / a).round() * a) @ (weight.float() * scale).T + bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert layer(x[:0]).shape == (0, 40)


# ------------------------------------------------------------------------------------------ dummy weights


def write_config(path: Path, family: str, quant_config: dict, config_class=None, **overrides) -> Path:
    """A model directory of a config alone (for dummy weights)."""
    config_class = config_class or FAMILIES[family]
    config = config_class(**{**DIMS, **overrides})
    config.architectures = [config_class.__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, "quantization_config": quant_config}))
    return path


def dequantized(layer) -> torch.Tensor:
    if isinstance(layer.method, Int4LinearMethod):
        return dequantize_int4(layer.qweight, layer.scales, layer.zeros, layer.method.group_size)
    if isinstance(layer.method, Int8LinearMethod):  # on the CPU without the int8 op: the codes went into the copy
        return layer.dequantized_weight if layer.qweight.numel() == 0 else dequantize_int8(layer.qweight, layer.scales)
    return layer.weight.float() * layer.weight_scale


@pytest.mark.parametrize("case", ["awq-g128-llama", "gptq-g32-asym-act-order-qwen2", "gptq-int8-g64-act-order-qwen2",
                                  "ct-w4a16-asym-g128-llama", "ct-w8a8-qwen2"])
def test_dummy_weights_of_a_quantized_config(case, tmp_path):
    """``load_format="dummy"`` with a checkpoint's quantization_config (as benchmarks build large models): random
    codes, with scales and zero points that make W about N(0, 0.02), so that activations stay O(1)."""
    family, (quant_config, _) = CASES[case]
    model = load_model(ModelConfig.from_pretrained(write_config(tmp_path, family, quant_config)), torch.float32, "cpu",
                       load_format="dummy")
    for name, layer in linear_layers(model):
        assert isinstance(layer.method, expected_method(case)), name
        assert getattr(layer, "input_perm", None) is None  # dummy groups are in order
        weight = dequantized(layer)
        assert 0.017 < weight.std().item() < 0.023 and abs(weight.mean().item()) < 0.15 * weight.std().item(), name
    logits = PagedRunner(model).step([(0, prompts()[2])])[0]
    assert torch.isfinite(logits).all() and 0.05 < logits.std().item() < 20


def test_modules_a_checkpoint_keeps_unquantized_stay_so(tmp_path):
    """AWQ's and GPTQ's modules_to_not_convert, GPTQ's modules_in_block_to_quantize, compressed-tensors' ignore (a
    regular expression here): those layers keep 16/32-bit weights."""
    configs = {
        "awq": {**CASES["awq-g128-llama"][1][0], "modules_to_not_convert": ["mlp"]},
        "gptq": {**CASES["gptq-g32-sym-qwen3"][1][0], "modules_in_block_to_quantize": [
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.down_proj"]]},
        "compressed-tensors": {**CASES["ct-w4a16-g32-qwen3"][1][0], "ignore": ["lm_head", "re:.*self_attn.o_proj$"]},
    }
    expected = {"awq": {"qkv_proj", "o_proj"}, "gptq": {"qkv_proj", "down_proj"},
                "compressed-tensors": {"qkv_proj", "gate_up_proj", "down_proj"}}
    for name, quant_config in configs.items():
        path = write_config(tmp_path / name, "llama", quant_config)
        model = load_model(ModelConfig.from_pretrained(path), torch.float32, "cpu", load_format="dummy")
        quantized = {layer_name.rsplit(".", 1)[-1] for layer_name, layer in linear_layers(model)
                     if not isinstance(layer.method, UnquantizedLinearMethod)}
        assert quantized == expected[name], name


# ------------------------------------------------------------------------------------------ refusals


def gptq_config(**changes) -> dict:
    return {**CASES["gptq-g32-sym-qwen3"][1][0], **changes}


def compressed_changed(case: str, change: Callable[[dict], None]) -> dict:
    config = json.loads(json.dumps(CASES[case][1][0]))
    change(config)
    return config


REFUSED = {
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True},
                     r"quant_method 'bitsandbytes' is not supported; supported: fp8 .*awq .*gptq .*compressed-tensors"),
    "awq-gemv": ({**CASES["awq-g128-llama"][1][0], "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    "awq-marlin": ({**CASES["awq-g128-llama"][1][0], "version": "marlin"}, "AWQ version 'marlin'"),
    "awq-8-bits": ({**CASES["awq-g128-llama"][1][0], "bits": 8}, "AWQ checkpoints of 8 bits"),
    "gptq-marlin": (gptq_config(checkpoint_format="marlin"), "GPTQ checkpoint_format 'marlin' is not supported"),
    "gptq-3-bits": (gptq_config(bits=3), "GPTQ checkpoints of 3 bits"),
    "gptq-int8-asym": (gptq_config(bits=8, sym=False), "8-bit GPTQ checkpoints with zero points"),
    "gptq-lm-head": (gptq_config(lm_head=True), "quantized LM head"),
    "gptq-dynamic": (gptq_config(dynamic={"-:.*down": {}}), "dynamic"),
    "gptq-group-12": (gptq_config(group_size=12), "group_size 12 is not supported"),
    "ct-float-weights": (compressed_changed("ct-w4a16-g32-qwen3", lambda c: c["config_groups"]["group_0"]["weights"]
                                            .update(type="float", num_bits=8)), "float weights are not supported"),
    "ct-act-order-group": (compressed_changed("ct-w4a16-g32-qwen3", lambda c: c["config_groups"]["group_0"]["weights"]
                                              .update(actorder="group")), "actorder 'group'"),
    "ct-lm-head": (compressed_changed("ct-w4a16-g32-qwen3", lambda c: c.update(ignore=[])), "quantizes the LM head"),
    "ct-w4a8": (compressed_changed("ct-w4a16-g32-qwen3", lambda c: c["config_groups"]["group_0"].update(
        input_activations=CASES["ct-w8a8-qwen2"][1][0]["config_groups"]["group_0"]["input_activations"])),
        "format 'pack-quantized' with 4-bit weights and quantized inputs is not supported"),
    "ct-static-activations": (compressed_changed("ct-w8a8-qwen2", lambda c: c["config_groups"]["group_0"][
        "input_activations"].update(dynamic=False)), "only dynamic, symmetric, per-token"),
    "ct-frozen": (compressed_changed("ct-w4a16-g32-qwen3", lambda c: c.update(quantization_status="frozen")),
                  "quantization_status 'frozen'"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_quantization_configs_are_refused_by_name(name, tmp_path):
    quant_config, match = REFUSED[name]
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(write_config(tmp_path, "llama", quant_config))


def test_what_the_layers_cannot_take_is_refused_when_loading(tmp_path, monkeypatch):
    """A quantized MoE model (its experts), a fused layer whose parts differ, --quantization on a quantized checkpoint,
    and act order split over tensor-parallel ranks: each a ValueError naming it."""
    def load(path, **kwargs):
        return load_model(ModelConfig.from_pretrained(path), torch.float32, "cpu", load_format="dummy", **kwargs)

    gptq = gptq_config()
    moe = write_config(tmp_path / "moe", "qwen3", gptq, transformers.Qwen3MoeConfig, moe_intermediate_size=64,
                       num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="mixture-of-experts models in GPTQ checkpoints are not supported"):
        load(moe)
    mixed = write_config(tmp_path / "mixed", "llama", {**gptq, "modules_to_not_convert": ["k_proj"]})
    with pytest.raises(ValueError, match=r"qkv_proj: its parts .* are stored in different formats"):
        load(mixed)
    with pytest.raises(ValueError, match=r"quantized already \(GPTQ\): quantization='fp8'"):
        load(write_config(tmp_path / "fp8", "llama", gptq), quantization="fp8")
    monkeypatch.setattr(distributed, "_state", distributed.ParallelState(rank=1, world_size=2))
    act_order = write_config(tmp_path / "act-order", "llama", gptq_config(desc_act=True))
    with pytest.raises(ValueError, match="o_proj: a GPTQ checkpoint with desc_act"):
        load(act_order)
