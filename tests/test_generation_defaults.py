"""Request defaults from generation_config.json: read as vLLM does, ignored on request, refused when unusable."""

from __future__ import annotations

import json

import pytest

from engine.config import ConfigError
from engine.loading.generation_defaults import load_sampling_defaults


def write(folder, config: dict):
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_auto_reads_the_sampling_fields_only(tmp_path):
    write(tmp_path, {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 512, "do_sample": True,
                     "eos_token_id": [1, 2], "repetition_penalty": None})
    assert load_sampling_defaults("auto", str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                             "max_tokens": 512}


def test_vllm_ignores_the_file_and_auto_tolerates_none(tmp_path):
    write(tmp_path, {"temperature": 0.6})
    assert load_sampling_defaults("vllm", str(tmp_path)) == {}
    assert load_sampling_defaults("auto", str(tmp_path / "missing")) == {}


def test_a_folder_is_read_and_must_have_the_file(tmp_path):
    other = write(tmp_path / "other", {"min_p": 0.05}) if (tmp_path / "other").mkdir() is None else None
    assert load_sampling_defaults(str(other), str(tmp_path)) == {"min_p": 0.05}
    with pytest.raises(ConfigError, match="no generation_config.json"):
        load_sampling_defaults(str(tmp_path / "nowhere"), str(tmp_path))


def test_unusable_defaults_are_refused_at_start_up(tmp_path):
    write(tmp_path, {"top_p": 0})
    with pytest.raises(ConfigError, match="cannot be used"):
        load_sampling_defaults("auto", str(tmp_path))


def test_the_default_model_samples_as_its_model_card_says(default_model_path):
    assert load_sampling_defaults("auto", str(default_model_path)) == {"temperature": 0.2, "top_p": 0.9}


def test_a_default_max_tokens_is_capped_by_the_server_limit_not_refused():
    """--max-tokens-limit refuses what a request asks beyond it, but caps what the request did not ask: the model's
    generation config (max_new_tokens) or the endpoint's default (16 for completions)."""
    from server.errors import APIError
    from server.limits import ServerLimits

    limited, open_ = ServerLimits(max_tokens_limit=64), ServerLimits()
    assert limited.apply_max_tokens(None, "max_tokens", default=512) == 64
    assert limited.apply_max_tokens(None, "max_tokens", default=16) == 16
    assert limited.apply_max_tokens(None, "max_tokens") == 64
    assert limited.apply_max_tokens(40, "max_tokens", default=512) == 40
    with pytest.raises(APIError, match="max_completion_tokens=65 is more than this server allows"):
        limited.apply_max_tokens(65, "max_completion_tokens", default=16)
    assert open_.apply_max_tokens(None, "max_tokens", default=512) == 512
    assert open_.apply_max_tokens(None, "max_tokens") is None
    assert open_.apply_max_tokens(10_000, "max_tokens") == 10_000
