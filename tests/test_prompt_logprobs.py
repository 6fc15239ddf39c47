"""Prompt logprobs (scoring) against a transformers forward pass: computed in the prefill, through
chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.errors import RequestError
from tests.helpers import VOCAB, save_tiny_model
from tests.test_engine import make_prompts


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama-plp"))


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i scores prompt token i + 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def assert_matches(entries, prompt, reference, num_top):
    assert entries[0] is None and len(entries) == len(prompt)
    for pos, entry in enumerate(entries[1:], start=1):
        row = reference[pos - 1]
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(row[prompt[pos]].item(), abs=2e-4)
        value = row[prompt[pos]]  # tokens within 1e-4 of it are near-ties rounding may order either way
        assert int((row > value + 1e-4).sum()) + 1 <= entry.rank <= int((row > value - 1e-4).sum()) + 1
        top = row.topk(num_top)
        assert len(entry.top_token_ids) == num_top
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=2e-4)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_equal_transformers_through_chunks_cache_hits_and_preemption(llama_dir, overlap):
    """Prompts longer than a step's budget (chunked prefill), one whose prefix is cached by an earlier
    request, and a pool small enough to preempt: every prompt token's logprob, rank and top-N equal a
    float32 transformers forward pass, and the generated tokens are unchanged by asking."""
    prompts = make_prompts(VOCAB, lens=[70, 45, 90, 33], seed=3)
    prompts.append(prompts[0][:48] + prompts[1][:20])  # shares three full blocks with prompts[0]
    llm = LLM(str(llama_dir), max_model_len=256, num_kvcache_blocks=24, max_num_batched_tokens=32,
              overlap_steps=overlap, async_scheduling=overlap)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected_tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                     plain, use_tqdm=False)]
    preemptions = llm.engine.scheduler.num_preemptions_total
    scored = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=n) for n in (2, 0, 5, 1, 3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], scored, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > preemptions  # the pool was too small for all five
    for out, prompt, params, tokens in zip(outs, prompts, scored, expected_tokens):
        assert out.outputs[0].token_ids == tokens
        assert_matches(out.prompt_logprobs, prompt, hf_prompt_logprobs(llama_dir, prompt), params.prompt_logprobs)
    # Without prompt logprobs the same prompts hit the prefix cache again.
    assert llm.generate({"prompt_token_ids": prompts[4]}, plain, use_tqdm=False)[0].num_cached_tokens >= 48


def test_prompt_logprobs_of_a_one_token_prompt_and_the_whole_vocabulary(llama_dir):
    """-1 is every token; a limit above the vocabulary lets a request ask for more than there are, and it
    gets them all."""
    llm = LLM(str(llama_dir), max_model_len=128, num_kvcache_blocks=32, max_logprobs=10**6)
    one = llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    prompt = make_prompts(VOCAB, lens=[20], seed=4)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, prompt_logprobs=-1,
                                                                    logprobs=10**6), use_tqdm=False)[0]
    assert_matches(out.prompt_logprobs, prompt, hf_prompt_logprobs(llama_dir, prompt), VOCAB)
    assert [len(e.top_token_ids) for e in out.outputs[0].logprobs] == [VOCAB, VOCAB]


def test_logprob_counts_above_the_limit_are_refused(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=128, num_kvcache_blocks=32)
    for field, value in (("prompt_logprobs", 21), ("prompt_logprobs", -1), ("logprobs", -1)):
        with pytest.raises(RequestError, match="max-logprobs") as info:
            llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(**{field: value}), use_tqdm=False)
        assert info.value.param == field
