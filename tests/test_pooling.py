"""Pooling runner (``runner="pooling"``, ``LLM.embed``): a decoder embedding model's output is the final hidden state
of each prompt's last token, L2-normalised, as transformers computes it; from a base-model checkpoint (the layout of
Qwen3-Embedding: no LM head, no ``model.`` prefix) as from a causal LM's; Matryoshka sizes where the config names
them; the two runners refuse each other's requests."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from engine import LLM, PoolingParams, RequestError, SamplingParams
from tests.helpers import SMALL_CONFIG, VOCAB, spread_weights
from tests.test_engine import make_prompts


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A tiny random Qwen3 saved as a base model (Qwen3Model: what embedding checkpoints hold) whose config names
    the causal LM architecture, as Qwen3-Embedding's does; its transformers reference."""
    config = transformers.Qwen3Config(**SMALL_CONFIG, head_dim=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3Model(config).eval()
    spread_weights(model)
    path = tmp_path_factory.mktemp("qwen3-embedding")
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**saved, "architectures": ["Qwen3ForCausalLM"]}))
    return path, model


def _reference(model, prompts) -> list[torch.Tensor]:
    with torch.no_grad():
        return [F.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1) for p in prompts]


def test_embeddings_are_the_last_tokens_normalised_hidden_state(embedder):
    """Prompts of different lengths in one batch, then with prefills cut in chunks of 16 tokens: each embedding is
    transformers' last hidden state of the prompt's last token, normalised; every KV block goes back to the pool."""
    path, model = embedder
    prompts = make_prompts(VOCAB, lens=[5, 37, 12, 60])
    expected = _reference(model, prompts)
    for chunk in (8192, 16):
        with LLM(str(path), runner="pooling", max_model_len=128, num_kvcache_blocks=64,
                 max_num_batched_tokens=chunk) as llm:
            outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
            assert [o.prompt_token_ids for o in outs] == prompts
            for out, want in zip(outs, expected):
                got = torch.tensor(out.outputs.embedding)
                assert got.shape == (SMALL_CONFIG["hidden_size"],)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            raw = llm.embed({"prompt_token_ids": prompts[0]}, PoolingParams(normalize=False), use_tqdm=False)[0]
            assert torch.tensor(raw.outputs.embedding).norm() > 1.5  # not normalised: the hidden state itself
            llm.engine.kv_manager.check_invariants()
            assert llm.engine.kv_manager.num_requests == 0


def test_matryoshka_dimensions_and_the_runners_refusals(embedder, tmp_path):
    path, model = embedder
    prompt = make_prompts(VOCAB, lens=[20])[0]
    with LLM(str(path), runner="pooling", max_model_len=128, num_kvcache_blocks=32) as llm:
        with pytest.raises(RequestError, match="not a Matryoshka model"):
            llm.embed({"prompt_token_ids": prompt}, PoolingParams(dimensions=16), use_tqdm=False)
        with pytest.raises(RequestError, match="served for embeddings"):
            llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4), use_tqdm=False)
    matryoshka = tmp_path / "matryoshka"
    matryoshka.mkdir()
    for item in path.iterdir():
        (matryoshka / item.name).symlink_to(item)
    (matryoshka / "config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    (matryoshka / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    with LLM(str(matryoshka), runner="pooling", max_model_len=128, num_kvcache_blocks=32) as llm:
        out = llm.embed({"prompt_token_ids": prompt}, PoolingParams(dimensions=16), use_tqdm=False)[0]
        with torch.no_grad():
            hidden = model(torch.tensor([prompt])).last_hidden_state[0, -1, :16]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(hidden, dim=-1), rtol=1e-4,
                                   atol=1e-5)
        with pytest.raises(RequestError, match="dimensions must be one of 16, 32"):
            llm.embed({"prompt_token_ids": prompt}, PoolingParams(dimensions=20), use_tqdm=False)
    with LLM(str(path), max_model_len=128, num_kvcache_blocks=32) as generator:
        with pytest.raises(RequestError, match="served for generation"):
            generator.embed({"prompt_token_ids": prompt}, use_tqdm=False)
