"""``POST /v1/embeddings`` on a real server started with ``--runner pooling``: the default model's embeddings (its
last token's final hidden state, normalised) equal transformers' for text and token ids, through the openai SDK
(which asks for base64) and LangChain's ``OpenAIEmbeddings``; what it cannot serve is a 400 in OpenAI's shape."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.server_helpers import assert_error_shape, start_server

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
