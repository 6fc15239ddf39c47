"""Cross-encoder scoring (``Qwen3ForSequenceClassification``, ``LLM.score``) on a tiny random classifier with the
default model's tokenizer: its logits and scores equal transformers' for each (query, document) pair; a classifier
is refused as a generator."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import transformers

from engine import LLM, ConfigError
from tests.helpers import SMALL_CONFIG, spread_weights

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Berlin is in Germany.", "The sky is blue today, isn't it?"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, default_model_path):
    """A tiny random one-label Qwen3 classifier over the default model's vocabulary (its tokenizer alongside)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path)
    config = transformers.Qwen3Config(**{**SMALL_CONFIG, "vocab_size": len(tokenizer)}, head_dim=32, num_labels=1,
                                      pad_token_id=tokenizer.pad_token_id or 0,
                                      architectures=["Qwen3ForSequenceClassification"])
    torch.manual_seed(0)
    model = transformers.Qwen3ForSequenceClassification(config).eval()
    spread_weights(model)
    path = tmp_path_factory.mktemp("reranker")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def test_scores_are_the_classifiers_sigmoid_as_transformers_computes_it(classifier):
    path, model, tokenizer = classifier
    with LLM(str(path), runner="pooling", max_model_len=256, num_kvcache_blocks=64) as llm:
        outs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        pairs = llm.score([QUERY, DOCUMENTS[0]], [DOCUMENTS[1], DOCUMENTS[2]], use_tqdm=False)
        llm.engine.kv_manager.check_invariants()
    for out, document in zip(outs, DOCUMENTS):
        ids = tokenizer(QUERY, document)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            logit = model(torch.tensor([ids])).logits[0, 0].item()
        assert out.outputs.score == pytest.approx(1 / (1 + math.exp(-logit)), rel=1e-4, abs=1e-6)
    with torch.no_grad():
        second = model(torch.tensor([tokenizer(DOCUMENTS[0], DOCUMENTS[2])["input_ids"]])).logits[0, 0].item()
    assert pairs[1].outputs.score == pytest.approx(1 / (1 + math.exp(-second)), rel=1e-4, abs=1e-6)
    assert len({round(o.outputs.score, 6) for o in outs}) == len(DOCUMENTS)  # the pairs are told apart


def test_a_classifier_does_not_generate(classifier, tmp_path):
    path, _, _ = classifier
    with pytest.raises(ConfigError, match="--runner pooling"):
        LLM(str(path), max_model_len=256, num_kvcache_blocks=64)
    copy = shutil.copytree(path, tmp_path / "copy")
    with LLM(str(copy), runner="pooling", max_model_len=256, num_kvcache_blocks=64) as llm:
        with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
            llm.score([QUERY, QUERY], DOCUMENTS, use_tqdm=False)
