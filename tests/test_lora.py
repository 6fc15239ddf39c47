"""LoRA adapters on the engine (``enable_lora``), against transformers + peft on tiny random models: the adapters'
logits and greedy tokens, batches mixing adapters and the base model, the prefix cache per adapter, more adapters
than device slots, the adapters' checks, and tensor parallelism."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

from engine import LLM, LoRARequest, RequestError, SamplingParams
from tests.helpers import VOCAB, save_tiny_model
from tests.test_engine import make_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COMMON = dict(max_model_len=128, num_kvcache_blocks=96, kvcache_block_size=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_adapter(base, path, seed: int, r: int = 8, alpha: float = 16, targets=ALL, **config):
    """A random PEFT adapter (B non-zero, so that it changes the outputs) of the checkpoint at ``base``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **config)
    peft.get_peft_model(model, lora).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama and four adapters of it: ranks 8, 4 (rsLoRA) and 16 on every projection, and rank 8 on q and v
    only."""
    root = tmp_path_factory.mktemp("lora-llama")
    base = save_tiny_model("llama", root / "base")
    adapters = [
        make_adapter(base, root / "a0", seed=1),
        make_adapter(base, root / "a1", seed=2, r=4, alpha=8, use_rslora=True),
        make_adapter(base, root / "a2", seed=3, r=16, alpha=8),
        make_adapter(base, root / "a3", seed=4, targets=["q_proj", "v_proj"]),
    ]
    return base, adapters


def requests(adapters) -> list[LoRARequest]:
    return [LoRARequest(f"adapter{i}", i + 1, str(path)) for i, path in enumerate(adapters)]


def peft_reference(base, adapter, prompts, max_new_tokens: int):
    """transformers + peft: (greedy tokens, each prompt token's logprob) per prompt."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, adapter).eval() if adapter is not None else model.eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
            logits = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
            logprobs.append(logits.gather(1, ids[0, 1:, None])[:, 0])
    return tokens, logprobs


def test_each_adapter_equals_peft(llama):
    """Every adapter, each prompt alone and all in one batch: the greedy tokens and every prompt token's logprob
    of transformers + peft (the rank-4 rsLoRA adapter and the q/v-only one included)."""
    base, adapters = llama
    prompts = make_prompts(VOCAB, lens=[5, 23, 40])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    with LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=16, **COMMON) as llm:
        for request, path in zip(requests(adapters), adapters):
            tokens, logprobs = peft_reference(base, path, prompts, 8)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                lora_request=request)
            for out, want_tokens, want_lp in zip(outs, tokens, logprobs):
                assert out.outputs[0].token_ids == want_tokens, request.lora_name
                got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
                torch.testing.assert_close(got, want_lp, atol=2e-4, rtol=1e-4)


def test_merged_weights_give_the_same_tokens(llama, tmp_path):
    """peft's merge_and_unload (W + B A scaling as one weight), served as a plain model: the adapter's tokens."""
    base, adapters = llama
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.PeftModel.from_pretrained(model, adapters[0]).merge_and_unload().save_pretrained(tmp_path / "merged")
    prompts = [{"prompt_token_ids": p} for p in make_prompts(VOCAB, lens=[9, 31])]
    with LLM(str(tmp_path / "merged"), **COMMON) as llm:
        merged = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(str(base), enable_lora=True, **COMMON) as llm:
        served = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests(adapters)[0])
    assert [o.outputs[0].token_ids for o in served] == merged


def test_a_batch_mixing_adapters_equals_each_alone(llama):
    """The base model and three adapters in one batch (chunked prefill cutting the prompts): each request's tokens
    are those it gets alone; every KV block goes back to the pool."""
    base, adapters = llama
    prompts = make_prompts(VOCAB, lens=[7, 50, 12, 33, 20, 41, 9, 28])
    lora = [None, *requests(adapters)[:3]] * 2
    with LLM(str(base), enable_lora=True, max_loras=3, max_lora_rank=16, max_num_batched_tokens=48,
             **COMMON) as llm:
        together = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                                lora_request=lora)
        alone = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False, lora_request=r)[0]
                 for p, r in zip(prompts, lora)]
        assert llm.engine.kv_manager.pool.num_free_blocks == llm.engine.kv_manager.pool.num_blocks - 1
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(o.outputs[0].token_ids) for o in together[:4]}) == 4  # every adapter changes the tokens


def test_the_prefix_cache_keeps_adapters_apart(llama):
    """The same prompt under two adapters is two prefixes (the second finds nothing cached); under the same adapter
    again, or the base model again, it hits."""
    base, adapters = llama
    prompt = [{"prompt_token_ids": make_prompts(VOCAB, lens=[70])[0]}]
    a, b = requests(adapters)[:2]
    with LLM(str(base), enable_lora=True, max_loras=2, **COMMON) as llm:
        def cached(lora):
            return llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

        assert cached(a) == 0
        assert cached(b) == 0
        assert cached(None) == 0
        assert cached(a) == 64 and cached(b) == 64 and cached(None) == 64


def test_more_adapters_than_slots(llama):
    """Four adapters through two slots, in one call: requests wait for a slot (never more than two adapters run at
    once), adapters are evicted and loaded again, and every request gets its adapter's tokens."""
    base, adapters = llama
    prompts = make_prompts(VOCAB, lens=[6, 14, 30, 9, 22, 17, 11, 25])
    lora = requests(adapters) * 2
    with LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=16, **COMMON) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora)]
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, **COMMON) as llm:
        seen = []
        original = llm.engine.scheduler.schedule

        def schedule():
            out = original()
            seen.append({r.lora_id for r in llm.engine.scheduler.running} - {0})
            return out

        llm.engine.scheduler.schedule = schedule
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=lora)]
        stats = llm.engine.stats().lora
    assert got == expected
    assert max(len(s) for s in seen) == 2
    assert stats.num_loads >= 4 and stats.num_evictions >= 2


def test_adapters_are_checked_before_they_run(llama, tmp_path):
    """A request whose adapter cannot be served fails alone, with the reason, and the engine goes on."""
    base, adapters = llama
    big = make_adapter(base, tmp_path / "big", seed=5, r=32)
    saved = make_adapter(base, tmp_path / "saved", seed=6, modules_to_save=["lm_head"])
    other = tmp_path / "other-model"
    make_adapter(save_tiny_model("qwen3", tmp_path / "qwen3"), other, seed=7)
    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    with LLM(str(base), enable_lora=True, max_lora_rank=16, **COMMON) as llm:
        for path, message in [(big, "above max_lora_rank"), (saved, "modules_to_save"),
                              (other, "another model"), (tmp_path / "missing", "no adapter_config.json")]:
            with pytest.raises(RequestError, match=message):
                llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 9, str(path)))
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=requests(adapters)[0])
        with pytest.raises(RequestError, match="already names"):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=LoRARequest("y", 1, str(adapters[1])))
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(base), **COMMON) as llm:
        with pytest.raises(RequestError, match="serves no adapters"):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=requests(adapters)[0])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_architectures_equal_peft(arch, tmp_path):
    """Qwen2 (biased q|k|v) and Qwen3 (q/k norms): an adapter's greedy tokens are peft's."""
    base = save_tiny_model(arch, tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", seed=11)
    prompts = make_prompts(VOCAB, lens=[8, 27])
    tokens, _ = peft_reference(base, adapter, prompts, 10)
    with LLM(str(base), enable_lora=True, **COMMON) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                            lora_request=LoRARequest("a", 1, str(adapter)))
    assert [o.outputs[0].token_ids for o in outs] == tokens


def test_two_ranks_serve_adapters_as_one(llama, one_thread_per_rank):
    """At tensor_parallel_size=2 each rank holds its rows of B (q|k|v, gate|up) or its columns of A (o, down), and
    rank 1 loads what rank 0 plans: a mixed batch's tokens are one rank's."""
    base, adapters = llama
    prompts = [{"prompt_token_ids": p} for p in make_prompts(VOCAB, lens=[6, 19, 33, 12])]
    lora = [None, *requests(adapters)[:3]]
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, **COMMON) as llm:
        one = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)]
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, tensor_parallel_size=2, **COMMON) as llm:
        two = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)]
    assert two == one


def test_the_adapter_config_is_read_as_peft_writes_it(llama):
    """Scaling: lora_alpha / r, or / sqrt(r) with rsLoRA; the rank is each module's own."""
    from engine.lora.adapter import read_adapter_config

    _, adapters = llama
    plain, rs = read_adapter_config(adapters[0]), read_adapter_config(adapters[1])
    assert set(plain.modules.values()) == {(8, 2.0)}
    assert set(rs.modules.values()) == {(4, 4.0)}
    assert {m.rsplit(".", 1)[-1] for m in read_adapter_config(adapters[3]).modules} == {"q_proj", "v_proj"}


def write_adapter(path, config, rank: int, scale: float, seed: int = 0):
    """A PEFT adapter written directly (every projection of every layer of the model at ``config``), B times
    ``scale``."""
    from safetensors.torch import save_file

    from engine.loading.model_config import ModelConfig
    from engine.lora.checks import module_shapes

    shapes = module_shapes(ModelConfig.from_pretrained(str(config)))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    num_layers = json.loads((config / "config.json").read_text())["num_hidden_layers"]
    for layer in range(num_layers):
        for name, (n_in, n_out) in shapes.items():
            block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * scale
    path.mkdir()
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                          "target_modules": list(shapes), "bias": "none"}))
    return path


def test_adapters_on_the_default_models_quantized_blocks(default_model_path, tmp_path):
    """The default model served from its Q4_1 blocks (int4 weight methods under the adapters): an adapter whose B is
    zero, as PEFT initialises one, leaves the answer as it was; a trained-like one changes it."""
    zero = write_adapter(tmp_path / "zero", default_model_path, rank=8, scale=0.0)
    strong = write_adapter(tmp_path / "strong", default_model_path, rank=8, scale=0.5)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with LLM(enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256) as llm:
        def answer(adapter):
            return llm.chat(chat, params, use_tqdm=False, lora_request=adapter)[0].outputs[0].text

        assert answer(None) == "The capital of France is Paris."
        assert answer(LoRARequest("zero", 1, str(zero))) == "The capital of France is Paris."
        assert answer(LoRARequest("strong", 2, str(strong))) != "The capital of France is Paris."


def test_a_request_waiting_for_a_slot_lets_others_pass(llama):
    """One slot: a request under a second adapter waits, and the base-model request queued behind it starts in the
    first step beside the first adapter's."""
    base, adapters = llama
    a, b = requests(adapters)[:2]
    prompts = [{"prompt_token_ids": p} for p in make_prompts(VOCAB, lens=[10, 11, 12])]
    with LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=16, **COMMON) as llm:
        steps = []
        original = llm.engine.scheduler.schedule

        def schedule():
            out = original()
            steps.append(sorted(r.lora_id for r in llm.engine.scheduler.running))
            return out

        llm.engine.scheduler.schedule = schedule
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[a, b, None])
    assert steps[0] == [0, a.lora_int_id]
    assert [b.lora_int_id] in steps  # its turn came once the first adapter's request finished
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)


def test_the_kernels_give_the_tokens_of_the_torch_path(llama):
    """The engine on the Triton kernels (interpreted on the CPU: per token in steps of up to 16 tokens, by slot in
    the prefill steps past that) gives the tokens of its torch path, for a batch mixing two adapters and the base
    model."""
    pytest.importorskip("triton")
    base, adapters = llama
    prompts = [{"prompt_token_ids": p} for p in make_prompts(VOCAB, lens=[30, 9, 21])]
    lora = [requests(adapters)[0], None, requests(adapters)[2]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, enable_prefix_caching=False,
             **COMMON) as llm:
        torch_path = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=lora)]
        llm.engine.runner.lora.mapping.use_triton = True
        kernels = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=lora)]
    assert kernels == torch_path


def test_adapters_through_the_mixed_step_graph_layout(llama):
    """Steps laid out as a mixed-step CUDA graph replays them (``MixedGraphs``, run eagerly on the CPU where nothing
    is captured): tokens padded to a captured count, whose padding reads no adapter, and the per-token slots read
    from the fixed buffers. A batch mixing adapters and the base model gets the tokens of plain eager steps."""
    from engine.worker.cuda_graphs import MixedGraphs

    base, adapters = llama
    prompts = [{"prompt_token_ids": p} for p in make_prompts(VOCAB, lens=[30, 9, 21, 14])]
    lora = [requests(adapters)[0], None, requests(adapters)[2], requests(adapters)[1]]
    options = dict(enable_lora=True, max_loras=3, max_lora_rank=16, max_num_batched_tokens=40, **COMMON)
    with LLM(str(base), **options) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)]
    with LLM(str(base), enable_prefix_caching=False, **options) as llm:
        runner, config = llm.engine.runner, llm.engine.config
        runner.mixed_graphs = MixedGraphs(runner.model, runner.buffers, config.graph_token_sizes(),
                                          config.max_num_seqs, runner.block_size, runner.max_model_len)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)]
        assert runner.mixed_graphs.replays > 0 and runner.num_steps_by_kind["eager"] == 0
    assert got == expected
