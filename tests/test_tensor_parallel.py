"""Tensor-parallel layers on the CPU (gloo): two ranks give the logits of one, for every sharded piece.

Each rank loads only its slice of the checkpoint (column-parallel q|k|v and gate|up, row-parallel o_proj
and down_proj, vocab-parallel embedding and LM head, replicated KV heads when there are fewer than
ranks) and runs the same paged steps; the gathered logits must equal the single-rank model's.
"""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from tests.helpers import SMALL_CONFIG, TINY_CONFIGS, VOCAB, PagedRunner, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread_per_rank")

CONFIGS = {
    "llama-untied": TINY_CONFIGS["llama-llama3-rope"],
    "llama-tied": TINY_CONFIGS["llama-tied-linear-rope"],
    "qwen2-bias": TINY_CONFIGS["qwen2"],
    "qwen3-gqa": TINY_CONFIGS["qwen3"],
    "llama-one-kv-head": lambda: transformers.LlamaConfig(**{**SMALL_CONFIG, "num_key_value_heads": 1}),
    # Every expert's intermediate size split over the ranks, the router replicated.
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**{**SMALL_CONFIG, "tie_word_embeddings": False}, head_dim=16,
                                                     moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                                     norm_topk_prob=True),
}


def steps(vocab: int) -> list[list[tuple[int, list[int]]]]:
    """A prefill of three prompts, a chunked prefill beside decodes, then decodes."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (9, 30, 21)]
    token = lambda: torch.randint(0, vocab, (1,), generator=gen).tolist()  # noqa: E731
    return [
        [(0, prompts[0]), (1, prompts[1][:16])],
        [(0, token()), (1, prompts[1][16:]), (2, prompts[2])],
        [(0, token()), (1, token()), (2, token())],
        [(0, token()), (1, token()), (2, token())],
    ]


def run_steps(path: Path) -> list[torch.Tensor]:
    model = load_model(ModelConfig.from_pretrained(path), dtype=torch.float32, device="cpu")
    runner = PagedRunner(model)
    return [torch.cat(runner.step(step)) for step in steps(VOCAB)]


def rank_main(rank: int, port: int, paths: dict[str, str], out: str) -> None:
    from engine.distributed import destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", backend="gloo", timeout_s=60)
    results = {}
    for name, path in paths.items():
        logits = run_steps(Path(path))
        model = load_model(ModelConfig.from_pretrained(path), dtype=torch.float32, device="cpu")
        attn = model.attention_layers()[0]
        results[name] = (logits, model.model.embed_tokens.weight.shape[0], attn.num_heads, attn.num_kv_heads)
    if rank == 0:
        torch.save(results, out)
    destroy_tensor_parallel()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return {name: save_checkpoint(make(), tmp_path_factory.mktemp(name)) for name, make in CONFIGS.items()}


def test_two_ranks_give_the_logits_of_one(checkpoints, tmp_path):
    out = tmp_path / "tp2.pt"
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [ctx.Process(target=rank_main, args=(r, port, {k: str(v) for k, v in checkpoints.items()}, str(out)))
             for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    assert [p.exitcode for p in ranks] == [0, 0]
    sharded = torch.load(out)
    for name, path in checkpoints.items():
        logits, local_vocab, local_heads, local_kv_heads = sharded[name]
        config = transformers.AutoConfig.from_pretrained(path)
        assert local_vocab == VOCAB // 2 and local_heads == config.num_attention_heads // 2
        assert local_kv_heads == max(1, config.num_key_value_heads // 2)
        for got, expected in zip(logits, run_steps(path)):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=name)


def greedy(llm, prompts, max_tokens=10):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


# The other configurations are covered by the logits test above; each engine run starts a rank process.
@pytest.mark.parametrize("name", ["llama-tied", "llama-one-kv-head", "qwen2-bias"])
def test_the_engine_at_tp2_generates_what_it_does_at_tp1(checkpoints, name):
    """Rank 0 schedules and samples, rank 1 (its own process) follows every step: 8 prompts with chunked
    prefill, shared prefixes for the prefix cache and a pool small enough to preempt give TP=1's tokens."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (40, 70, 25, 90, 55, 33, 61, 48)]
    prompts += [prompts[1][:48] + prompts[2][:10], prompts[3][:64] + [7]]  # full blocks in the prefix cache
    common = dict(max_model_len=256, num_kvcache_blocks=24, max_num_batched_tokens=32)
    with LLM(str(checkpoints[name]), tensor_parallel_size=2, **common) as tp2:
        got = greedy(tp2, prompts)
        assert tp2.engine.scheduler.num_preemptions_total > 0
        assert tp2.engine.kv_manager.prefix_cache_hits > 0
    assert got == greedy(LLM(str(checkpoints[name]), **common), prompts)


def test_prompt_logprobs_at_tp2_are_tp1s(checkpoints):
    """Rank 1 gathers the prompt logprobs' chunks of logits and then the sampled rows', in rank 0's order."""
    prompts = [{"prompt_token_ids": list(range(5, 45))}, {"prompt_token_ids": list(range(60, 131))}]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    common = dict(max_model_len=256, num_kvcache_blocks=24, max_num_batched_tokens=48)

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        ids = [(o.outputs[0].token_ids, [None if e is None else (e.token_id, e.rank, e.top_token_ids)
                                         for e in o.prompt_logprobs]) for o in outs]
        values = [[x for e in o.prompt_logprobs[1:] for x in (e.logprob, *e.top_logprobs)] for o in outs]
        return ids, values

    with LLM(str(checkpoints["llama-tied"]), tensor_parallel_size=2, **common) as tp2:
        ids, values = run(tp2)
    with LLM(str(checkpoints["llama-tied"]), **common) as tp1:
        expected_ids, expected_values = run(tp1)
    assert ids == expected_ids
    for got, expected in zip(values, expected_values):
        assert got == pytest.approx(expected, abs=1e-4)


def test_a_tp_size_the_model_cannot_split_by_is_refused(checkpoints):
    with pytest.raises(ConfigError, match="does not divide the model's attention heads"):
        LLM(str(checkpoints["llama-untied"]), tensor_parallel_size=3, max_model_len=256, num_kvcache_blocks=24)


def test_fp8_weights_and_kv_cache_at_tp2_generate_what_tp1_does(tmp_path):
    """``--quantization fp8 --kv-cache-dtype fp8`` at TP=2: a row-parallel rank holds some of each output channel's
    input columns and scales them by the whole channel's maximum (over the ranks), so the weights round as on one
    rank and the greedy tokens are TP=1's. The ranks' shares are whole 128-column groups, as the activations'
    scales are on one rank. (Each rank scaling by its own share's maximum gave 2 of these 8 prompts' tokens.)

    The ranks' partial sums still add in another order than one rank's product, and FP8 rounds what comes out,
    so a step whose two best tokens are within rounding of each other may pick either; the test allows that
    (and nothing else): a prompt may part from TP=1 only where TP=1's first two logprobs are that close."""
    config = transformers.LlamaConfig(**{**SMALL_CONFIG, "hidden_size": 256, "intermediate_size": 512})
    model_dir = save_checkpoint(config, tmp_path / "llama")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (40, 70, 25, 90, 55, 33, 61, 48)]
    common = dict(max_model_len=256, num_kvcache_blocks=64, max_num_batched_tokens=64, quantization="fp8",
                  kv_cache_dtype="fp8")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)

    def run(llm):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0] for o in outputs]

    with LLM(str(model_dir), tensor_parallel_size=2, **common) as tp2:
        assert tp2.engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        got = run(tp2)
    with LLM(str(model_dir), **common) as tp1:
        expected = run(tp1)
    parted = 0
    for mine, theirs in zip(got, expected):
        assert len(mine.token_ids) == len(theirs.token_ids) == 16
        at = next((i for i, (a, b) in enumerate(zip(mine.token_ids, theirs.token_ids)) if a != b), None)
        if at is None:
            continue
        parted += 1
        top = theirs.logprobs[at]
        assert top.top_token_ids[:2] in ([theirs.token_ids[at], mine.token_ids[at]],
                                         [mine.token_ids[at], theirs.token_ids[at]])
        assert top.top_logprobs[0] - top.top_logprobs[1] < 0.02, (at, top)
    assert parted <= 1, f"{parted} of {len(prompts)} prompts generated other tokens at TP=2"


def test_speculative_decoding_at_tp2_generates_what_tp1_does_without(checkpoints):
    """n-gram proposals verified at TP=2: rank 1 runs every verification step rank 0 plans (1 + k tokens a row)
    and the tokens are TP=1's without speculation (a random model repeats itself: proposals are accepted)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (12, 30, 21)]
    common = dict(max_model_len=256, num_kvcache_blocks=48)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(str(checkpoints["llama-tied"]), tensor_parallel_size=2, speculative_config=spec, **common) as tp2:
        got = greedy(tp2, prompts, max_tokens=24)
        assert tp2.engine.proposer.num_accepted_tokens > 0
    assert got == greedy(LLM(str(checkpoints["llama-tied"]), **common), prompts, max_tokens=24)


def test_a_draft_model_on_rank_0_beside_a_tp2_target(checkpoints):
    """A draft model at TP=2 runs unsharded on rank 0 (the target as its own draft: its proposals are the
    argmaxes the verification computes, bar near-ties); rank 1 verifies them with the step's input ids, and the
    tokens are TP=1's without speculation."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (12, 30, 21)]
    common = dict(max_model_len=256, num_kvcache_blocks=48)
    target = str(checkpoints["llama-untied"])
    spec = {"model": target, "num_speculative_tokens": 3}
    with LLM(target, tensor_parallel_size=2, speculative_config=spec, **common) as tp2:
        got = greedy(tp2, prompts, max_tokens=16)
        proposer = tp2.engine.proposer
        assert proposer.num_accepted_tokens >= 0.9 * proposer.num_draft_tokens > 0
        drafter = tp2.engine.runner.drafter
        assert drafter.model.attention_layers()[0].num_heads == drafter.model_config.num_attention_heads  # whole
    assert got == greedy(LLM(target, **common), prompts, max_tokens=16)
