"""Speculative decoding with a draft model (``speculative_config={"model": ...}``) on tiny random-weight
checkpoints: greedy tokens equal transformers' and the engine's without speculation, whether the draft is the target
itself (every proposal accepted) or another model (most rejected); through chunked prefill, prefix hits and
preemption, with every KV block back in the pool; drafts that cannot serve are refused at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from engine import LLM, SamplingParams
from engine.config import ConfigError
from tests.helpers import SMALL_CONFIG, VOCAB, save_checkpoint, save_tiny_model
from tests.test_engine import greedy, hf_greedy, make_prompts, run


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama target and a smaller random draft of the same vocabulary (one layer, other weights)."""
    target = save_tiny_model("llama", tmp_path_factory.mktemp("target"))
    draft_config = transformers.LlamaConfig(**{**SMALL_CONFIG, "num_hidden_layers": 1, "hidden_size": 32,
                                               "intermediate_size": 64, "num_attention_heads": 2,
                                               "num_key_value_heads": 1})
    draft = save_checkpoint(draft_config, tmp_path_factory.mktemp("draft"))
    return target, draft


def _spec(draft, k: int = 3) -> dict:
    return {"model": str(draft), "num_speculative_tokens": k}


def _assert_blocks_all_free(llm: LLM) -> None:
    llm.engine.kv_manager.check_invariants()
    assert llm.engine.kv_manager.num_requests == 0


def test_a_draft_equal_to_the_target_has_every_proposal_accepted(models):
    """The target as its own draft: greedy tokens as transformers', in fewer steps than tokens (every proposal
    the argmax the verification computes: accepted, bar float32 near-ties)."""
    target, _ = models
    prompts = make_prompts(VOCAB, lens=[12, 30, 7, 21])
    with LLM(str(target), max_model_len=256, num_kvcache_blocks=96, speculative_config=_spec(target, 4)) as llm:
        assert run(llm, prompts, greedy(20)) == hf_greedy(target, prompts, 20)
        proposer = llm.engine.proposer
        assert proposer.num_draft_tokens > 0
        assert proposer.num_accepted_tokens >= 0.95 * proposer.num_draft_tokens
        assert llm.engine.runner.drafter.num_passes > 0
        _assert_blocks_all_free(llm)


def run_async_across_the_batch_limit(target: Path, spec: dict, check_left=None) -> None:
    """Four requests of different lengths through an engine with async scheduling and ``spec`` (its proposals the
    target's own argmax) at ``disable_by_batch_size`` 3: transformers' greedy tokens, steps planned ahead while the
    batch is at the limit, and the proposals made once it is under it accepted; then ``check_left(llm)`` (default:
    every KV block back in the pool)."""
    prompts = make_prompts(VOCAB, lens=[12, 30, 7, 21])
    lengths = [24, 20, 8, 6]
    expected = [tokens[:n] for tokens, n in zip(hf_greedy(target, prompts, max(lengths)), lengths)]
    with LLM(str(target), max_model_len=256, num_kvcache_blocks=96, overlap_steps=True, async_scheduling=True,
             speculative_config={**spec, "disable_by_batch_size": 3}) as llm:
        assert run(llm, prompts, [greedy(n) for n in lengths]) == expected
        proposer = llm.engine.proposer
        assert llm.engine.num_steps_planned_ahead > 0
        assert proposer.num_draft_tokens > 0
        assert proposer.num_accepted_tokens >= 0.95 * proposer.num_draft_tokens
        (check_left or _assert_blocks_all_free)(llm)


def test_async_scheduling_around_the_drafts_proposals(models):
    """Async scheduling with a draft model: while the batch is at ``disable_by_batch_size`` its steps are planned
    ahead of the tokens in flight (the draft catches up on them later); once requests end, the draft proposes
    again, and its proposals (the target's own argmax) are accepted. The tokens are transformers'."""
    target, _ = models
    run_async_across_the_batch_limit(target, _spec(target, 4))


def test_another_draft_changes_no_token_through_chunks_prefix_hits_and_preemption(models):
    """A different, smaller draft (its proposals mostly rejected): the tokens are the target's greedy tokens, with
    a small token budget (prefills in chunks), the prompts twice (prefix-cache hits: the draft computes the blocks
    the target found) and a pool too small for every request at once (preemptions: the draft starts over). Its
    requests, seeing their proposals rejected, pause them."""
    target, draft = models
    prompts = make_prompts(VOCAB, lens=[40, 70, 25, 55])
    expected = hf_greedy(target, prompts, 16)
    with LLM(str(target), max_model_len=128, max_num_batched_tokens=32, num_kvcache_blocks=10,
             speculative_config=_spec(draft)) as llm:
        assert run(llm, prompts, greedy(16)) == expected
        assert llm.engine.stats().num_preemptions > 0
        hits = llm.engine.kv_manager.prefix_cache_hits
        assert run(llm, prompts, greedy(16)) == expected
        assert llm.engine.kv_manager.prefix_cache_hits > hits
        assert llm.engine.proposer.num_drafts > 0
        assert llm.engine.proposer.num_paused > 0  # its requests stopped drafting for a while
        _assert_blocks_all_free(llm)


def test_sampled_requests_and_stop_conditions_with_a_draft(models):
    """Seeded sampled requests are reproducible with a draft; max_tokens inside a run of accepted proposals ends
    the output where it would end without speculation; requests with logprobs and a penalty take the draft's
    proposals and get what they get without it."""
    target, _ = models
    prompts = make_prompts(VOCAB, lens=[9, 17])
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    with LLM(str(target), max_model_len=256, num_kvcache_blocks=64, speculative_config=_spec(target, 4)) as llm:
        first, again = run(llm, prompts, sampled), run(llm, prompts, sampled)
        assert first == again and all(len(t) == 12 for t in first)
        assert run(llm, prompts, greedy(5)) == hf_greedy(target, prompts, 5)
        # Logprobs and a penalty with a draft: proposals accepted, an entry per token, as without speculation.
        asked = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, presence_penalty=0.5)
        before = llm.engine.proposer.num_accepted_tokens
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], asked, use_tqdm=False)
        assert llm.engine.proposer.num_accepted_tokens > before
        _assert_blocks_all_free(llm)
    with LLM(str(target), max_model_len=256, num_kvcache_blocks=64) as plain:
        expected = plain.generate([{"prompt_token_ids": p} for p in prompts], asked, use_tqdm=False)
    for ours, theirs in zip(outs, expected):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert [lp.logprob for lp in ours.outputs[0].logprobs] == \
            pytest.approx([lp.logprob for lp in theirs.outputs[0].logprobs], abs=1e-4)


def test_drafts_that_cannot_serve_are_refused(models, tmp_path):
    target, _ = models
    other_vocab = save_checkpoint(transformers.LlamaConfig(**{**SMALL_CONFIG, "vocab_size": VOCAB + 64}),
                                  tmp_path / "other-vocab")
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(str(target), max_model_len=256, num_kvcache_blocks=64, speculative_config=_spec(other_vocab))
    with pytest.raises(ConfigError, match="draft_tensor_parallel_size"):
        LLM(str(target), max_model_len=256, speculative_config={**_spec(target), "draft_tensor_parallel_size": 2})
    # (a draft of one rank beside a sharded target is served: tests/test_tensor_parallel.py)


def test_a_constrained_request_beside_drafted_ones(default_model_path):
    """The default model as its own draft: a request with a JSON schema takes no proposals (the draft's are made
    on the device, where no grammar checks them) but is verified, masked, in the same steps as requests whose
    proposals are drafted; every output is the one it gets without speculation."""
    import json

    from engine.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    prompts = ["Name the capital of France as JSON.", "Count from one to twenty: one, two, three,"]
    params = [SamplingParams(temperature=0.0, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(schema))),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    with LLM(max_model_len=256, quantization="none") as plain:
        expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = {"model": str(default_model_path), "num_speculative_tokens": 3}
    with LLM(max_model_len=256, quantization="none", speculative_config=spec) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert "city" in json.loads(outs[0].outputs[0].text)
        assert llm.engine.proposer.num_accepted_tokens > 0
        _assert_blocks_all_free(llm)
