"""Tensor parallelism over two CUDA GPUs (NCCL), against one GPU and against transformers.

The CPU tests (tests/test_tensor_parallel*.py) check the same sharding over gloo; these run the CUDA path:
NCCL all-reduces, Triton attention on each rank's heads, CUDA graphs replayed on every rank. They need a GPU
host with two devices or more (``pytest -m gpu``) and are skipped on one with a single device. Keep NCCL's
NVLink multicast off on shared hosts (``NCCL_NVLS_ENABLE=0``); the ranks inherit the environment.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM
from tests.helpers import VOCAB, save_checkpoint
from tests.server_helpers import free_port
from tests.test_gpu import _greedy, _prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on CUDA needs two GPUs"),
]


@pytest.mark.parametrize("name", ["llama-tied", "qwen3-gqa", "qwen3-moe"])
def test_tp2_on_two_gpus_generates_what_one_gpu_does_in_float32(tmp_path, name):
    """Rank 0 on GPU 0 schedules and samples, rank 1 on GPU 1 follows; chunked prefill beside decodes, CUDA graphs
    and steps planned ahead on both: the greedy tokens of one GPU (the CPU tests' tiny checkpoints)."""
    from tests.test_tensor_parallel import CONFIGS

    model_dir = save_checkpoint(CONFIGS[name](), tmp_path / name)
    prompts = _prompts(VOCAB, [40, 70, 25, 90, 55, 33, 61, 48, 3, 120])
    common = dict(device="cuda", dtype="float32", max_model_len=256, num_kvcache_blocks=128,
                  max_num_batched_tokens=64)
    tp2 = LLM(str(model_dir), tensor_parallel_size=2, **common)
    try:
        assert tp2.engine.runner.graphs is not None, "decode steps replay CUDA graphs on every rank"
        got = _greedy(tp2, prompts, 24)
    finally:
        tp2.engine.close()
    tp1 = LLM(str(model_dir), **common)
    try:
        assert got == _greedy(tp1, prompts, 24)
    finally:
        tp1.engine.close()


def _rank_logits(rank: int, port: int, model_dir: str, prompts: list[list[int]], out: str) -> None:
    """One rank of two: its shard of the checkpoint in bf16 on its own GPU, Triton attention; rank 0 saves the
    logits of a prefill step and of a chunk after a cached prefix."""
    from engine.attention.triton_backend import TritonAttentionBackend
    from engine.distributed import destroy_tensor_parallel, init_tensor_parallel
    from engine.loading.loader import load_model
    from engine.loading.model_config import ModelConfig
    from tests.helpers import PagedRunner

    torch.cuda.set_device(rank)
    init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", backend="nccl", timeout_s=120)
    model = load_model(ModelConfig.from_pretrained(model_dir), torch.bfloat16, torch.device("cuda", rank))
    runner = PagedRunner(model, num_blocks=256, block_size=16, max_blocks_per_req=64)
    for layer in model.attention_layers():
        layer.set_backend(TritonAttentionBackend())
    with torch.inference_mode():
        first = runner.step([(i, p[:-8]) for i, p in enumerate(prompts)])
        tail = runner.step([(i, p[-8:]) for i, p in enumerate(prompts)])
    if rank == 0:
        torch.save([torch.cat([a, b]).cpu() for a, b in zip(first, tail)], out)
    destroy_tensor_parallel()


def test_tp2_bf16_logits_on_a_real_shape_stay_within_tolerance(tmp_path):
    """Qwen3-0.6B's shape with random weights, split over two GPUs in bf16 (8 query and 4 KV heads a rank, half
    the vocabulary each): the logits stay as close to transformers' float32 as one GPU's do (tests/test_gpu.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from workloads import MODEL_SHAPES

    model_dir = tmp_path / "qwen3-0.6b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(MODEL_SHAPES["qwen3-0.6b"]))
    config = transformers.AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(model_dir)
    prompts = _prompts(config.vocab_size, [200, 333, 64])
    out = tmp_path / "logits.pt"
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [ctx.Process(target=_rank_logits, args=(r, port, str(model_dir), prompts, str(out))) for r in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=600)
    assert [p.exitcode for p in ranks] == [0, 0]
    hf = hf.cuda()
    with torch.no_grad():
        for i, (p, mine) in enumerate(zip(prompts, torch.load(out))):
            ref = hf(torch.tensor([p], device="cuda")).logits[0].float().cpu()
            err = ((mine.double() - ref.double()).norm() / ref.double().norm()).item()
            assert err < 2e-2, f"prompt {i}: relative error {err:.2e}"
            assert (mine.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def _gpu_memory_used_mib(index: int) -> int:
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(index)]
    return int(subprocess.run(query, capture_output=True, text=True, check=True).stdout.strip())


def test_server_at_tp2_on_two_gpus_answers_and_ends_cleanly_when_a_rank_dies(tmp_path, tokenizer_dir):
    """``minivllm serve --tensor-parallel-size 2`` on two GPUs answers the ``openai`` SDK with one GPU's greedy
    text; rank 1 killed mid-stream ends the stream, /health says 503, and no process of the server holds GPU 1."""
    import os

    import httpx
    import openai

    from tests.server_helpers import build_tiny_model, engine_core_pid, process_alive, rank_pids, start_server

    model_dir = build_tiny_model(tmp_path / "tiny", tokenizer_dir, head_dim=64)
    # float32: in bf16 the ranks' partial sums round apart from one GPU's product and may turn a greedy token.
    args = ["--model", str(model_dir), "--served-model-name", "tiny", "--max-model-len", "512",
            "--num-kvcache-blocks", "1024", "--dtype", "float32"]
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    params = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})

    def answers(url: str) -> list[str]:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        return [client.completions.create(model="tiny", prompt=p, **params).choices[0].text for p in prompts]

    one = start_server(tmp_path, "tp1", args)
    try:
        expected = answers(one.url)
    finally:
        assert one.stop() == 0
    server = start_server(tmp_path, "tp2", args + ["--tensor-parallel-size", "2"])
    try:
        assert answers(server.url) == expected
        [worker] = rank_pids(server)
        core = engine_core_pid(server)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(Exception):  # an error event (the SDK raises) or a cut connection
            for _ in stream:
                pass
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() - killed < 10, "the server still says it is healthy"
            time.sleep(0.1)
        while (process_alive(core) or _gpu_memory_used_mib(1) > 2048) and time.monotonic() - killed < 30:
            time.sleep(0.2)
        assert not process_alive(core) and not process_alive(worker)
        assert _gpu_memory_used_mib(1) <= 2048, "a process still holds GPU 1's memory"
    finally:
        server.stop()
