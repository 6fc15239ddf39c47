"""``--compile`` (``engine/worker/cpu_compile.py``): the CPU decode step compiled by inductor gives the eager step's
greedy tokens and logprobs, its graphs serve the decode steps they were compiled for, and it stays off where it does
not apply. Also the torch backend's deferred K/V writes that the compiled step relies on."""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import DEFERRED_KV_WRITES, TorchAttentionBackend, write_kv
from engine.config import EngineConfig
from engine.worker import cpu_compile
from engine.worker.cpu_compile import compiled_decode
from tests.helpers import VOCAB, save_tiny_model


def needs_inductor(test):
    """torch.compile on the CPU needs torch >= 2.6 and a C++ compiler: skipped without them, but failed in CI
    (``.ci/run`` installs g++ where it is missing)."""

    @functools.wraps(test)
    def checked(*args, **kwargs):
        missing = ("torch >= 2.6" if not hasattr(torch.compiler, "set_stance") else
                   None if shutil.which("g++") or shutil.which("c++") else "a C++ compiler")
        if missing is not None:
            if os.environ.get("CI"):
                pytest.fail(f"torch.compile on the CPU needs {missing}; CI must run this test")
            pytest.skip(f"torch.compile on the CPU needs {missing}")
        return test(*args, **kwargs)

    return checked


def prompts(lens, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]


def generate(llm: LLM, batch, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def assert_same(compiled_outs, eager_outs) -> None:
    for c, e in zip(compiled_outs, eager_outs, strict=True):
        assert c.token_ids == e.token_ids
        for lc, le in zip(c.logprobs, e.logprobs, strict=True):
            assert lc.top_token_ids == le.top_token_ids
            torch.testing.assert_close(lc.top_logprobs, le.top_logprobs, rtol=0, atol=1e-4)


@needs_inductor
@pytest.mark.parametrize("name", ["llama", "llama-tied-linear-rope"])
def test_compiled_decode_steps_give_the_eager_tokens_and_logprobs(tmp_path, name):
    """One request at a time (the graph of one), then four at once (the graph of several), contexts past one block:
    every decode step runs the graphs without compiling again (``fail_on_recompile``) and gives the eager engine's
    greedy tokens and logprobs. Then a context of one block (no graph of its own: it runs eagerly until it grows past
    it) and steps that mix decodes with prefill chunks. The second model compiles its own graphs in the same process."""
    model_dir = save_tiny_model(name, tmp_path / name)
    kwargs = dict(max_model_len=256, num_kvcache_blocks=48, max_num_batched_tokens=64)
    long_prompts, other_prompts = prompts([20, 37, 50, 70]), prompts([3, 9, 30, 70], seed=1)

    def others(llm):  # one short context alone, then prefill chunks beside decodes (a 64-token step budget)
        return generate(llm, other_prompts[:1], 20) + generate(llm, other_prompts, 20)

    with LLM(str(model_dir), **kwargs) as eager:
        expected = [generate(eager, [p], 24)[0] for p in long_prompts[:2]] + generate(eager, long_prompts, 30)
        expected_others = others(eager)
    with LLM(str(model_dir), compile=True, **kwargs) as llm:
        step = compiled_decode(llm.engine.runner.model)
        assert step is not None
        admitted = step.compiled
        step.compiled = torch.compiler.set_stance("fail_on_recompile")(step.compiling)
        got = [generate(llm, [p], 24)[0] for p in long_prompts[:2]] + generate(llm, long_prompts, 30)
        assert step.num_steps >= 2 * 23 + 10  # the decode steps of one request, then of several
        step.compiled = admitted
        got_others = others(llm)
    assert_same(got, expected)
    assert_same(got_others, expected_others)


def test_deferred_kv_writes_attend_as_written_ones():
    """A decode batch whose K/V are handed out (``DEFERRED_KV_WRITES``) gets the output of the step that writes them
    first, bit for bit, and writing them afterwards leaves the cache the other step leaves."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kvh, heads, hd = 12, 4, 2, 4, 8
    cache = torch.randn(2, num_blocks, block_size, kvh, hd, generator=gen)
    tables = torch.tensor([[3, 7, 1], [5, 2, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 6], dtype=torch.int32)  # the new tokens at positions 9 and 5
    slots = torch.tensor([1 * block_size + 1, 2 * block_size + 1])
    q, k, v = (torch.randn(2, n, hd, generator=gen) for n in (heads, kvh, kvh))

    def meta():
        return AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(3, dtype=torch.int32),
                                 seq_lens=seq_lens, block_tables=tables, num_reqs=2, num_decodes=2, num_decode_tokens=2,
                                 max_query_len=1, max_seq_len=10, block_size=block_size,
                                 query_start_loc_cpu=torch.arange(3, dtype=torch.int32), seq_lens_cpu=seq_lens)

    backend = TorchAttentionBackend()
    written = cache.clone()
    out = backend.forward(backend.bind(written[0], written[1], heads, 0.3), q, k, v, meta())
    deferred = cache.clone()
    step = meta()
    writes = step.derive(DEFERRED_KV_WRITES, list)
    out_deferred = backend.forward(backend.bind(deferred[0], deferred[1], heads, 0.3), q, k, v, step)
    assert torch.equal(deferred, cache)  # nothing written yet
    assert torch.equal(out_deferred, out)
    (new_k, new_v), = writes
    write_kv(deferred[0], deferred[1], new_k, new_v, slots)
    assert torch.equal(deferred, written)


def test_compile_stays_off_where_it_does_not_apply(tmp_path, caplog, monkeypatch):
    """An FP8 KV cache: the engine says why and runs eagerly; a torch without ``set_stance`` is refused too."""
    model_dir = save_tiny_model("llama", tmp_path / "llama")
    with caplog.at_level("WARNING", logger="minivllm"):
        with LLM(str(model_dir), max_model_len=128, num_kvcache_blocks=16, kv_cache_dtype="fp8", compile=True) as llm:
            assert compiled_decode(llm.engine.runner.model) is None
            assert len(generate(llm, prompts([20]), 4)[0].token_ids) == 4
            model, backend = llm.engine.runner.model, llm.engine.runner.backend
            monkeypatch.delattr(torch.compiler, "set_stance")
            config = EngineConfig(model=str(model_dir), compile=True)
            assert "torch >= 2.6" in cpu_compile._unsupported(model, config, backend)
    assert "--compile: the decode step runs eagerly (an FP8 KV cache)" in caplog.text
