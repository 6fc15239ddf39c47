"""Sliding-window attention (Mistral's on every layer, Qwen2's past max_window_layers, Gemma 2's and Gemma 3's
alternating local and global layers) against transformers: windows shorter than the prompts, through prefill,
chunked prefill, decode and the engine's scheduling. The Gemma configs also carry Gemma's own numerics: soft-capped
scores and logits small enough to bite (Gemma 2), q/k norms and a RoPE base of their own for the local layers
with linear scaling on the global ones (Gemma 3)."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from tests.helpers import SMALL_CONFIG, VOCAB, PagedRunner, save_checkpoint
from tests.test_engine import make_prompts

WINDOW_CONFIGS = {
    "mistral-window-16": lambda: transformers.MistralConfig(**SMALL_CONFIG, sliding_window=16),
    "qwen2-window-past-layer-0": lambda: transformers.Qwen2Config(**SMALL_CONFIG, use_sliding_window=True,
                                                                  sliding_window=24, max_window_layers=1,
                                                                  tie_word_embeddings=False),
    "gemma2-window-16-capped": lambda: transformers.Gemma2Config(
        **SMALL_CONFIG, head_dim=16, sliding_window=16, query_pre_attn_scalar=24, attn_logit_softcapping=8.0,
        final_logit_softcapping=5.0),
    "gemma3-local-and-global-rope": lambda: transformers.Gemma3TextConfig(
        **SMALL_CONFIG, head_dim=16, sliding_window=20, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}),
}


@pytest.fixture(scope="module", params=sorted(WINDOW_CONFIGS))
def window_dir(request, tmp_path_factory):
    return save_checkpoint(WINDOW_CONFIGS[request.param](), tmp_path_factory.mktemp(request.param))


def prompts(lens, seed=0):
    return make_prompts(VOCAB, lens, seed)


def test_windowed_logits_match_transformers(window_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(window_dir, dtype=torch.float32).eval()
    config = ModelConfig.from_pretrained(window_dir)
    assert any(config.layer_windows)
    model = load_model(config, torch.float32, "cpu")
    runner = PagedRunner(model)
    batch = prompts([60, 37, 45])
    first = runner.step([(i, p[:20]) for i, p in enumerate(batch)])  # chunks: 20, then the rest but 3
    second = runner.step([(i, p[20:-3]) for i, p in enumerate(batch)])
    decodes = [runner.step([(i, [p[-3 + k]]) for i, p in enumerate(batch)]) for k in range(3)]
    for i, p in enumerate(batch):
        with torch.no_grad():
            expected = hf(torch.tensor([p])).logits[0].float()
        got = torch.cat([first[i], second[i]] + [step[i] for step in decodes])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_windowed_greedy_tokens_equal_generate(window_dir):
    """Prompts longer than the window, chunked prefill, a prompt sharing full blocks, a pool that preempts."""
    batch = prompts([40, 70, 25, 90, 55, 33], seed=1)
    batch.append(batch[1][:48] + [5, 6, 7])
    llm = LLM(str(window_dir), max_model_len=256, num_kvcache_blocks=20, max_num_batched_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0 and llm.engine.kv_manager.prefix_cache_hits > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(window_dir, dtype=torch.float32).eval()
    for p, out in zip(batch, outs):
        ids = torch.tensor([p])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                               min_new_tokens=24, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == expected


def test_gemma_configs_are_read_as_gemma(tmp_path):
    """Gemma 2's caps and query scale, Gemma 3's per-layer-type RoPE, and the logit cap on what the engine returns."""
    gemma2 = ModelConfig.from_pretrained(save_checkpoint(WINDOW_CONFIGS["gemma2-window-16-capped"](), tmp_path / "g2"))
    assert gemma2.gemma.attn_logit_softcapping == 8.0 and gemma2.gemma.final_logit_softcapping == 5.0
    assert gemma2.gemma.query_pre_attn_scalar == 24 and gemma2.layer_windows == (16, 0)
    gemma3 = ModelConfig.from_pretrained(save_checkpoint(WINDOW_CONFIGS["gemma3-local-and-global-rope"](),
                                                         tmp_path / "g3"))
    assert gemma3.rope_theta == 1e6 and gemma3.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert gemma3.gemma.local_rope == (10000.0, None) and gemma3.qk_norm and gemma3.layer_windows == (20, 0)
    model = load_model(gemma2, torch.float32, "cpu")
    logits = PagedRunner(model).step([(0, prompts([30])[0])])[0]
    assert logits.abs().max() <= 5.0 and logits.abs().max() > 4.0  # capped, and the cap is reached


def test_the_start_up_log_says_what_one_block_table_costs(tmp_path, caplog):
    """Windowed layers keep every token's KV (one block table for all layers): the log says how much of a
    full-length request's KV lies outside every window, here Gemma 2's one windowed layer in two, 16 of 256
    tokens: (256 - 16) / (2 * 256) = 47%."""
    from engine.worker.kv_report import kv_outside_windows

    assert kv_outside_windows((1024,) * 5 + (0,), 32768) == pytest.approx(5 / 6 * (1 - 1024 / 32768))  # Gemma 3
    assert kv_outside_windows((0, 0), 4096) == 0 and kv_outside_windows((8192,), 4096) == 0
    path = save_checkpoint(WINDOW_CONFIGS["gemma2-window-16-capped"](), tmp_path / "g2")
    with caplog.at_level("INFO", logger="minivllm"):
        LLM(str(path), max_model_len=256, num_kvcache_blocks=20).engine.close()
    assert "sliding windows on 1 of 2 layers (16 tokens)" in caplog.text
    assert "at 256 tokens 47% of the KV a request holds is never read (older than its layer's window)" in caplog.text


# Gemma's template writes <bos> itself, as Gemma's tokenizer also does for plain text.
GEMMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_a_template_that_writes_bos_gives_one_bos(tmp_path, default_model_path):
    """With a tokenizer that adds BOS to text and a chat template that writes it too (Gemma's pair), a chat
    prompt starts with exactly one BOS, the template's, offline and through the server's renderer; a plain
    completion prompt gets the tokenizer's."""
    from tokenizers.processors import TemplateProcessing

    from server.protocol import ChatMessageParam
    from server.tokenization import render_chat

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path)
    tokenizer.bos_token = "<|endoftext|>"
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B", special_tokens=[("<|endoftext|>", bos)])
    tokenizer.chat_template = GEMMA_STYLE_TEMPLATE
    config = transformers.Gemma2Config(**{**SMALL_CONFIG, "vocab_size": len(tokenizer)}, head_dim=16,
                                       sliding_window=16)
    path = save_checkpoint(config, tmp_path / "gemma")
    tokenizer.save_pretrained(path)
    llm = LLM(str(path), max_model_len=128, num_kvcache_blocks=16)
    assert llm.tokenizer("Hi")["input_ids"][0] == bos, "the tokenizer should add BOS to text"
    messages = [{"role": "user", "content": "Hi"}]
    reply = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert reply.prompt_token_ids[0] == bos and reply.prompt_token_ids.count(bos) == 1
    rendered = render_chat(llm.tokenizer, [ChatMessageParam(**m) for m in messages])
    assert rendered.prompt_token_ids == reply.prompt_token_ids
    completion = llm.generate(["Hi"], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert completion.prompt_token_ids[0] == bos and completion.prompt_token_ids.count(bos) == 1
    llm.engine.close()
