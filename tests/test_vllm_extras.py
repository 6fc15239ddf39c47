"""vLLM's request fields beyond OpenAI's, as its clients (RL and evaluation frameworks) use them,
through a real server and the official ``openai`` client's ``extra_body``."""

from __future__ import annotations

import httpx
import openai
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import TINY_MODEL_NAME, assert_error_shape, tokenize, wait_until_idle  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def detokenize(url: str, tokens: list[int]) -> str:
    return httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_completions_default_to_16_tokens(client):
    reply = client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


def test_return_token_ids_on_completions(client, tiny_server):
    kwargs = {"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
              "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    choice = client.completions.create(**kwargs).model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == tokenize(tiny_server.url, prompt=PROMPT)
    assert len(choice["token_ids"]) == 12
    assert detokenize(tiny_server.url, choice["token_ids"]) == choice["text"]
    chunks = [c.model_dump() for c in client.completions.create(stream=True, **kwargs)]
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])


def test_return_token_ids_on_chat(client, tiny_server):
    kwargs = {"model": TINY_MODEL_NAME, "messages": CHAT, "max_tokens": 10, "temperature": 0,
              "extra_body": {"return_token_ids": True, "ignore_eos": True}}
    reply = client.chat.completions.create(**kwargs).model_dump()
    assert reply["prompt_token_ids"] == tokenize(tiny_server.url, messages=CHAT)
    assert detokenize(tiny_server.url, reply["choices"][0]["token_ids"]) == reply["choices"][0]["message"]["content"]
    chunks = [c.model_dump() for c in client.chat.completions.create(stream=True, **kwargs)]
    assert chunks[0]["prompt_token_ids"] == reply["prompt_token_ids"]
    streamed = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]
    assert streamed == reply["choices"][0]["token_ids"]


def test_unasked_extras_are_null_in_whole_responses_and_absent_from_chunks(tiny_server):
    """As vLLM: a whole response carries its extras as null (clients read them as attributes); a stream's
    chunks leave them out."""
    url = tiny_server.url
    reply = httpx.post(f"{url}/v1/completions", json={"model": TINY_MODEL_NAME, "prompt": PROMPT,
                                                      "max_tokens": 2}).json()
    choice = reply["choices"][0]
    for key in ("token_ids", "prompt_token_ids", "prompt_logprobs", "stop_reason"):
        assert key in choice and choice[key] is None, key
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": TINY_MODEL_NAME, "messages": CHAT,
                                                          "max_tokens": 2}).json()
    assert chat["prompt_token_ids"] is None and chat["prompt_logprobs"] is None
    assert "token_ids" in chat["choices"][0] and chat["choices"][0]["token_ids"] is None
    assert "reasoning" in chat["choices"][0]["message"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    sdk = client.completions.create(model=TINY_MODEL_NAME, prompt=[1, 2, 3], max_tokens=2)
    assert sdk.choices[0].prompt_logprobs is None and sdk.choices[0].token_ids is None
    chunks = [c.model_dump() for c in client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                                                stream=True)]
    assert all({"token_ids", "prompt_token_ids", "prompt_logprobs"}.isdisjoint(c["choices"][0]) for c in chunks)
    chunks = [c.model_dump() for c in client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT,
                                                                     max_tokens=2, stream=True)]
    assert all("prompt_token_ids" not in c and "metrics" not in c for c in chunks)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_continuous_usage_stats_count_every_chunk(client, kind):
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = {"model": TINY_MODEL_NAME, "max_tokens": 9, "stream": True, "stream_options": options,
              "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=CHAT, **common))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **common))
    assert all(c.usage is not None for c in chunks)
    seen = 0
    for chunk in chunks[:-1]:
        seen += sum(len(choice.model_dump().get("token_ids") or []) for choice in chunk.choices)
        assert chunk.usage.completion_tokens == seen
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + seen
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == seen == 9


def test_continuous_usage_without_include_usage_is_no_usage(client):
    """As vLLM: continuous_usage_stats takes effect with include_usage only; alone it is accepted and adds nothing."""
    chunks = list(client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=3, stream=True,
                                            stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert chunks and all(c.usage is None and c.choices for c in chunks)


def test_tokenize_returns_token_strings(tiny_server):
    body = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert len(body["token_strs"]) == body["count"] == len(body["tokens"])
    assert body["token_strs"][-1] == "Ġis"  # as the vocabulary writes it (byte-level BPE)
    plain = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": PROMPT}).json()
    assert "token_strs" in plain and plain["token_strs"] is None  # as vLLM: null unless asked for


def test_allowed_token_ids_confine_every_sampled_token(client, tiny_server):
    allowed = tokenize(tiny_server.url, prompt=" cat dog bird fish", add_special_tokens=False)
    for temperature, seed in ((0, None), (1.0, 1), (1.0, 2)):
        choice = client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=24, seed=seed,
                                           temperature=temperature, extra_body={
                                               "allowed_token_ids": allowed, "return_token_ids": True,
                                               "ignore_eos": True}).model_dump()["choices"][0]
        assert len(choice["token_ids"]) == 24 and set(choice["token_ids"]) <= set(allowed)


@pytest.mark.parametrize("allowed", [[], [10**7], [-1]])
def test_bad_allowed_token_ids_are_400s(tiny_server, allowed):
    body = {"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "allowed_token_ids": allowed}
    error = assert_error_shape(httpx.post(f"{tiny_server.url}/v1/completions", json=body), 400)
    assert error["param"] == "allowed_token_ids"


def test_truncate_prompt_tokens_keeps_the_last_ones(client, tiny_server):
    long_prompt = "one two three four five six seven eight nine ten"
    ids = tokenize(tiny_server.url, prompt=long_prompt)
    reply = client.completions.create(model=TINY_MODEL_NAME, prompt=long_prompt, max_tokens=2, extra_body={
        "truncate_prompt_tokens": 4, "return_token_ids": True}).model_dump()
    assert reply["usage"]["prompt_tokens"] == 4 and reply["choices"][0]["prompt_token_ids"] == ids[-4:]
    chat = client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=2, extra_body={
        "truncate_prompt_tokens": 5, "return_token_ids": True}).model_dump()
    assert chat["prompt_token_ids"] == tokenize(tiny_server.url, messages=CHAT)[-5:]


def test_return_tokens_as_token_ids_in_logprobs(client):
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    choice = client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=5, logprobs=2,
                                       extra_body=extra).model_dump()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    chat = client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=5, logprobs=True,
                                          top_logprobs=2, extra_body=extra).model_dump()["choices"][0]
    assert [e["token"] for e in chat["logprobs"]["content"]] == [f"token_id:{t}" for t in chat["token_ids"]]


def test_continue_final_message_and_chat_echo(client, tiny_server):
    partial = CHAT + [{"role": "assistant", "content": "The capital of France is"}]
    ids = tokenize(tiny_server.url, messages=partial, add_generation_prompt=False, continue_final_message=True)
    text = detokenize(tiny_server.url, ids)
    assert text.endswith("The capital of France is")  # left open: no end-of-turn after it
    kwargs = {"model": TINY_MODEL_NAME, "messages": partial, "max_tokens": 4, "temperature": 0,
              "extra_body": {"continue_final_message": True, "add_generation_prompt": False, "echo": True,
                             "return_token_ids": True, "ignore_eos": True}}
    reply = client.chat.completions.create(**kwargs).model_dump()
    assert reply["prompt_token_ids"] == ids
    content = reply["choices"][0]["message"]["content"]
    assert content.startswith("The capital of France is") and len(content) > len("The capital of France is")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == content


@pytest.mark.parametrize("body,param", [
    ({"messages": CHAT, "continue_final_message": True, "add_generation_prompt": False}, "messages"),
    ({"messages": CHAT + [{"role": "assistant", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
])
def test_bad_continuations_are_400s(tiny_server, body, param):
    error = assert_error_shape(httpx.post(f"{tiny_server.url}/v1/chat/completions",
                                          json={"model": TINY_MODEL_NAME, "max_tokens": 2, **body}), 400)
    assert error["param"] == param


def test_load_counts_requests_in_flight(tiny_server):
    import threading
    import time

    url = tiny_server.url
    body = {"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
    replies = []
    worker = threading.Thread(target=lambda: replies.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                       timeout=120)))
    worker.start()
    seen = set()
    with httpx.Client(base_url=url, timeout=30) as poller:  # one connection: the polls take little from the server
        while worker.is_alive():
            seen.add(poller.get("/load").json()["server_load"])
            time.sleep(0.02)
    worker.join()
    assert replies[0].status_code == 200
    assert 1 in seen and seen <= {0, 1}  # while it ran, and only it
    assert httpx.get(f"{url}/load").json() == {"server_load": 0}


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_orca_load_report_header(tiny_server, fmt):
    body = {"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}
    for stream in (False, True):
        reply = httpx.post(f"{tiny_server.url}/v1/completions", json={**body, "stream": stream},
                           headers={"endpoint-load-metrics-format": fmt})
        report = reply.headers["endpoint-load-metrics"]
        if fmt == "text":
            assert report.startswith("TEXT named_metrics.kv_cache_usage_perc=")
            assert "named_metrics.num_requests_waiting=" in report
        else:
            import json

            assert report.startswith("JSON ")
            assert set(json.loads(report[5:])["named_metrics"]) >= {"kv_cache_usage_perc", "num_requests_waiting"}
    bad = httpx.post(f"{tiny_server.url}/v1/completions", json=body, headers={"endpoint-load-metrics-format": "xml"})
    assert assert_error_shape(bad, 400)["param"] == "endpoint-load-metrics-format"
    wait_until_idle(tiny_server.url)


def test_invocations_dispatches_on_the_body(tiny_server):
    url = f"{tiny_server.url}/invocations"
    chat = httpx.post(url, json={"model": TINY_MODEL_NAME, "messages": CHAT, "max_tokens": 2}).json()
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 2
    cmpl = httpx.post(url, json={"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}).json()
    assert cmpl["object"] == "text_completion"
    assert assert_error_shape(httpx.post(url, json={"model": TINY_MODEL_NAME}), 400)["param"] == "messages"
    bad = httpx.post(url, json={"prompt": PROMPT, "max_tokens": "many"})
    assert assert_error_shape(bad, 400)["param"] == "max_tokens"
    assert_error_shape(httpx.post(url, content=b"[1, 2]", headers={"content-type": "application/json"}), 400)


def test_unix_socket_and_root_path(tmp_path, tiny_model_path):
    from tests.server_helpers import start_server, tiny_server_args

    sock = tmp_path / "minivllm.sock"
    server = start_server(tmp_path, "uds", tiny_server_args(tiny_model_path) + ["--uds", str(sock),
                                                                               "--root-path", "/llm"])
    try:
        with server.client(timeout=30) as client:
            reply = client.post("/v1/completions", json={"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 2})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 2
            assert {"url": "/llm"} in client.get("/openapi.json").json()["servers"]
        assert "http+unix://" in server.log_path.read_text()
    finally:
        server.stop()


def test_tokenizer_info_describes_the_tokenizer(tiny_server, tiny_model_path):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model_path))
    info = httpx.get(f"{tiny_server.url}/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["vocab_size"] == len(tokenizer)
    assert info["chat_template"] == tokenizer.chat_template
    assert info["special_tokens"]["eos_token"] == tokenizer.eos_token


def test_a_bad_metrics_prefix_is_refused(tiny_model_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_path),
                           "--metrics-prefix", "9lives"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot start a Prometheus metric name" in proc.stderr


def test_beam_search_through_the_server_equals_transformers(client, tiny_server, tiny_model_path):
    import torch
    import transformers

    ids = tokenize(tiny_server.url, prompt=PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, num_beams=3,
                        num_return_sequences=3, max_new_tokens=8, eos_token_id=None, pad_token_id=0,
                        length_penalty=0.7)
    expected = [seq[len(ids):].tolist() for seq in hf]
    extra = {"use_beam_search": True, "length_penalty": 0.7, "ignore_eos": True, "return_token_ids": True}
    reply = client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, n=3, max_tokens=8,
                                      extra_body=extra).model_dump()
    assert [c["token_ids"] for c in reply["choices"]] == expected
    assert [c["text"] for c in reply["choices"]] == [detokenize(tiny_server.url, e) for e in expected]
    assert reply["usage"]["completion_tokens"] == 24
    chunks = [c.model_dump() for c in client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, n=3,
                                                                max_tokens=8, stream=True, extra_body=extra)]
    streamed = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert [streamed[i] for i in range(3)] == expected
    chat = client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, n=2, max_tokens=6,
                                          extra_body=extra).model_dump()
    assert len(chat["choices"]) == 2 and chat["choices"][0]["token_ids"] != chat["choices"][1]["token_ids"]
    wait_until_idle(tiny_server.url)


@pytest.mark.parametrize("body, param", [
    ({"use_beam_search": True, "n": 2, "temperature": 0.8}, "temperature"),
    ({"use_beam_search": True, "n": 2, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "n": 2, "logprobs": 1}, "logprobs"),
    ({"use_beam_search": True, "n": 2, "stop": ["x"]}, "stop"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"use_beam_search": True, "n": 16, "max_tokens": 4000}, "n"),  # 16 beams of 4000 tokens do not fit the pool
])
def test_beam_search_requests_that_cannot_be_honoured_are_400s(tiny_server, body, param):
    response = httpx.post(f"{tiny_server.url}/v1/completions",
                          json={"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, **body})
    assert assert_error_shape(response, 400)["param"] == param
