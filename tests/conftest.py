"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The converted default model (SmolLM2-135M-Instruct); downloaded and converted once, then cached."""
    from engine.default_model import ensure_default_model

    return ensure_default_model()
