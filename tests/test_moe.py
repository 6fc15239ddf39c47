"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers, float32 on the CPU: prefill and
decode logits through the paged path, and the engine's greedy tokens against ``generate``."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from tests.helpers import VOCAB, PagedRunner, save_checkpoint
from tests.test_engine import make_prompts

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)

MOE_CONFIGS = {
    # Layer 1 keeps a dense MLP (mlp_only_layers); the top-2 of 4 experts are renormalised.
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, intermediate_size=96,
                                                     moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
    "qwen3-moe-unnormed": lambda: transformers.Qwen3MoeConfig(**COMMON, head_dim=16, intermediate_size=96,
                                                              moe_intermediate_size=32, num_experts=8,
                                                              num_experts_per_tok=3, norm_topk_prob=False),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4,
                                                  num_experts_per_tok=2, sliding_window=None),
}


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def moe_dir(request, tmp_path_factory):
    return save_checkpoint(MOE_CONFIGS[request.param](), tmp_path_factory.mktemp(request.param))


def prompts(lens, seed=0):
    return make_prompts(VOCAB, lens, seed)


def test_prefill_chunks_and_decodes_match_transformers(moe_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    model = load_model(ModelConfig.from_pretrained(moe_dir), torch.float32, "cpu")
    runner = PagedRunner(model)
    batch = prompts([37, 20, 45])
    first = runner.step([(i, p[:-3]) for i, p in enumerate(batch)])  # prefill all but the last three
    decodes = [runner.step([(i, [p[-3 + k]]) for i, p in enumerate(batch)]) for k in range(3)]
    for i, p in enumerate(batch):
        with torch.no_grad():
            expected = hf(torch.tensor([p])).logits[0].float()
        got = torch.cat([first[i]] + [step[i] for step in decodes])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_greedy_tokens_equal_generate_with_chunks_cache_hits_and_preemption(moe_dir):
    batch = prompts([40, 70, 25, 90, 55, 33, 61, 48], seed=1)
    batch.append(batch[1][:48] + [5, 6, 7])  # three full blocks shared with another prompt
    llm = LLM(str(moe_dir), max_model_len=256, num_kvcache_blocks=24, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0 and llm.engine.kv_manager.prefix_cache_hits > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    for p, out in zip(batch, outs):
        ids = torch.tensor([p])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                               min_new_tokens=10, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == expected
