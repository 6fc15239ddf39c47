"""``POST /v1/embeddings``, ``/score``, ``/rerank`` and ``/pooling`` on real servers started with ``--runner pooling``:
the default model's embeddings (its last token's final hidden state, normalised) equal transformers' for text and
token ids, through the openai SDK (which asks for base64) and LangChain's ``OpenAIEmbeddings``, and score pairs by
their cosine; a tiny cross-encoder reranks as transformers scores; what a server cannot serve is a 400 in OpenAI's
shape."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.server_helpers import REPO_ROOT, assert_error_shape, scrape_metrics, start_server
from tests.test_cross_encoder import classifier  # noqa: F401  (the tiny reranker, a fixture)

TEXTS = ["The capital of France is Paris.", "Bonjour", "A paged KV cache holds every request's keys and values."]


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory, default_model_path):
    # float32 weights (the GGUF dequantized), as the transformers reference holds them
    server = start_server(tmp_path_factory.mktemp("servers"), "pooling",
                          ["--runner", "pooling", "--quantization", "none", "--num-kvcache-blocks", "64",
                           "--max-model-len", "512", "--served-model-name", "embedder"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(default_model_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path)
    model = transformers.AutoModel.from_pretrained(default_model_path, dtype=torch.float32).eval()

    def embed(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return F.normalize(model(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)

    return tokenizer, embed


def test_the_sdk_gets_transformers_embeddings_for_text_and_token_ids(embedding_server, reference):
    tokenizer, embed = reference
    client = openai.OpenAI(base_url=f"{embedding_server.url}/v1", api_key="none")
    response = client.embeddings.create(model="embedder", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in response.data] == [0, 1, 2]
    ids = [tokenizer.encode(text) for text in TEXTS]
    for data, prompt in zip(response.data, ids):
        torch.testing.assert_close(torch.tensor(data.embedding), embed(prompt), rtol=1e-4, atol=1e-4)
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    metrics = scrape_metrics(embedding_server.url)
    assert metrics["minivllm:prompt_tokens_total"] >= sum(map(len, ids))  # the prompts count in /metrics
    assert metrics["minivllm:generation_tokens_total"] == 0
    by_ids = client.embeddings.create(model="embedder", input=ids[0], encoding_format="float")
    torch.testing.assert_close(torch.tensor(by_ids.data[0].embedding), embed(ids[0]), rtol=1e-4, atol=1e-4)
    models = httpx.get(f"{embedding_server.url}/v1/models").json()["data"]
    assert models[0]["runner"] == "pooling"


def test_langchain_embeddings(embedding_server, reference):
    from langchain_openai import OpenAIEmbeddings

    tokenizer, embed = reference
    # check_embedding_ctx_length=False: send the text itself (the default sends tiktoken's ids, another vocabulary)
    lc = OpenAIEmbeddings(model="embedder", base_url=f"{embedding_server.url}/v1", api_key="none",
                          check_embedding_ctx_length=False)
    vectors = lc.embed_documents(TEXTS[:2])
    for vector, text in zip(vectors, TEXTS):
        torch.testing.assert_close(torch.tensor(vector), embed(tokenizer.encode(text)), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(lc.embed_query(TEXTS[0])), torch.tensor(vectors[0]))


def test_what_it_cannot_serve_is_a_400(embedding_server):
    url = embedding_server.url
    error = assert_error_shape(httpx.post(f"{url}/v1/embeddings", json={"input": "hi", "dimensions": 8}), 400)
    assert error["param"] == "dimensions" and "Matryoshka" in error["message"]
    assert assert_error_shape(httpx.post(f"{url}/v1/embeddings", json={"input": ""}), 400)["param"] == "input"
    assert_error_shape(httpx.post(f"{url}/v1/embeddings", json={"input": "hi", "encoding_format": "int8"}), 400)
    assert_error_shape(httpx.post(f"{url}/v1/embeddings", json={"input": "hi", "model": "other"}), 404)
    error = assert_error_shape(httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}]}), 400)
    assert "served for embeddings" in error["message"]


def test_score_rerank_and_pooling_with_an_embedding_model(embedding_server, reference):
    """An embedding model scores a pair by the cosine of the two texts' embeddings (vLLM's /score), reranks by it
    and answers /pooling with the embedding itself."""
    tokenizer, embed = reference
    url = embedding_server.url
    query, documents = TEXTS[0], TEXTS[1:]
    expected = [float(embed(tokenizer.encode(query)) @ embed(tokenizer.encode(d))) for d in documents]
    score = httpx.post(f"{url}/score", json={"text_1": query, "text_2": documents}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-4)
    assert score["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t)) for t in TEXTS)
    rerank = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": documents, "top_n": 1}).json()
    best = max(range(len(expected)), key=expected.__getitem__)
    assert [(r["index"], r["document"]["text"]) for r in rerank["results"]] == [(best, documents[best])]
    assert rerank["results"][0]["relevance_score"] == pytest.approx(expected[best], abs=1e-4)
    pooled = httpx.post(f"{url}/pooling", json={"input": [query]}).json()
    torch.testing.assert_close(torch.tensor(pooled["data"][0]["data"]), embed(tokenizer.encode(query)),
                               rtol=1e-4, atol=1e-4)
    assert_error_shape(httpx.post(f"{url}/score", json={"text_1": [query] * 3, "text_2": documents}), 400)
    assert_error_shape(httpx.post(f"{url}/rerank", json={"query": query, "documents": []}), 400)


def test_a_cross_encoder_reranks_over_http(classifier, tmp_path):
    """A classifier served with --runner pooling: /rerank orders the documents by transformers' sigmoid of the
    pair's logit; it embeds nothing (400) and generates nothing (400)."""
    path, model, tokenizer = classifier
    server = start_server(tmp_path, "reranker", ["--model", str(path), "--runner", "pooling",
                                                 "--num-kvcache-blocks", "64", "--max-model-len", "256"])
    try:
        query, documents = "What is the capital of France?", ["Berlin is in Germany.", "Paris is in France."]
        with torch.no_grad():
            logits = [model(torch.tensor([tokenizer(query, d)["input_ids"]])).logits[0, 0].item() for d in documents]
        expected = [1 / (1 + math.exp(-x)) for x in logits]
        rerank = httpx.post(f"{server.url}/rerank", json={"query": query, "documents": documents,
                                                          "return_documents": False}).json()
        order = sorted(range(2), key=lambda i: -expected[i])
        assert [r["index"] for r in rerank["results"]] == order
        assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx([expected[i] for i in order],
                                                                                  rel=1e-4)
        assert all(r["document"] is None for r in rerank["results"])
        assert "classifier" in assert_error_shape(httpx.post(f"{server.url}/v1/embeddings", json={"input": "x"}),
                                                  400)["message"]
        assert_error_shape(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}), 400)
    finally:
        server.stop()


def test_a_batch_embeds_as_each_input_alone_and_the_readme_example(embedding_server):
    url = embedding_server.url
    together = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}).json()["data"]
    for text, vector in zip(TEXTS, together):
        alone = httpx.post(f"{url}/v1/embeddings", json={"input": text}).json()["data"][0]["embedding"]
        torch.testing.assert_close(torch.tensor(vector["embedding"]), torch.tensor(alone), rtol=1e-5, atol=1e-6)
    (script,) = [block for block in re.findall(r"```python\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
                 if "client.embeddings.create(" in block]
    script = script.replace("http://localhost:8000", url).replace("SmolLM2-135M-Instruct", "embedder")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["2 576", "[1, 0]"]
