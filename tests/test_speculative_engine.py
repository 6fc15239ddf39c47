"""Speculative decoding in the engine (n-gram proposals, ``speculative_config``): the default model's greedy tokens
are the same with and without it, through chunked prefill, prefix hits, preemption, stop strings and a JSON schema;
proposals are really verified and accepted; no KV block is left held; bad configs are refused by name."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.config import ConfigError, EngineConfig
from engine.sampling_params import StructuredOutputsParams
from engine.speculative.proposer import PAUSE_STEPS

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
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = _tokens(plain, prompts, params)
    with LLM(max_model_len=256, quantization="none", speculative_config=NGRAM, max_num_batched_tokens=32,
             num_kvcache_blocks=18, kvcache_block_size=16) as tight:
        assert _tokens(tight, prompts, params) == expected
        assert tight.engine.stats().num_preemptions > 0
        assert tight.engine.proposer.num_accepted_tokens > 0
        _assert_blocks_all_free(tight)


def test_stop_strings_max_tokens_and_eos_cut_where_they_would_without(engines):
    """A stop string or max_tokens inside a run of accepted proposals ends the output at the same token."""
    plain, spec = engines
    for params in (SamplingParams(temperature=0.0, max_tokens=40, stop=["date"]),  # EOS too, where it comes first
                   SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)):
        a = plain.generate(PROMPTS, params, use_tqdm=False)
        b = spec.generate(PROMPTS, params, use_tqdm=False)
        assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in a] == \
               [(o.outputs[0].text, o.outputs[0].finish_reason) for o in b]
    assert [len(o.outputs[0].token_ids) for o in b] == [len(o.outputs[0].token_ids) for o in a]


def test_logprobs_penalties_biases_and_limits_take_proposals_and_keep_their_meaning(engines):
    """Requests asking for logprobs (top-3 and named tokens), a repetition, frequency or presence penalty,
    min_tokens, a logit_bias or allowed_token_ids, and one with a grammar, batched: each takes proposals (the
    verification changes each position's logits with the proposals before it taken as accepted), and every output
    is what it is without speculation, logprobs included, one entry per token."""
    plain, spec = engines
    schema = {"type": "object", "properties": {"fruit": {"type": "string"}}, "required": ["fruit"]}
    tokenizer = spec.tokenizer
    banned = tokenizer.encode(" banana")[0]
    copy_ids = sorted(set(tokenizer.encode(PROMPTS[0])))
    params = [SamplingParams(temperature=0.0, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(schema))),
              SamplingParams(temperature=0.0, max_tokens=30, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=30, frequency_penalty=0.8, presence_penalty=0.3),
              SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20, logprobs=1, logprob_token_ids=copy_ids[:4]),
              SamplingParams(temperature=0.0, max_tokens=30, logit_bias={banned: -100.0}, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=30, allowed_token_ids=copy_ids)]
    prompts = [PROMPTS[3], *[PROMPTS[i % 3] for i in range(len(params) - 1)]]
    proposer = spec.engine.proposer
    before = proposer.num_accepted_tokens
    a, b = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    assert proposer.num_accepted_tokens > before + 20
    assert [o.outputs[0].token_ids for o in b] == [o.outputs[0].token_ids for o in a]
    assert "fruit" in json.loads(b[0].outputs[0].text)
    assert len(b[4].outputs[0].token_ids) >= 20 and set(b[6].outputs[0].token_ids) <= set(copy_ids)
    assert banned not in b[5].outputs[0].token_ids
    for i in (1, 4, 5):
        ours, theirs = b[i].outputs[0].logprobs, a[i].outputs[0].logprobs
        assert len(ours) == len(b[i].outputs[0].token_ids) == len(theirs)
        for x, y in zip(ours, theirs):
            assert (x.token_id, x.rank, x.top_token_ids) == (y.token_id, y.rank, y.top_token_ids)
            assert [x.logprob, *x.top_logprobs] == pytest.approx([y.logprob, *y.top_logprobs], abs=1e-4)


def test_each_kind_of_request_takes_proposals_alone(engines):
    """Alone in the batch (no plain request beside it to take proposals for), a request with logprobs, penalties,
    min_tokens, a bias or allowed tokens still has its proposals verified and accepted."""
    _, spec = engines
    proposer = spec.engine.proposer
    for params in (SamplingParams(temperature=0.0, max_tokens=32, logprobs=2),
                   SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=1.1),
                   SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32, logit_bias={0: 1.0})):
        before = proposer.num_accepted_tokens
        spec.generate(PROMPTS[:1], params, use_tqdm=False)
        assert proposer.num_accepted_tokens > before, params


def test_a_grammar_takes_the_proposals_it_allows(engines):
    """JSON schemas whose keys repeat: n-gram proposals cut where the grammar refuses them, verified against each
    position's mask, are accepted, and the output is the same JSON as without speculation."""
    plain, spec = engines
    city = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"]}
    schema = {"type": "array", "items": city, "minItems": 5, "maxItems": 5}
    params = SamplingParams(temperature=0.0, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
    prompts = ["List five cities of France as JSON objects with their city and country.",
               "Give five cities of Italy as JSON: city and country of each."]
    proposer = spec.engine.proposer
    before = proposer.num_accepted_tokens
    a, b = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in b] == [o.outputs[0].token_ids for o in a]
    assert all(len(json.loads(o.outputs[0].text)) == 5 for o in b)
    assert proposer.num_accepted_tokens > before + 20
    _assert_blocks_all_free(spec)


def _run_with_a_late_request(llm: LLM, late: SamplingParams, join_at: int | None) -> tuple[dict, int]:
    """Three requests decoding, a fourth added after ``join_at`` steps (None: after the first step from which the
    others hold proposals), in the engine's own loop. Returns each request's (tokens, logprobs entries) and the
    step it joined after."""
    engine, tokenizer = llm.engine, llm.tokenizer
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"early-{i}", tokenizer.encode(prompt), GREEDY)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, int] = {}
    steps, joined = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs[out.request_id] = logprobs.get(out.request_id, 0) + len(out.new_logprobs)
        steps += 1
        proposing = any(request.spec_token_ids for request in engine.scheduler.running)
        if joined is None and (steps == join_at or (join_at is None and steps >= 2 and proposing)):
            engine.add_request("late", tokenizer.encode(PROMPTS[3]), late)
            joined = steps
    return {rid: (tokens[rid], logprobs[rid]) for rid in tokens}, joined


def test_a_request_joining_a_speculating_batch_gets_what_it_asks(engines):
    """Requests decoding with proposals, then one asking for logprobs arrives: each of its tokens has its logprobs,
    and everyone's tokens are as without speculation."""
    plain, spec = engines
    late = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    got, joined = _run_with_a_late_request(spec, late, None)
    assert joined is not None  # it joined a batch holding proposals
    expected, _ = _run_with_a_late_request(plain, late, joined)
    assert got == expected
    assert got["late"][1] == 12


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "model": "some/head"}, 'method "eagle" is not served yet'),
    ({"method": "eagle3", "model": "some/head", "num_speculative_tokens": 3}, "EAGLE-3 head some/head is not a"),
    ({"model": "some/draft", "num_speculative_tokens": 3}, "not a Hugging Face model directory"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs a "model" directory'),
    ({"method": "draft_model", "model": ".", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
     "prompt_lookup_max not served with method draft_model"),
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


def test_aborts_while_a_verification_step_runs_leave_no_block_held(engines):
    """With overlapped steps the next step is launched before ``step`` returns: requests aborted then are aborted
    in the middle of a verification step of their proposals. Their blocks (proposal slots included) go back to the
    pool, and the requests beside them get the tokens they get without speculation."""
    plain, _ = engines
    expected = _tokens(plain, PROMPTS[:2], GREEDY)
    with LLM(max_model_len=1024, quantization="none", speculative_config=NGRAM, overlap_steps=True) as llm:
        engine, tokenizer = llm.engine, llm.tokenizer
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", tokenizer.encode(prompt), GREEDY)
        tokens: dict[str, list[int]] = {}
        aborted = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            in_flight = engine.pipeline._ahead
            if not aborted and in_flight is not None and in_flight.sched.spec_token_ids.keys() >= {"r2", "r3"}:
                engine.abort_requests(["r2", "r3"])  # both have proposals in the step now running
                aborted = True
        assert aborted
        assert [tokens["r0"], tokens["r1"]] == expected
        _assert_blocks_all_free(llm)


def test_verification_steps_through_the_mixed_step_graph_layout(engines):
    """Verification steps laid out as a mixed-step CUDA graph replays them (``MixedGraphs``, run eagerly on the CPU
    where nothing is captured): tokens padded to a captured count, the LM head on the first rows the graph gathers
    (every verified position), their padding gathering token 0. The tokens are those without speculation."""
    from engine.worker.cuda_graphs import MixedGraphs

    plain, _ = engines
    with LLM(max_model_len=1024, quantization="none", speculative_config=NGRAM) as llm:
        runner, config = llm.engine.runner, llm.engine.config
        runner.mixed_graphs = MixedGraphs(runner.model, runner.buffers, config.graph_token_sizes(),
                                          config.max_num_seqs, runner.block_size, runner.max_model_len)
        shapes = []
        device_inputs = runner.input_preparer.device_inputs

        def recording(shape):
            shapes.append(shape)
            return device_inputs(shape)

        runner.input_preparer.device_inputs = recording
        assert _tokens(llm, PROMPTS, GREEDY) == _tokens(plain, PROMPTS, GREEDY)
        verified = [s for s in shapes if s.mixed_size and s.num_sampled > s.num_reqs]
        assert verified and runner.mixed_graphs.replays == len(shapes)
        assert llm.engine.proposer.num_accepted_tokens > 20
        _assert_blocks_all_free(llm)


def test_async_scheduling_plans_ahead_only_while_no_step_takes_proposals(engines):
    """Async scheduling with speculation: a batch at ``disable_by_batch_size`` decodes without proposals, its steps
    planned ahead of the tokens in flight; once requests finish and the batch falls under it, steps are planned
    when the tokens are known and verify proposals; a lone request is planned ahead only while its proposals are
    paused. The tokens are those without speculation, and every block goes back."""
    plain, _ = engines
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (64, 48, 12, 8)]
    expected = _tokens(plain, PROMPTS, params)
    with LLM(max_model_len=1024, quantization="none", speculative_config={**NGRAM, "disable_by_batch_size": 3},
             overlap_steps=True, async_scheduling=True) as llm:
        engine, proposer = llm.engine, llm.engine.proposer
        assert engine.async_scheduling
        assert _tokens(llm, PROMPTS, params) == expected
        ahead = engine.num_steps_planned_ahead
        assert ahead > 0  # the steps of four and three requests
        assert proposer.num_accepted_tokens > 0  # the steps of two and one verify proposals
        drafts, pauses = proposer.num_drafts, proposer.num_paused
        assert _tokens(llm, PROMPTS[:1], GREEDY) == _tokens(plain, PROMPTS[:1], GREEDY)
        assert proposer.num_drafts > drafts
        # Alone, it is planned ahead only while its proposals are paused for low acceptance.
        assert engine.num_steps_planned_ahead - ahead <= PAUSE_STEPS * (proposer.num_paused - pauses)
        _assert_blocks_all_free(llm)


def test_rejected_proposals_hold_no_block_after_their_step(engines):
    """Eight proposals a step in blocks of eight tokens: a step that rejects some gives back the blocks only they
    reached, so after every step each request holds the blocks of its computed tokens and no more (the KV usage
    counts no rejected slot), and the tokens are those without speculation, blocks reused by other requests."""
    plain, _ = engines
    expected = _tokens(plain, PROMPTS, GREEDY)
    with LLM(max_model_len=256, quantization="none", kvcache_block_size=8, num_kvcache_blocks=40,
             speculative_config={**NGRAM, "num_speculative_tokens": 8}) as llm:
        engine, tokens = llm.engine, {}
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", llm.tokenizer.encode(prompt), GREEDY)
        rejected = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            running = engine.scheduler.running
            held = {r.request_id: len(engine.kv_manager.get_block_ids(r.request_id)) for r in running}
            assert held == {r.request_id: -(-r.num_computed_tokens // 8) for r in running}
            assert engine.kv_manager.get_stats().num_used_blocks == sum(held.values())
            rejected = engine.proposer.num_draft_tokens - engine.proposer.num_accepted_tokens
        assert [tokens[f"r{i}"] for i in range(len(PROMPTS))] == expected
        assert rejected > 8 * len(PROMPTS) and engine.proposer.num_accepted_tokens > 20
        _assert_blocks_all_free(llm)


def test_a_beam_search_joining_takes_the_proposals_back_and_their_slots_too(engines):
    """A beam search arriving while requests decode with proposals: the steps that sample its beams verify none (its
    group chooses their tokens), and the proposals already planned for the others give back their slots after the
    step, so each of those requests holds its computed tokens' blocks and no more. Everyone's tokens are as without
    speculation."""
    plain, _ = engines
    beams = SamplingParams(n=2, use_beam_search=True, max_tokens=10)

    def run(llm: LLM) -> dict[str, list[int]]:
        engine, tokens, joined = llm.engine, {}, False
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(f"r{i}", llm.tokenizer.encode(prompt), GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            running = [r for r in engine.scheduler.running if r.group is None]
            if not joined and (any(r.spec_token_ids for r in running) if llm is spec else len(tokens["r0"]) > 4):
                engine.add_request("beams", llm.tokenizer.encode(PROMPTS[3]), beams)
                joined = True
            block = engine.kv_manager.block_size
            assert all(len(engine.kv_manager.get_block_ids(r.request_id)) == -(-r.num_computed_tokens // block)
                       for r in running)
        return tokens

    # Eight proposals a step in blocks of eight tokens: proposals taken back always held a block of their own.
    with LLM(max_model_len=256, quantization="none", kvcache_block_size=8,
             speculative_config={**NGRAM, "num_speculative_tokens": 8}) as spec:
        assert run(spec) == run(plain)
        _assert_blocks_all_free(spec)


def test_seeded_sampled_requests_get_the_tokens_they_get_without_speculation(engines):
    """Sampled requests with seeds take proposals, and the verification keeps them while they are the samples the
    request draws without speculation (each position's noise comes from its seed and the position alone): their
    tokens are the ones they get without speculation, alone or beside other requests, with proposals accepted."""
    plain, spec = engines
    seeded = [SamplingParams(temperature=t, top_p=0.95, seed=1234 + i, max_tokens=40, ignore_eos=True)
              for i, t in enumerate((0.3, 0.8, 1.0))]
    expected = _tokens(plain, PROMPTS[:3], seeded)
    proposer = spec.engine.proposer
    before = proposer.num_accepted_tokens
    assert [_tokens(spec, [prompt], params)[0] for prompt, params in zip(PROMPTS, seeded)] == expected
    assert proposer.num_accepted_tokens > before
    assert _tokens(spec, PROMPTS, [*seeded, GREEDY])[:3] == expected


def test_seeded_requests_preempted_while_speculating_sample_as_if_they_were_not(engines):
    """Seeded sampled requests in a pool too small for all of them (preemptions, computed again): each position's
    noise comes from the seed and the position, so the tokens are those of a pool where none was preempted."""
    _, spec = engines
    params = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=32, ignore_eos=True) for i in range(4)]
    expected = _tokens(spec, PROMPTS, params)
    with LLM(max_model_len=128, quantization="none", speculative_config=NGRAM, num_kvcache_blocks=10,
             kvcache_block_size=16) as tight:
        assert _tokens(tight, PROMPTS, params) == expected
        assert tight.engine.stats().num_preemptions > 0
        assert tight.engine.proposer.num_accepted_tokens > 0
        _assert_blocks_all_free(tight)
