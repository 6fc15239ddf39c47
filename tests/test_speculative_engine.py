"""Speculative decoding in the engine (n-gram proposals, ``speculative_config``): the default model's greedy tokens
are the same with and without it, through chunked prefill, prefix hits, preemption, stop strings and a JSON schema;
proposals are really verified and accepted; no KV block is left held; bad configs are refused by name."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Prompts whose continuations copy spans of themselves, where n-gram proposals are accepted.
PROMPTS = [
    "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Copy: apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog. The quick brown",
    "What is the capital of France?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(default_model_path):
    # float32 products (quantization="none"): a verification step computes a token among 1 + k others, in another
    # order than a decode step does, and bfloat16's int4 products would turn near-ties either way.
    with LLM(max_model_len=1024, quantization="none") as plain, \
            LLM(max_model_len=1024, quantization="none", speculative_config=NGRAM) as spec:
        yield plain, spec


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def _assert_blocks_all_free(llm: LLM) -> None:
    kv = llm.engine.kv_manager
    kv.check_invariants()
    assert kv.num_requests == 0


def test_greedy_tokens_are_the_same_and_proposals_are_accepted(engines):
    plain, spec = engines
    proposer = spec.engine.proposer
    before = (proposer.num_drafts, proposer.num_accepted_tokens)
    assert _tokens(spec, PROMPTS, GREEDY) == _tokens(plain, PROMPTS, GREEDY)
    assert proposer.num_drafts > before[0]  # steps verified proposals...
    assert proposer.num_accepted_tokens > before[1] + 20  # ...and took many of them: fewer steps than tokens
    _assert_blocks_all_free(spec)


def test_chunked_prefill_prefix_hits_and_preemption_change_nothing(default_model_path, engines):
    """A small token budget (prefills in chunks), the same prompts twice (prefix-cache hits) and a pool too small
    for every request at once (preemptions): still the same tokens, and every block back in the pool."""
    plain, _ = engines
    prompts = PROMPTS * 2
    expected = _tokens(plain, prompts, GREEDY)
    with LLM(max_model_len=256, quantization="none", speculative_config=NGRAM, max_num_batched_tokens=32,
             num_kvcache_blocks=24, kvcache_block_size=16) as tight:
        assert _tokens(tight, prompts, GREEDY) == expected
        assert tight.engine.stats().num_preemptions > 0
        assert tight.engine.proposer.num_accepted_tokens > 0
        _assert_blocks_all_free(tight)


def test_stop_strings_max_tokens_and_eos_cut_where_they_would_without(engines):
    """A stop string or max_tokens inside a run of accepted proposals ends the output at the same token."""
    plain, spec = engines
    for params in (SamplingParams(temperature=0.0, max_tokens=40, stop=["date"]),
                   SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=40)):
        a = plain.generate(PROMPTS, params, use_tqdm=False)
        b = spec.generate(PROMPTS, params, use_tqdm=False)
        assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in a] == \
               [(o.outputs[0].text, o.outputs[0].finish_reason) for o in b]
    assert [len(o.outputs[0].token_ids) for o in b] == [len(o.outputs[0].token_ids) for o in a]


def test_a_json_schema_request_decodes_as_without(engines):
    """Constrained requests take no proposals: their output is the grammar's, as without speculation, beside
    requests that do speculate in the same steps."""
    plain, spec = engines
    schema = {"type": "object", "properties": {"fruit": {"type": "string"}}, "required": ["fruit"]}
    constrained = SamplingParams(temperature=0.0, max_tokens=30,
                                 structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
    params = [constrained, GREEDY, GREEDY, GREEDY]
    a, b = plain.generate(PROMPTS, params, use_tqdm=False), spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert "fruit" in json.loads(b[0].outputs[0].text)


def test_seeded_sampling_repeats_itself(engines):
    """With speculation a seeded request's tokens (drawn through rejection sampling) are the same run to run."""
    _, spec = engines
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=11, ignore_eos=True)
    first = _tokens(spec, PROMPTS, params)
    assert _tokens(spec, PROMPTS[::-1], params)[::-1] == first


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle3", "model": "some/head"}, 'method "eagle3" is not served yet'),
    ({"model": "some/draft", "num_speculative_tokens": 3}, "a draft model is not served yet"),
    ({"method": "lookahead"}, 'unknown method "lookahead"'),
    ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "typical"}, "acceptance_method"),
])
def test_configs_it_cannot_serve_are_refused_by_name(config, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(speculative_config=config)


def test_the_cli_takes_the_config_as_json():
    from server.cli.parser import build_parser

    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(NGRAM)])
    assert args.speculative_config == NGRAM
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "[1, 2]"])
