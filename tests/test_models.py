"""Model tests against Hugging Face transformers (CPU, float32): the reference is the oracle.

Tiny random checkpoints of every supported architecture are saved with ``save_pretrained``,
loaded through ModelConfig + the loader, and run through the paged attention path in flat
batches (prefill, chunked prefill, decode, mixed). Logits must match Hugging Face's.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig, normalize_rope_scaling
from engine.models import MODEL_REGISTRY, get_model_class
from tests.helpers import SMALL_CONFIG, TINY_CONFIGS, VOCAB, PagedRunner, spread_weights

ATOL = RTOL = 1e-5

@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny_pair(request, tmp_path_factory):
    """(HF model, our model) for one tiny config, our model loaded from HF's safetensors."""
    hf_config = TINY_CONFIGS[request.param]()
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    spread_weights(hf_model)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    assert list(path.glob("*.safetensors")), "save_pretrained wrote no safetensors"
    config = ModelConfig.from_pretrained(path)
    model = load_model(config, dtype=torch.float32, device="cpu")
    return hf_model, model


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


# Lengths: 37 ends inside its third block, 32 fills exactly two blocks, 45 ends inside its third.
PROMPT_LENGTHS = [37, 32, 45]


def test_prefill_matches_hf(tiny_pair):
    hf_model, model = tiny_pair
    prompts = _prompts(PROMPT_LENGTHS)
    runner = PagedRunner(model)
    outputs = runner.step(list(enumerate(prompts)))
    for tokens, logits in zip(prompts, outputs):
        torch.testing.assert_close(logits, _hf_logits(hf_model, tokens), atol=ATOL, rtol=RTOL)


def test_chunked_prefill_matches_hf(tiny_pair):
    hf_model, model = tiny_pair
    prompts = _prompts(PROMPT_LENGTHS, seed=1)
    split = [16, 21, 30]  # first chunk ends on a block boundary, inside a block, inside a block
    runner = PagedRunner(model)
    first = runner.step([(i, p[:s]) for i, (p, s) in enumerate(zip(prompts, split))])
    rest = runner.step([(i, p[s:]) for i, (p, s) in enumerate(zip(prompts, split))])
    for tokens, s, a, b in zip(prompts, split, first, rest):
        expected = _hf_logits(hf_model, tokens)
        torch.testing.assert_close(a, expected[:s], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(b, expected[s:], atol=ATOL, rtol=RTOL)


def test_decode_and_mixed_batch_match_hf(tiny_pair):
    """Decode steps (query length 1) for three requests, then one step mixing decodes and a new prefill."""
    hf_model, model = tiny_pair
    num_decode_steps = 3
    prompts = _prompts(PROMPT_LENGTHS + [20], seed=2)
    runner = PagedRunner(model)
    prefix_lens = [len(p) - num_decode_steps for p in prompts[:3]]
    runner.step([(i, prompts[i][:n]) for i, n in enumerate(prefix_lens)])
    expected = [_hf_logits(hf_model, p) for p in prompts]
    for step in range(num_decode_steps):
        chunks = [(i, [prompts[i][n + step]]) for i, n in enumerate(prefix_lens)]
        is_last = step == num_decode_steps - 1
        if is_last:
            chunks.append((3, prompts[3]))  # a new request prefilled in the same batch, after the decodes
        outputs = runner.step(chunks)
        for i, n in enumerate(prefix_lens):
            torch.testing.assert_close(outputs[i], expected[i][n + step : n + step + 1], atol=ATOL, rtol=RTOL)
        if is_last:
            torch.testing.assert_close(outputs[3], expected[3], atol=ATOL, rtol=RTOL)


def test_fused_params_and_tied_embeddings(tiny_pair):
    hf_model, model = tiny_pair
    names = {name for name, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(model.attention_layers()) == model.config.num_hidden_layers


# ----------------------------------------------------------------------------------------------
# Configuration, registry and loader errors


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="Unsupported architecture 'GPT2LMHeadModel'. Supported: ") as info:
        get_model_class("GPT2LMHeadModel")
    for name in MODEL_REGISTRY:
        assert name in str(info.value)


def test_sliding_windows_per_layer():
    """Mistral's window holds on every layer; Qwen2's only past max_window_layers; one as long as the context
    is no window."""
    mistral = transformers.MistralConfig(**SMALL_CONFIG, sliding_window=16, architectures=["MistralForCausalLM"])
    assert ModelConfig.from_hf_config(mistral, "unused").layer_windows == (16, 16)
    qwen2 = transformers.Qwen2Config(**SMALL_CONFIG, use_sliding_window=True, sliding_window=16, max_window_layers=1,
                                     architectures=["Qwen2ForCausalLM"])
    assert ModelConfig.from_hf_config(qwen2, "unused").layer_windows == (0, 16)
    long = transformers.MistralConfig(**SMALL_CONFIG, sliding_window=4096, architectures=["MistralForCausalLM"])
    assert ModelConfig.from_hf_config(long, "unused").layer_windows == (0, 0)


def test_transformers4_style_config():
    """A 4.x config has rope_theta + rope_scaling (sometimes keyed "type") and torch_dtype."""
    hf_config = SimpleNamespace(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        **SMALL_CONFIG,
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 2},
        torch_dtype="bfloat16",
        eos_token_id=[5, 6],
        bos_token_id=1,
    )
    config = ModelConfig.from_hf_config(hf_config, "unused")
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.dtype == torch.bfloat16
    assert config.eos_token_ids == [5, 6]
    assert config.head_dim == 16
    assert config.sliding_window is None


def test_rope_scaling_normalisation():
    assert normalize_rope_scaling(None) is None
    assert normalize_rope_scaling({"rope_type": "default", "rope_theta": 1e4}) is None
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        normalize_rope_scaling({"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="missing"):
        normalize_rope_scaling({"rope_type": "llama3", "factor": 8.0})


def _save_tiny_llama(path: Path, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL_CONFIG, **overrides))
    hf_model.save_pretrained(path)
    return hf_model


def test_eos_ids_merge_generation_config(tmp_path):
    _save_tiny_llama(tmp_path, eos_token_id=2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = ModelConfig.from_pretrained(tmp_path)
    assert config.eos_token_ids == [2, 7]
    assert config.architecture == "LlamaForCausalLM"
    assert config.dtype == torch.float32


def test_missing_checkpoint_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _save_tiny_llama(tmp_path)
    [shard] = tmp_path.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(ModelConfig.from_pretrained(tmp_path), torch.float32, "cpu")


def test_auto_format_without_safetensors(tmp_path):
    _save_tiny_llama(tmp_path)
    for shard in tmp_path.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        load_model(ModelConfig.from_pretrained(tmp_path), torch.float32, "cpu", load_format="auto")


def test_dummy_weights_are_finite_and_deterministic(tmp_path):
    _save_tiny_llama(tmp_path, tie_word_embeddings=True)
    config = ModelConfig.from_pretrained(tmp_path)
    models = [load_model(config, torch.float32, "cpu", load_format="dummy", seed=s) for s in (3, 3, 4)]
    outputs = [PagedRunner(m).step([(0, list(range(40)))])[0] for m in models]
    assert torch.isfinite(outputs[0]).all()
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)
    assert not torch.equal(outputs[0], outputs[2])


# ----------------------------------------------------------------------------------------------
# The real default model


@pytest.fixture(scope="module")
def smollm2(default_model_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(default_model_path).eval()
    model = load_model(ModelConfig.from_pretrained(default_model_path), torch.float32, "cpu")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return tokenizer, hf_model, model, prompt_ids


def test_default_model_config(default_model_path):
    config = ModelConfig.from_pretrained(default_model_path)
    assert config.architecture == "LlamaForCausalLM"
    assert config.tie_word_embeddings
    assert config.eos_token_ids == [2]
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)


def test_default_model_prefill_matches_hf(smollm2):
    _, hf_model, model, prompt_ids = smollm2
    [logits] = PagedRunner(model).step([(0, prompt_ids)])
    torch.testing.assert_close(logits, _hf_logits(hf_model, prompt_ids), atol=1e-4, rtol=1e-4)


def test_default_model_greedy_decode_matches_hf_generate(smollm2):
    tokenizer, hf_model, model, prompt_ids = smollm2
    num_new = 10
    # Ignore eos on both sides so all ten tokens are compared, including what follows <|im_end|>.
    hf_out = hf_model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=num_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    hf_tokens = hf_out[0, len(prompt_ids) :].tolist()

    runner = PagedRunner(model)
    [logits] = runner.step([(0, prompt_ids)])
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < num_new:
        [logits] = runner.step([(0, [tokens[-1]])])
        tokens.append(int(logits[-1].argmax()))
    assert tokens == hf_tokens
    assert tokenizer.decode(tokens).startswith("The capital of France is Paris.")
    assert tokens.index(2) == 7  # <|im_end|>, the eos, right after the sentence
