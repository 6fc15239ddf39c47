"""engine.settings: the one module that reads minivllm's ``MINIVLLM_*`` environment variables, each documented,
each read again at every call."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from engine import settings

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("engine", "kvcache", "server")
NAME = re.compile(r"MINIVLLM_[A-Z0-9_]*")


def names_used(path: Path) -> set[str]:
    """The MINIVLLM_ names a module's code uses as a name: a string that is one (``os.environ.get("MINIVLLM_X")``,
    the ``"MINIVLLM_"`` of an f-string) or a keyword argument (``dict(os.environ, MINIVLLM_X=...)``). Names inside
    docstrings, comments and messages are prose, not reads."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
            found.add(node.value)
        elif isinstance(node, ast.keyword) and node.arg and NAME.fullmatch(node.arg):
            found.add(node.arg)
    return found


def test_no_product_module_but_settings_reads_a_minivllm_variable():
    readers = {}
    for root in PRODUCT:
        for path in sorted((REPO / root).rglob("*.py")):
            used = names_used(path)
            if used and path != REPO / "engine" / "settings.py":
                readers[str(path.relative_to(REPO))] = sorted(used)
    assert readers == {}


def test_every_variable_is_documented_where_it_is_read():
    doc = settings.__doc__
    for name in settings.VARIABLES:
        assert re.search(rf"^    {name} ", doc, re.M), f"{name} is missing from the module docstring's table"
        readers = [f for f in vars(settings).values() if callable(f) and (f.__doc__ or "").startswith(f"``{name}``")]
        assert len(readers) == 1, f"{name}: one function whose docstring starts with its name"
    assert set(settings.VARIABLES) == names_used(REPO / "engine" / "settings.py")


def test_every_minivllm_name_the_product_mentions_is_documented():
    mentioned = set()
    for root in PRODUCT:
        for path in (REPO / root).rglob("*.py"):
            mentioned |= set(NAME.findall(path.read_text()))
    undocumented = {name for name in mentioned if name not in settings.__doc__}
    assert undocumented == set()


def test_defaults_where_unset_or_empty(monkeypatch, tmp_path):
    for name in settings.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = (None, tmp_path / ".cache" / "minivllm", "auto", None, "graph", "triton")
    assert (settings.api_key(), settings.cache_dir(), settings.decode_ksplit(), settings.decode_tiles(),
            settings.greedy_argmax(), settings.moe_backend()) == expected
    for name in (settings.API_KEY, settings.CACHE, settings.DECODE_KSPLIT, settings.DECODE_TILES,
                 settings.MOE_BACKEND):
        monkeypatch.setenv(name, "")
    assert (settings.api_key(), settings.cache_dir(), settings.decode_ksplit(), settings.decode_tiles(),
            settings.moe_backend()) == (None, tmp_path / ".cache" / "minivllm", "auto", None, "triton")


def test_values_are_read_at_each_call(monkeypatch, tmp_path):
    monkeypatch.setenv(settings.CACHE, str(tmp_path))
    monkeypatch.setenv(settings.DECODE_KSPLIT, " O=4, Down=2 ")
    monkeypatch.setenv(settings.MOE_BACKEND, " Torch ")
    monkeypatch.setenv(settings.DECODE_TILES, "128,4,2")
    monkeypatch.setenv(settings.API_KEY, "sk-1")
    assert settings.cache_dir() == tmp_path and settings.decode_ksplit() == "o=4,down=2"
    assert settings.moe_backend() == "torch" and settings.decode_tiles() == "128,4,2" and settings.api_key() == "sk-1"
    monkeypatch.setenv(settings.DECODE_KSPLIT, "0")
    monkeypatch.setenv(settings.GREEDY_ARGMAX, "kernel")
    assert settings.decode_ksplit() == "0" and settings.greedy_argmax() == "kernel"


def test_the_worker_config_goes_through_the_rank_environment(monkeypatch):
    monkeypatch.delenv(settings.WORKER_CONFIG, raising=False)
    with pytest.raises(RuntimeError, match="MINIVLLM_WORKER_CONFIG is not set"):
        settings.worker_config()
    env = settings.worker_env(json.dumps({"tensor_parallel_size": 2}))
    assert env["PATH"] and json.loads(env[settings.WORKER_CONFIG]) == {"tensor_parallel_size": 2}
    monkeypatch.setenv(settings.WORKER_CONFIG, env[settings.WORKER_CONFIG])
    assert settings.worker_config() == {"tensor_parallel_size": 2}


def test_the_modules_that_interpret_a_variable_name_it_in_their_errors(monkeypatch):
    from engine.models.linear import ksplit as layers

    monkeypatch.setenv(settings.DECODE_KSPLIT, "lm_head=2")
    with pytest.raises(ValueError, match="MINIVLLM_DECODE_KSPLIT"):
        layers.decode_k_slices("o", 1024)
    monkeypatch.setenv(settings.DECODE_KSPLIT, " 2 ")
    assert layers.decode_k_split_setting() == "2" and layers.decode_k_slices("o", 1024) == 2
