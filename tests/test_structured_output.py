"""Structured output through a real server: valid by construction, whichever way it is asked for."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    DEFAULT_MODEL_NAME,
    TINY_MODEL_NAME,
    assert_error_shape,
    start_server,
    tiny_server_args,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
# Every value is bounded, so even a random-weight model ends the object well within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def ahead_server(tmp_path_factory, tiny_model_path):
    """Overlapped steps and async scheduling (the CUDA defaults) forced on with the CPU."""
    server = start_server(tmp_path_factory.mktemp("servers"), "so-ahead",
                          tiny_server_args(tiny_model_path) + ["--overlap-steps", "--async-scheduling"])
    yield server
    server.stop()


def many(url: str, path: str, bodies: list[dict]) -> list[dict]:
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            responses = await asyncio.gather(*(client.post(path, json=b) for b in bodies))
        for r in responses:
            assert r.status_code == 200, r.text
        return [r.json() for r in responses]
    return asyncio.run(run())


@pytest.mark.parametrize("which", ["step_by_step", "planned_ahead"])
def test_json_schema_output_validates_for_every_random_request(which, tiny_server, ahead_server):
    url = (tiny_server if which == "step_by_step" else ahead_server).url
    bodies = [{"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": f"person {i}"}],
               "response_format": RESPONSE_FORMAT, "temperature": 1.0, "seed": i, "max_tokens": 300}
              for i in range(12)]
    # Half the batch unconstrained, running beside the constrained half.
    free = [{"model": TINY_MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40,
             "ignore_eos": True} for _ in range(6)]
    replies = many(url, CHAT, bodies + free)
    for reply in replies[:12]:
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert all(r["usage"]["completion_tokens"] == 40 for r in replies[12:])
    wait_until_idle(url)


def test_every_way_of_asking_on_completions(tiny_server):
    base = {"model": TINY_MODEL_NAME, "prompt": "Answer:", "temperature": 1.0, "max_tokens": 200}
    asks = {
        "structured_outputs.json": {"structured_outputs": {"json": SCHEMA}},
        "guided_json": {"guided_json": SCHEMA},
        "response_format": {"response_format": RESPONSE_FORMAT},
    }
    for name, ask in asks.items():
        text = many(tiny_server.url, CMPL, [{**base, **ask, "seed": 3}])[0]["choices"][0]["text"]
        jsonschema.validate(json.loads(text), SCHEMA), name
    choice = {"structured_outputs": {"choice": ["yes", "no", "maybe later"]}}
    for reply in many(tiny_server.url, CMPL, [{**base, **choice, "seed": s} for s in range(6)]):
        assert reply["choices"][0]["text"] in ("yes", "no", "maybe later")
    for reply in many(tiny_server.url, CMPL, [{**base, "guided_regex": r"[A-Z]{2}-\d{3}", "seed": s}
                                              for s in range(4)]):
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", reply["choices"][0]["text"])
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    text = many(tiny_server.url, CMPL, [{**base, "structured_outputs": {"grammar": grammar}, "seed": 1}])[0]
    assert re.fullmatch(r"\(\d(\+\d)*\)", text["choices"][0]["text"])
    json_object = many(tiny_server.url, CMPL, [{**base, "response_format": {"type": "json_object"}, "seed": 2,
                                                "max_tokens": 400}])[0]["choices"][0]
    if json_object["finish_reason"] == "stop":
        assert isinstance(json.loads(json_object["text"]), dict)


def test_a_streamed_json_schema_reassembles_to_valid_json(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=TINY_MODEL_NAME, messages=[{"role": "user", "content": "p"}],
                                            response_format=RESPONSE_FORMAT, stream=True, seed=5, max_tokens=300)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_max_tokens_mid_object_is_length(tiny_server):
    body = {"model": TINY_MODEL_NAME, "prompt": "x", "response_format": RESPONSE_FORMAT, "max_tokens": 3}
    choice = many(tiny_server.url, CMPL, [body])[0]["choices"][0]
    assert choice["finish_reason"] == "length"


STRICT_SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}


@pytest.mark.parametrize("ask", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": STRICT_SCHEMA}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": STRICT_SCHEMA,
                                                                "strict": False}}},
    {"structured_outputs": {"json": STRICT_SCHEMA}},
    {"guided_json": STRICT_SCHEMA},
], ids=["response_format", "response_format_strict_false", "structured_outputs", "guided_json"])
def test_every_json_schema_is_strict(tiny_server, tiny_model_path, ask):
    """As vLLM compiles them, whatever ``strict`` says: no keys beyond those the schema names. Every token
    that starts with a comma is pushed as hard as a bias goes, so any room for another key is taken."""
    import transformers

    vocab = transformers.AutoTokenizer.from_pretrained(str(tiny_model_path)).get_vocab()
    bias = {str(i): 100 for token, i in vocab.items() if token.startswith(",")}
    body = {"model": TINY_MODEL_NAME, "prompt": "x", "temperature": 0, "max_tokens": 60, "logit_bias": bias, **ask}
    choice = many(tiny_server.url, CMPL, [body])[0]["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert set(json.loads(choice["text"])) == {"a"}


class Capital(BaseModel):
    country: str
    capital: str


def test_the_sdk_parse_helper_returns_a_parsed_object(default_server):
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    completion = client.chat.completions.parse(
        model=DEFAULT_MODEL_NAME, temperature=0, max_tokens=60, response_format=Capital,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.country and parsed.capital


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_a_grammar_that_cannot_be_built_is_a_400(tiny_server, body, param):
    response = httpx.post(f"{tiny_server.url}{CMPL}", json={"model": TINY_MODEL_NAME, "prompt": "x", **body},
                          timeout=30)
    assert assert_error_shape(response, 400)["param"] == param


def test_logit_bias_forbids_and_forces_tokens(tiny_server):
    base = {"model": TINY_MODEL_NAME, "prompt": "hello there", "temperature": 0, "max_tokens": 1, "logprobs": 0}
    top = many(tiny_server.url, CMPL, [base])[0]["choices"][0]["logprobs"]["tokens"][0]
    tokenize = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": top, "add_special_tokens": False}).json()
    greedy_id = tokenize["tokens"][0]
    banned = many(tiny_server.url, CMPL, [{**base, "logit_bias": {str(greedy_id): -100}}])[0]
    assert banned["choices"][0]["logprobs"]["tokens"][0] != top
    forced = many(tiny_server.url, CMPL, [{**base, "max_tokens": 5, "logit_bias": {"1000": 100}}])[0]
    forced_id_text = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": [1000]}).json()["prompt"]
    assert forced["choices"][0]["logprobs"]["tokens"] == [forced_id_text] * 5
    error = assert_error_shape(httpx.post(f"{tiny_server.url}{CMPL}", json={**base, "logit_bias": {"x": 1}}), 400)
    assert error["param"] == "logit_bias"


def test_a_padded_vocabulary_never_samples_its_padding(tmp_path, default_model_path):
    """Checkpoints pad their embedding past the tokenizer (Qwen3: 151,936 rows, 151,669 tokens): the
    grammar covers the tokenizer's tokens and the padding ids are masked out."""
    from pathlib import Path

    from engine import LLM, SamplingParams
    from engine.sampling_params import StructuredOutputsParams
    from tests.server_helpers import build_tiny_model

    # No length-bounded strings: xgrammar lets raw control characters into them.
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "pet": {"enum": ["cat", "dog"]},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["age", "pet", "tags"], "additionalProperties": False}
    path = build_tiny_model(tmp_path / "padded", Path(default_model_path), pad_vocab=100)
    llm = LLM(str(path), max_model_len=512, num_kvcache_blocks=128)
    vocab = len(llm.tokenizer)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=300,
                             structured_outputs=StructuredOutputsParams(json=json.dumps(schema)))
              for seed in range(6)]
    for out in llm.generate(["person"] * len(params), params, use_tqdm=False):
        assert max(out.outputs[0].token_ids) < vocab
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
