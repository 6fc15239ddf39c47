"""GGUF files of other architectures and quantization types than the default model's (Llama, Q4_1).

A tiny random Llama and a tiny random Qwen2 (with its q/k/v biases) are written with the ``gguf`` package the
way llama.cpp writes them: its metadata keys and tensor names, Llama's Q/K rows permuted for its rotary
layout, the vocabulary (the default model's byte-level BPE), the special token ids and a chat template inside.
Norms and biases are F32; the 2-D weights are Q8_0, Q4_0 and Q4_1 (quantized by ``gguf``) and the K-quants
Q4_K, Q5_K and Q6_K, which ``gguf`` only dequantizes, so their blocks are built byte by byte here.

The reference is a float32 transformers model holding exactly what the file holds (every tensor dequantized by
``gguf``, Llama's Q/K rows put back in Hugging Face's order). ``LLM("file.gguf", quantization="none")`` (every
weight dequantized; by default the Q4/Q8 layers stay in their blocks, tests/test_gguf_quantized.py) must hold the
same weights, score prompts as it does within float32's rounding, decode the same greedy tokens, and tokenize and
render chats with the file's own tokenizer and chat template.

The vocabulary is the default model's first ``VOCAB`` tokens and the merges that build them. SmolLM2's merge k
makes token 252 + k, so that prefix is a complete BPE vocabulary of its own: on any text it tokenizes as the full
tokenizer would had its training stopped there. The full 49152 tokens and 48900 merges would cost each conversion
about 15 s of CPU just reading the metadata (transformers' GGUF loader parses it three times with ``gguf``'s
reader); tests/test_gguf.py covers a full-size vocabulary with the default model's own file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from tests.helpers import spread_weights

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
VOCAB = 4096

# ChatML without SmolLM's default system prompt, so a Qwen2 file's template is told apart from the default model's.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _layer_types(*layers: dict[str, Q]) -> dict[str, Q]:
    return {f"blk.{i}.{name}.weight": qtype for i, layer in enumerate(layers) for name, qtype in layer.items()}


@dataclass(frozen=True)
class TinyModel:
    arch: str  # general.architecture, and the prefix of the model's metadata keys
    config: dict  # the transformers config, less the vocabulary
    # GGML type of each 2-D weight by GGUF name; every other tensor (norms, biases) is F32. A K-quant needs rows
    # of a multiple of 256 values, the other types of 32.
    types: dict[str, Q]
    chat_template: str | None  # None: the default model's


MODELS = {
    # Hidden 64, so only ffn_down (rows of intermediate_size = 256) can be a K-quant. Tied embeddings: no output.weight.
    "llama": TinyModel(
        arch="llama",
        config=dict(model_type="llama", hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=float(np.float32(1e-5)), rope_theta=10000.0, tie_word_embeddings=True),
        types={"token_embd.weight": Q.Q8_0, **_layer_types(
            dict(attn_q=Q.Q4_0, attn_k=Q.Q4_1, attn_v=Q.Q8_0, attn_output=Q.Q4_1,
                 ffn_gate=Q.Q4_0, ffn_up=Q.Q8_0, ffn_down=Q.Q4_K),
            dict(attn_q=Q.Q8_0, attn_k=Q.Q4_0, attn_v=Q.Q4_1, attn_output=Q.Q4_0,
                 ffn_gate=Q.Q4_1, ffn_up=Q.Q4_0, ffn_down=Q.Q5_K))},
        chat_template=None,
    ),
    # Hidden 256: K-quants anywhere, the embeddings and a separate output matrix too (as llama.cpp's Q4_K_M files).
    "qwen2": TinyModel(
        arch="qwen2",
        config=dict(model_type="qwen2", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=float(np.float32(1e-6)), rope_theta=1000000.0, tie_word_embeddings=False),
        types={"token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K, **_layer_types(
            dict(attn_q=Q.Q5_K, attn_k=Q.Q6_K, attn_v=Q.Q4_K, attn_output=Q.Q8_0,
                 ffn_gate=Q.Q4_1, ffn_up=Q.Q4_0, ffn_down=Q.Q6_K),
            dict(attn_q=Q.Q8_0, attn_k=Q.Q4_0, attn_v=Q.Q4_1, attn_output=Q.Q5_K,
                 ffn_gate=Q.Q4_K, ffn_up=Q.Q5_K, ffn_down=Q.Q8_0))},
        chat_template=QWEN2_CHAT_TEMPLATE,
    ),
}

# Between them the two files hold every type asked of GGUF support.
assert {qtype for model in MODELS.values() for qtype in model.types.values()} == {
    Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K}

# Hugging Face module names -> llama.cpp's, for the tensors of these two architectures.
_TOP_LEVEL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """``model.layers.3.self_attn.q_proj.bias`` -> ``blk.3.attn_q.bias``."""
    module, leaf = hf_name.rsplit(".", 1)
    if module in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[module]}.{leaf}"
    _, _, layer, inner = module.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[inner]}.{leaf}"


def to_llama_cpp_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Reorder each head's rows from Hugging Face's rotary layout (first half of the head rotates with the second
    half) to llama.cpp's (row pairs 2i, 2i + 1 rotate together), as llama.cpp's converter does for Llama Q and K."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def from_llama_cpp_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of ``to_llama_cpp_rows``."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def k_quant_blocks(shape: tuple[int, int], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Valid ``qtype`` blocks for a weight of ``shape``, as the file's bytes: [rows, bytes per row] uint8.

    Quants and sub-block scales are random bytes; the float16 super-block scales are chosen so that the weights
    come out with a spread of about 1 / sqrt(row length), centred on zero, like a trained layer's.
      Q4_K / Q5_K (144 / 176 bytes): d, dmin (f16), 12 bytes of 6-bit sub-block scales and mins, then the
        quants (Q5_K: 32 bytes of high bits, then 128 of low nibbles); w = d * scale * q - dmin * min.
      Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high bits, 16 int8 sub-block scales, then d (f16);
        w = d * scale * (q - 32).
    """
    rows, cols = shape
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = rows * cols // block_values
    blocks = rng.integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)
    spread = 1 / np.sqrt(cols)
    jitter = rng.uniform(0.5, 1.5, size=num_blocks)  # every block its own scale

    def f16_bytes(values: np.ndarray) -> np.ndarray:
        return values.astype(np.float16).view(np.uint8).reshape(num_blocks, 2)

    if qtype == Q.Q6_K:
        scales = rng.integers(-32, 32, size=(num_blocks, 16), dtype=np.int8)  # keeps d a normal float16
        blocks[:, 192:208] = scales.view(np.uint8)
        blocks[:, 208:210] = f16_bytes(spread / 340 * jitter)  # |scale * (q - 32)| has a spread of ~340
    else:
        top = 15 if qtype == Q.Q4_K else 31  # the largest quant
        d = spread / (17 * top) * jitter  # scale (0..63) * q - min (0..63) * top / 2 has a spread of ~17 * top
        blocks[:, 0:2] = f16_bytes(d)
        blocks[:, 2:4] = f16_bytes(d * top / 2)  # dmin: the mins (0..63) cancel the quants' mean on average
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, model: TinyModel, hf_model, vocabulary: dict, rng: np.random.Generator) -> dict:
    """Write ``hf_model`` as a llama.cpp-style GGUF of ``model``'s types; return the weights the file holds, by
    Hugging Face name, as float32 tensors (the reference)."""
    config = hf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), model.arch)
    writer.add_name(f"tiny {model.arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(model.config["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_types(vocabulary["token_types"])
    writer.add_token_merges(vocabulary["merges"])
    for role, token_id in vocabulary["special_ids"].items():
        getattr(writer, f"add_{role}_token_id")(token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(model.chat_template or vocabulary["chat_template"])

    held = {}
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        name = gguf_name(hf_name)
        weight = tensor.numpy()
        # Llama's Q and K rows are permuted in the file (K's heads are the KV heads); Qwen2's are not.
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(name.split(".")[-2])
        permuted = model.arch == "llama" and heads is not None
        if permuted:
            weight = to_llama_cpp_rows(weight, heads)
        qtype = model.types.get(name, Q.F32)
        assert (qtype == Q.F32) == (weight.ndim == 1), f"{name}: 2-D weights are quantized, the rest is F32"
        if qtype in K_QUANTS:
            data = k_quant_blocks(weight.shape, qtype, rng)
        else:
            data = gguf.quants.quantize(weight, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        values = gguf.quants.dequantize(data, qtype).reshape(weight.shape)
        if permuted:
            values = from_llama_cpp_rows(values, heads)
        held[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
    if "lm_head.weight" not in held:
        held["lm_head.weight"] = held["model.embed_tokens.weight"]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


@pytest.fixture(scope="module")
def default_tokenizer(default_model_path):
    return transformers.AutoTokenizer.from_pretrained(str(default_model_path))


@pytest.fixture(scope="module")
def vocabulary(default_model_path, default_tokenizer) -> dict:
    """The default model's tokenizer cut to its first ``VOCAB`` tokens, as llama.cpp stores one (tokens in id
    order, their types: 3, control, for the special tokens, 1, normal, for the rest; merges as "left right"; the
    special ids; the chat template), and the same cut as a ``tokenizers`` tokenizer (``reference``)."""
    spec = json.loads((default_model_path / "tokenizer.json").read_text())
    vocab = {token: token_id for token, token_id in spec["model"]["vocab"].items() if token_id < VOCAB}
    pairs = [merge.split(" ") if isinstance(merge, str) else merge for merge in spec["model"]["merges"]]
    pairs = [pair for pair in pairs if "".join(pair) in vocab and all(part in vocab for part in pair)]
    assert all(added["id"] < VOCAB for added in spec["added_tokens"])
    spec["model"].update(vocab=vocab, merges=pairs)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[token] for token in tokens] == list(range(VOCAB))
    special = {added["id"] for added in spec["added_tokens"] if added["special"]}
    return dict(
        tokens=tokens,
        token_types=[3 if token_id in special else 1 for token_id in range(VOCAB)],
        merges=[" ".join(pair) for pair in pairs],
        special_ids={role: default_tokenizer.convert_tokens_to_ids(getattr(default_tokenizer, f"{role}_token"))
                     for role in ("bos", "eos", "unk", "pad")},
        chat_template=default_tokenizer.chat_template,
        reference=tokenizers.Tokenizer.from_str(json.dumps(spec)),
    )


def write_tiny_gguf(path: Path, model: TinyModel, vocabulary: dict):
    """A random-weight transformers model of ``model``'s config (seed 0, weights spread over a useful range) written
    to ``path`` in ``model``'s types. Returns (path, that model holding exactly what the file holds, the held
    weights by Hugging Face name)."""
    config = transformers.AutoConfig.for_model(vocab_size=len(vocabulary["tokens"]), **model.config)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    spread_weights(reference)
    weights = write_gguf(path, model, reference, vocabulary, np.random.default_rng(0))
    written = {tensor.name: tensor.tensor_type for tensor in gguf.GGUFReader(path).tensors}
    assert {name: qtype for name, qtype in written.items() if qtype != Q.F32} == model.types
    reference.load_state_dict(weights)
    return path, reference, weights


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request, vocabulary, tmp_path_factory):
    """One tiny model's GGUF, its float32 reference (transformers, holding what the file holds), and the LLM
    serving the file, its conversion cached in a temporary directory."""
    model = MODELS[request.param]
    work = tmp_path_factory.mktemp(f"gguf-{request.param}")
    path, reference, weights = write_tiny_gguf(work / f"tiny-{request.param}.gguf", model, vocabulary)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINIVLLM_CACHE", str(work / "cache"))
        llm = LLM(str(path), max_model_len=128, num_kvcache_blocks=24, quantization="none")
    return SimpleNamespace(model=model, path=path, reference=reference, weights=weights, llm=llm,
                           cache=work / "cache",
                           chat_template=model.chat_template or vocabulary["chat_template"])


def test_the_converted_model_holds_the_files_weights(tiny):
    """Converted into the cache as the file's architecture and shape, every tensor exactly the file's, dequantized
    (Llama's Q/K rows back in Hugging Face's order)."""
    engine = tiny.llm.engine
    assert engine.model_path.startswith(str(tiny.cache / "gguf"))
    assert engine.model_config.architecture == type(tiny.reference).__name__
    assert engine.model_config.tie_word_embeddings == tiny.reference.config.tie_word_embeddings
    assert engine.model_config.vocab_size == tiny.reference.config.vocab_size
    converted = load_file(f"{engine.model_path}/model.safetensors")
    expected = dict(tiny.weights)
    if tiny.reference.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert converted.keys() == expected.keys()
    for name, tensor in converted.items():
        assert torch.equal(tensor, expected[name]), name


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["The capital of France is", "def fibonacci(n):\n    return",
             "Once upon a time, in a land far away, there lived a dragon who loved numbers like 12345"]
    return [tokenizer.encode(text) for text in texts]


def test_prompt_logprobs_match_the_reference(tiny):
    """Every prompt token's logprob and each position's top 5, scored in one batch, equal the float32 reference's
    log-softmax."""
    prompts = _prompts(tiny.llm.tokenizer)
    outs = tiny.llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            logits = tiny.reference(torch.tensor([prompt])).logits[0]
        expected = torch.log_softmax(logits.float(), dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            row = expected[pos - 1]
            assert entry.token_id == prompt[pos]
            assert entry.logprob == pytest.approx(row[prompt[pos]].item(), abs=2e-5)
            top = row.topk(5)
            assert entry.top_token_ids == top.indices.tolist()
            assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=2e-5)


def test_greedy_tokens_of_concurrent_prompts_equal_generate(tiny):
    """Three prompts decoded together, greedily, give the tokens transformers' ``generate`` gives each alone."""
    prompts = _prompts(tiny.llm.tokenizer)
    outs = tiny.llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        expected = tiny.reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                           do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_the_tokenizer_and_chat_template_come_from_the_file(tiny, vocabulary, default_tokenizer):
    """The file's vocabulary tokenizes as the tokenizer it was cut from (special tokens whole, text beyond the
    cut in smaller pieces, no BOS added) and decodes back; its special tokens are the tokenizer's, its EOS the
    engine's; chats render with the file's own template."""
    tokenizer, reference = tiny.llm.tokenizer, vocabulary["reference"]
    for text in ["Hello, world!", "<|im_start|>user\nHi there<|im_end|>\n<file_sep>", "  indented\n\tcode();  ",
                 "ünïcödé 日本語 🙂 1234567", ""]:
        assert tokenizer.encode(text) == reference.encode(text).ids, text
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = vocabulary["special_ids"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        ids["bos"], ids["eos"], ids["pad"])
    assert ids["eos"] in tiny.llm.engine.eos_token_ids
    assert tokenizer.chat_template == tiny.chat_template
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == default_tokenizer.apply_chat_template(messages, chat_template=tiny.chat_template,
                                                             tokenize=False, add_generation_prompt=True)
    reply = tiny.llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert reply.prompt_token_ids == reference.encode(rendered).ids
    assert len(reply.outputs[0].token_ids) == 3
