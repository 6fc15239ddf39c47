"""The whole engine against Hugging Face transformers: greedy tokens, scheduling, sampling."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.errors import RequestError
from engine.worker.cuda_graphs import MixedGraphs
from tests.helpers import VOCAB, save_tiny_model

PROMPT_LENS = [3, 17, 31, 40, 9, 64, 23, 50]  # 8 concurrent prompts of different lengths


def make_prompts(vocab: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def hf_greedy(model_dir, prompts, max_new_tokens: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs


def run(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_model(request, tmp_path_factory):
    return save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def test_greedy_batch_matches_hf_generate(tiny_model):
    """8 concurrent prompts of different lengths, batched by the engine, equal HF's one-by-one greedy tokens."""
    vocab = transformers.AutoConfig.from_pretrained(tiny_model).vocab_size
    prompts = make_prompts(vocab)
    llm = LLM(str(tiny_model), max_model_len=256, num_kvcache_blocks=128)
    assert run(llm, prompts, greedy(12)) == hf_greedy(tiny_model, prompts, 12)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama-sched"))


def test_outputs_identical_across_chunk_sizes_and_under_preemption(llama_dir):
    prompts = make_prompts(VOCAB, lens=[40, 70, 25, 90, 55, 33, 61, 48])
    expected = hf_greedy(llama_dir, prompts, 24)
    for chunk in (16, 64, 100_000):
        llm = LLM(str(llama_dir), max_model_len=256, max_num_batched_tokens=chunk, num_kvcache_blocks=128)
        assert run(llm, prompts, greedy(24)) == expected, f"chunk size {chunk}"
        assert llm.engine.stats().num_preemptions == 0
    # 20 usable blocks (320 tokens) cannot hold 8 requests of up to 114 tokens: preemption must happen.
    small = LLM(str(llama_dir), max_model_len=256, max_num_batched_tokens=64, num_kvcache_blocks=21)
    assert run(small, prompts, greedy(24)) == expected
    assert small.engine.stats().num_preemptions > 0
    stats = small.engine.stats().kv
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_prefix_caching_on_and_off_give_the_same_tokens(llama_dir):
    shared = make_prompts(VOCAB, lens=[48], seed=3)[0]
    prompts = [shared + tail for tail in make_prompts(VOCAB, lens=[5, 12, 20, 7], seed=4)]
    outs = {}
    for caching in (True, False):
        llm = LLM(str(llama_dir), max_model_len=256, num_kvcache_blocks=128, enable_prefix_caching=caching)
        first = run(llm, prompts[:1], greedy(10))  # warms the cache with the shared prefix
        outs[caching] = first + run(llm, prompts[1:], greedy(10))
        hits = llm.engine.stats().kv.prefix_cache_hits
        assert (hits >= 3 * 48) if caching else (hits == 0), f"caching={caching}: {hits} hit tokens"
    assert outs[True] == outs[False]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=256, num_kvcache_blocks=128)
    prompt = make_prompts(VOCAB, lens=[20], seed=5)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = run(llm, [prompt], seeded)[0]
    others = make_prompts(VOCAB, lens=[30, 8, 45], seed=6)
    mixed = run(llm, [prompt] + others, [seeded] + [SamplingParams(temperature=1.0, max_tokens=20)] * 3)[0]
    assert mixed == alone
    other_seed = run(llm, [prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))[0]
    assert other_seed != alone


def test_seeded_sampling_survives_preemption(llama_dir):
    prompts = make_prompts(VOCAB, lens=[60, 70, 50, 80], seed=7)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True) for i in range(4)]
    roomy = LLM(str(llama_dir), max_model_len=160, num_kvcache_blocks=128)
    tight = LLM(str(llama_dir), max_model_len=160, num_kvcache_blocks=14)
    assert run(tight, prompts, params) == run(roomy, prompts, params)
    assert tight.engine.stats().num_preemptions > 0


def test_model_without_tokenizer_serves_token_ids_and_rejects_text(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=64, num_kvcache_blocks=16)
    assert llm.tokenizer is None
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate(["hello"], greedy(4), use_tqdm=False)
    with pytest.raises(RequestError, match="out of range"):
        llm.generate([{"prompt_token_ids": [1, 10**6]}], greedy(4), use_tqdm=False)
    with pytest.raises(RequestError, match="maximum context length is 64"):
        llm.generate([{"prompt_token_ids": [1] * 64}], greedy(4), use_tqdm=False)


@pytest.fixture(scope="module")
def default_llm(default_model_path):
    """The default model dequantized to float32 (``quantization="none"``), so that transformers' float32 model of
    the same directory is its exact reference; served from its GGUF blocks by default (tests/test_gguf_quantized.py,
    and the servers of tests/server_helpers.py)."""
    return LLM(str(default_model_path), max_model_len=2048, cpu_kvcache_space_gib=0.25, quantization="none")


def test_default_model_tokenizer_is_the_published_one(default_model_path, tmp_path):
    """No BOS prepended, <|im_end|> ends a turn, whichever transformers version did the conversion;
    a cache written by an older conversion is not taken as current."""
    import json

    from engine.loading.default_model import _MARKER, _is_current

    tok = transformers.AutoTokenizer.from_pretrained(default_model_path)
    assert tok.encode("") == []
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == text.count("<|im_start|>")
    assert _is_current(default_model_path)
    (tmp_path / _MARKER).write_text(json.dumps({"source": "x"}))  # written before the format existed
    assert not _is_current(tmp_path) and not _is_current(tmp_path / "missing")


def test_default_model_answers_paris_like_hf(default_llm, default_model_path):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    replies = default_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    assert len(replies) == 1  # a list, as vLLM's LLM.chat returns
    out = replies[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
    tok = default_llm.get_tokenizer()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = list(ids["input_ids"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20)[0, len(ids):].tolist()
    assert out.token_ids == ref  # both stop at <|im_end|>


def test_chat_takes_a_list_of_conversations(default_llm):
    """``LLM.chat`` on several conversations, as vLLM's: one output each, in order, each what it gets alone; each
    with its own sampling params where a list is given. An empty or malformed conversation is a RequestError."""
    france = [{"role": "user", "content": "What is the capital of France?"}]
    greeting = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Say hello."}]
    alone = [default_llm.chat(c, greedy(8), use_tqdm=False)[0].outputs[0].token_ids for c in (france, greeting)]
    both = default_llm.chat([france, greeting], greedy(8), use_tqdm=False)
    assert [r.outputs[0].token_ids for r in both] == alone
    assert both[0].prompt_token_ids != both[1].prompt_token_ids
    short = default_llm.chat([france, greeting], [greedy(2), greedy(5)], use_tqdm=False)
    assert [r.outputs[0].token_ids for r in short] == [alone[0][:2], alone[1][:5]]
    for bad in ([], [[]], [france, "hello"]):
        with pytest.raises(RequestError):
            default_llm.chat(bad, greedy(2), use_tqdm=False)


def test_default_model_text_prompts_and_stop_strings(default_llm):
    prompt = "The capital of France is"
    full = default_llm.generate([prompt], greedy(12), use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.text) > 0
    # Stopping on a word the greedy text contains cuts the text just before it.
    word = full.text.split()[1]
    cut = default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop=[word]),
                               use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == full.text[: full.text.index(word)]


def test_min_tokens_masks_eos_and_stop_tokens(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=128, num_kvcache_blocks=32)
    prompt = make_prompts(VOCAB, lens=[12], seed=9)[0]
    first = run(llm, [prompt], greedy(1))[0][0]  # the token greedy decoding picks first
    stopped = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first]))[0]
    assert stopped == [first]
    held = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=6, min_tokens=3, stop_token_ids=[first]))[0]
    assert len(held) >= 3 and first not in held[:3]


def check_aborts_while_a_step_is_in_flight(llm: LLM, prompts, expected) -> None:
    """Abort requests 1 and 2 after a few steps, while the next step is already queued: the others
    still get exactly their expected tokens, and every block comes back."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"x{i}", p, greedy(len(expected[i])))
    got = {f"x{i}": [] for i in range(len(prompts))}
    for _ in range(3):
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    eng.abort_requests(["x1", "x2"])
    while eng.has_unfinished_requests():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    eng.step()  # the step queued after the last request finished; its tokens are dropped
    assert got["x0"] == expected[0] and got["x3"] == expected[3]
    assert eng.stats().kv.num_used_blocks == 0
    eng.kv_manager.check_invariants()


def test_decode_rows_reach_the_model_longest_context_first(llama_dir):
    """Each step lays out its decode rows longest context first, then the prefill rows (the decode kernels start
    their programs in row order); the tokens stay HF's."""
    prompts = make_prompts(VOCAB, lens=[40, 70, 25, 90, 55, 33, 61, 48])
    llm = LLM(str(llama_dir), max_model_len=256, max_num_batched_tokens=64, num_kvcache_blocks=128)
    runner = llm.engine.runner
    steps = []
    device_inputs = runner.input_preparer.device_inputs

    def recording(shape):
        lens = runner.buffers.seq_lens.np[: shape.num_reqs].tolist()
        steps.append((lens[: shape.num_decodes], lens[shape.num_decodes :]))
        return device_inputs(shape)

    runner.input_preparer.device_inputs = recording
    assert run(llm, prompts, greedy(16)) == hf_greedy(llama_dir, prompts, 16)
    assert all(decodes == sorted(decodes, reverse=True) for decodes, _ in steps)
    # Steps where the order had something to do: mixed lengths, and decodes next to a prefill chunk.
    assert any(len(set(decodes)) > 2 for decodes, _ in steps)
    assert any(decodes and prefills for decodes, prefills in steps)


@pytest.mark.parametrize("limit, budget", [(2048, 16384), (2048, 700), (300, 8192), (8, 8192), (0, 8192)])
def test_mixed_step_graph_sizes_pad_a_step_by_little(limit, budget):
    """Every step of up to min(cuda_graph_max_tokens, max_num_batched_tokens) tokens has a graph size, padded by at
    most 15 tokens up to 128, 31 up to 256 and 63 past it; none past that bound; 0 turns them off."""
    from engine.config import EngineConfig

    sizes = EngineConfig(cuda_graph_max_tokens=limit, max_num_batched_tokens=budget).graph_token_sizes()
    top = min(limit, budget)
    assert sizes == sorted(set(sizes)) and (sizes[-1] == top if top else sizes == [])
    for tokens in range(1, top + 1):
        padded = next(s for s in sizes if s >= tokens)
        assert padded - tokens <= (15 if tokens <= 128 else 31 if tokens <= 256 else 63), tokens


@pytest.mark.parametrize("planned_ahead", [False, True])
def test_steps_laid_out_as_a_mixed_step_graph_give_hf_tokens(llama_dir, planned_ahead):
    """Every step through the layout a mixed-step CUDA graph replays (``MixedGraphs``, run eagerly where nothing is
    captured): tokens padded to the next captured count, requests padded with empty ones, the decodes known only
    on the device, logits of the sampled rows first. With chunked prefill, preemption and, planned ahead, tokens
    fed from the step in flight: HF's tokens."""
    prompts = make_prompts(VOCAB, lens=[40, 70, 25, 90, 55, 33, 61, 48])
    llm = LLM(str(llama_dir), max_model_len=256, max_num_batched_tokens=64, num_kvcache_blocks=21,
              overlap_steps=planned_ahead, async_scheduling=planned_ahead)
    runner, config = llm.engine.runner, llm.engine.config
    runner.mixed_graphs = MixedGraphs(runner.model, runner.buffers, config.graph_token_sizes(), config.max_num_seqs,
                                      runner.block_size, runner.max_model_len)
    shapes = []
    device_inputs = runner.input_preparer.device_inputs

    def recording(shape):
        shapes.append((shape, int(runner.buffers.query_start_loc.np[shape.num_reqs])))
        return device_inputs(shape)

    runner.input_preparer.device_inputs = recording
    assert run(llm, prompts, greedy(24)) == hf_greedy(llama_dir, prompts, 24)
    assert llm.engine.stats().num_preemptions > 0
    assert runner.mixed_graphs.replays == len(shapes) and all(s.mixed_size for s, _ in shapes)
    assert any(s.padded_tokens > tokens for s, tokens in shapes), "padding tokens"
    shapes = [s for s, _ in shapes]
    assert any(0 < s.num_decodes < s.num_reqs for s in shapes), "decodes next to prefill chunks"
    assert any(s.padded > s.num_reqs for s in shapes), "padding requests"


def test_the_profiling_pass_keeps_positions_inside_the_rope_table(llama_dir):
    """The start-up passes (memory profile, warm-up step sizes) run the largest step as prompts of at most
    max_model_len tokens: the tiny model's rope table has 256 rows, fewer than the 512-token requests the pass
    otherwise uses, and on a GPU the Triton rope would read garbage past the table, whose K/V would land in the
    null block. Here the torch rope indexes the table, which raises where a position is out of range; after the
    pass the null block is finite and tokens still equal HF's."""
    llm = LLM(str(llama_dir), max_model_len=256, max_num_batched_tokens=1024, num_kvcache_blocks=64)
    runner = llm.engine.runner
    runner.profile_run()
    assert torch.isfinite(runner.kv_cache.kv[:, :, 0]).all(), "the null block holds finite K/V"
    prompts = make_prompts(VOCAB, lens=[40, 70, 25])
    assert run(llm, prompts, greedy(8)) == hf_greedy(llama_dir, prompts, 8)


def test_overlapped_steps_give_the_same_tokens_under_preemption_and_aborts(llama_dir):
    """Queueing the next step before returning outputs (the CUDA default) changes no token."""
    prompts = make_prompts(VOCAB, lens=[40, 70, 25, 90, 55, 33, 61, 48])
    expected = hf_greedy(llama_dir, prompts, 24)
    llm = LLM(str(llama_dir), max_model_len=256, max_num_batched_tokens=64, num_kvcache_blocks=21,
              overlap_steps=True)
    assert llm.engine.overlap_steps
    assert run(llm, prompts, greedy(24)) == expected
    assert llm.engine.stats().num_preemptions > 0
    check_aborts_while_a_step_is_in_flight(llm, prompts[:4], expected[:4])


@pytest.mark.parametrize("chunk,blocks", [(100_000, 128), (64, 21)])
def test_steps_planned_ahead_give_the_same_tokens(llama_dir, chunk, blocks):
    """async_scheduling plans step N+1 before N's tokens are known; greedy tokens must not change,
    with preemption (21 blocks), chunked prefill, stop tokens, seeds and aborts in the mix."""
    prompts = make_prompts(VOCAB, lens=[40, 70, 25, 90, 55, 33, 61, 48])
    expected = hf_greedy(llama_dir, prompts, 24)
    llm = LLM(str(llama_dir), max_model_len=256, max_num_batched_tokens=chunk, num_kvcache_blocks=blocks,
              overlap_steps=True, async_scheduling=True)
    assert run(llm, prompts, greedy(24)) == expected
    assert llm.engine.num_steps_planned_ahead > 0
    if blocks == 21:
        assert llm.engine.stats().num_preemptions > 0
    # A stop token ends a request while the step after it is already planned: nothing leaks.
    stop_at = expected[1][5]
    stopped = run(llm, [prompts[1]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at]))[0]
    assert stopped == expected[1][: expected[1].index(stop_at) + 1]
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True) for i in range(4)]
    reference = LLM(str(llama_dir), max_model_len=256, num_kvcache_blocks=128)
    assert run(llm, prompts[:4], seeded) == run(reference, prompts[:4], seeded)
    check_aborts_while_a_step_is_in_flight(llm, prompts[:4], expected[:4])


def test_logprobs_of_steps_planned_ahead_match_step_by_step(llama_dir):
    """With async scheduling, logprobs are gathered when a step is launched and read when it finishes:
    the same entries as running one step at a time, for every token."""
    prompts = make_prompts(VOCAB, lens=[30, 12, 45, 20])
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=n) for n in (0, 3, 1, 5)]

    def logprobs(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].logprobs for o in outs]

    ahead = LLM(str(llama_dir), max_model_len=256, num_kvcache_blocks=64, overlap_steps=True, async_scheduling=True)
    step_by_step = LLM(str(llama_dir), max_model_len=256, num_kvcache_blocks=64)
    got, expected = logprobs(ahead), logprobs(step_by_step)
    assert ahead.engine.num_steps_planned_ahead > 0
    assert [len(x) for x in got] == [10] * 4 and [len(x[0].top_token_ids) for x in got] == [0, 3, 1, 5]
    assert got == expected


def test_garbage_collections_skip_the_kv_blocks_until_close(llama_dir):
    """A full collection walks every tracked object, and the pool has one per KV block: a running engine keeps
    them (and the rest of start-up) frozen out of the collector's walks, and close() lets them go again."""
    import gc

    from kvcache.block_pool import KVCacheBlock

    llm = LLM(str(llama_dir), max_model_len=256, num_kvcache_blocks=300)
    try:
        assert gc.get_freeze_count() > 0
        walked = sum(type(o) is KVCacheBlock for o in gc.get_objects())
        assert walked == 0, f"{walked} KV block objects are still walked by every full collection"
        assert run(llm, make_prompts(VOCAB, [5, 9]), greedy(4))
    finally:
        llm.engine.close()
    assert gc.get_freeze_count() == 0
    assert sum(type(o) is KVCacheBlock for o in gc.get_objects()) >= 300


def _step_kind(n: int) -> str:
    """How Triton specializes an integer argument."""
    return "one" if n == 1 else "multiple of 16" if n % 16 == 0 else "other"


def _warmed_alike(counts: list[int], n: int, threshold: int) -> bool:
    return any(_step_kind(c) == _step_kind(n) and (c >= threshold) == (n >= threshold) for c in counts)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 70_000), data=st.data())
def test_warm_up_token_counts_meet_every_kind_of_step(limit, data):
    """Start-up's step sizes include, for any step size and any switch by token count, one on the same side of
    the switch that Triton compiles alike: no step can bring a kernel variant start-up did not compile."""
    from engine.worker.dummy_steps import warm_up_token_counts

    counts = warm_up_token_counts(limit)
    assert counts == sorted(set(counts)) and 1 <= counts[0] and counts[-1] == limit
    assert len(counts) <= 2 * limit.bit_length() + 3  # start-up runs the model once per count
    n = data.draw(st.integers(1, limit), label="step tokens")
    threshold = data.draw(st.integers(1, limit + 1), label="switch")
    assert _warmed_alike(counts, n, threshold)


@pytest.mark.parametrize("limit", [200, 300])  # budgets past a power of two: switches between it and them
def test_warm_up_token_counts_every_step_and_switch(limit):
    from engine.worker.dummy_steps import warm_up_token_counts

    counts = warm_up_token_counts(limit)
    missed = [(n, t) for n in range(1, limit + 1) for t in range(1, limit + 2) if not _warmed_alike(counts, n, t)]
    assert missed == []


_CUSTOM_CONFIG = '''from transformers import LlamaConfig


class CustomLlamaConfig(LlamaConfig):
    model_type = "custom_llama"
'''
_CUSTOM_TOKENIZER = '''from transformers import PreTrainedTokenizerFast


class CustomTokenizer(PreTrainedTokenizerFast):
    pass
'''


@pytest.mark.parametrize("own_code", ["config", "tokenizer"])
def test_a_model_directory_with_its_own_code_loads_only_when_trusted(own_code, llama_dir, default_model_path, tmp_path):
    """A directory whose config or tokenizer class is its own Python code (transformers' ``auto_map``): without
    ``trust_remote_code`` a ConfigError naming the option (the server exits at once, asking nothing on the terminal);
    with it, that code is loaded and the model generates what the same weights do under a plain config."""
    import json
    import shutil
    import subprocess
    import sys

    from engine.config import ConfigError

    custom = tmp_path / "custom"
    shutil.copytree(llama_dir, custom)
    shutil.copy(default_model_path / "tokenizer.json", custom / "tokenizer.json")
    tokenizer_config = {"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if own_code == "config":
        (custom / "configuration_custom.py").write_text(_CUSTOM_CONFIG)
        config = json.loads((custom / "config.json").read_text())
        config.update(model_type="custom_llama", auto_map={"AutoConfig": "configuration_custom.CustomLlamaConfig"})
        (custom / "config.json").write_text(json.dumps(config))
    else:
        (custom / "tokenization_custom.py").write_text(_CUSTOM_TOKENIZER)
        tokenizer_config.update(tokenizer_class="CustomTokenizer",
                                auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]})
    (custom / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(ConfigError, match=f"ships its own Python code for its {own_code}, which runs only with "
                                          r"trust_remote_code=True \(`--trust-remote-code`\)"):
        LLM(str(custom), max_model_len=128, num_kvcache_blocks=16)
    served = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(custom), "--port", "0"],
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert served.returncode != 0 and "--trust-remote-code" in served.stderr
    assert "[y/N]" not in served.stdout + served.stderr
    trusted = LLM(str(custom), max_model_len=128, num_kvcache_blocks=16, trust_remote_code=True)
    if own_code == "config":  # transformers imported the directory's module to build the config
        assert any(name.endswith(".configuration_custom") for name in sys.modules)
    else:
        assert type(trusted.get_tokenizer()).__name__ == "CustomTokenizer"
    prompts = make_prompts(VOCAB, lens=[9, 17], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = LLM(str(llama_dir), max_model_len=128, num_kvcache_blocks=16)
    assert run(trusted, prompts, params) == run(plain, prompts, params)
