"""Where vLLM's clients read fields by vLLM's names and shapes: reasoning, logprob entries, usage, token ids,
validation and metrics, through real servers and the official ``openai`` SDK (the shapes are those vLLM's own
entrypoint tests read)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    TINY_MODEL_NAME,
    assert_error_shape,
    build_tiny_model,
    start_server,
    tiny_server_args,
    tokenize,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


# ----------------------------------------------------------------------------- reasoning


@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory, default_model_path):
    model = build_tiny_model(tmp_path_factory.mktemp("qwen-style"), Path(default_model_path), qwen_style=True)
    server = start_server(tmp_path_factory.mktemp("servers"), "reasoning",
                          ["--model", str(model), "--served-model-name", "thinker", "--num-kvcache-blocks", "256",
                           "--max-model-len", "1024", "--reasoning-parser", "qwen3"])
    yield server
    server.stop()


def test_thinking_comes_as_reasoning_and_reasoning_content(reasoning_server):
    """vLLM 0.34 names the thinking ``reasoning``; clients written for older servers read ``reasoning_content``."""
    client = openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    # The template opens the thinking block in the prompt, so what the model writes first is thinking.
    kwargs = {"model": "thinker", "messages": CHAT, "max_tokens": 12, "temperature": 0,
              "extra_body": {"chat_template_kwargs": {"open_thinking": True}}}
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning and message.reasoning == message.reasoning_content
    streamed = {"reasoning": "", "reasoning_content": ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for name in streamed:
                streamed[name] += getattr(choice.delta, name, None) or ""
    assert streamed == {"reasoning": message.reasoning, "reasoning_content": message.reasoning}


# -------------------------------------------------------------- completions' logprob entries


def check_entries(logprobs, num_top: int, first_is_null: bool = False) -> None:
    """vLLM's completions logprobs: each position's ``top_logprobs`` entry holds its own token first (with its
    logprob), then the top N not already there."""
    tops = logprobs.top_logprobs
    assert len(tops) == len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset)
    if first_is_null:
        assert tops[0] is None and logprobs.token_logprobs[0] is None
        tops, tokens, values = tops[1:], logprobs.tokens[1:], logprobs.token_logprobs[1:]
    else:
        tokens, values = logprobs.tokens, logprobs.token_logprobs
    for top, token, value in zip(tops, tokens, values):
        assert max(num_top, 1) <= len(top) <= num_top + 1, top
        assert next(iter(top)) == token and top[token] == value


@pytest.mark.parametrize("num_top", [0, 3])
def test_completion_logprobs_name_the_chosen_token_first(client, num_top):
    kwargs = {"model": TINY_MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 7,
              "logprobs": num_top, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs).choices[0].logprobs
    check_entries(whole, num_top)
    assert len(whole.tokens) == 6
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)
                if c.choices[0].logprobs is not None]
    assert [t for lp in streamed for t in lp.top_logprobs] == whole.top_logprobs
    for logprobs in streamed:
        check_entries(logprobs, num_top)


@pytest.mark.parametrize("num_top", [0, 1])
@pytest.mark.parametrize("prompt", [PROMPT, [504, 3575, 282, 4649, 314]])
def test_echo_logprobs_hold_each_prompt_token(client, tiny_server, num_top, prompt):
    reply = client.completions.create(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                      logprobs=num_top, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = reply.choices[0]
    check_entries(choice.logprobs, num_top, first_is_null=True)
    ids = choice.prompt_token_ids + choice.token_ids
    assert len(choice.logprobs.tokens) == len(ids) == reply.usage.prompt_tokens + 4


# ------------------------------------------------------------------ validation as vLLM's


def test_unknown_fields_of_a_message_are_ignored_but_not_the_requests(client, tiny_server):
    plain = client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0)
    extra = [{**CHAT[0], "extra_field": "0", "refusal": None}]
    reply = client.chat.completions.create(model=TINY_MODEL_NAME, messages=extra, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert tokenize(tiny_server.url, messages=extra) == tokenize(tiny_server.url, messages=CHAT)
    error = assert_error_shape(httpx.post(f"{tiny_server.url}/v1/chat/completions", json={
        "model": TINY_MODEL_NAME, "messages": CHAT, "max_tokens": 1, "best_of": 2}), 400)
    assert error["param"] == "best_of"


def test_a_custom_role_reaches_the_template(client, tiny_server):
    text = [{"role": "my-custom-role", "content": "what is 1+1?"}]
    parts = [{"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}]
    ids = tokenize(tiny_server.url, messages=text)
    assert ids == tokenize(tiny_server.url, messages=parts)
    prompt = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "my-custom-role" in prompt
    kwargs = {"model": TINY_MODEL_NAME, "max_tokens": 5, "temperature": 0, "seed": 0}
    first = client.chat.completions.create(messages=text, **kwargs)
    assert first.choices[0].message.content == client.chat.completions.create(messages=parts, **kwargs)\
        .choices[0].message.content
    assert first.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_side_picks_the_end_kept(client, tiny_server, side):
    ids = list(range(100, 108))
    choice = client.completions.create(model=TINY_MODEL_NAME, prompt=ids, max_tokens=1, temperature=0, extra_body={
        "return_token_ids": True, "truncate_prompt_tokens": 4, "truncation_side": side}).choices[0]
    assert choice.prompt_token_ids == (ids[:4] if side == "right" else ids[-4:])
    whole = tokenize(tiny_server.url, messages=CHAT)
    chat = client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=1, extra_body={
        "return_token_ids": True, "truncate_prompt_tokens": 5, "truncation_side": side})
    assert chat.prompt_token_ids == (whole[:5] if side == "right" else whole[-5:])
    bad = httpx.post(f"{tiny_server.url}/v1/completions", json={"model": TINY_MODEL_NAME, "prompt": ids,
                                                                "truncate_prompt_tokens": 4, "truncation_side": "up"})
    assert assert_error_shape(bad, 400)["param"] == "truncation_side"


def test_error_messages_read_as_vllms(tiny_server):
    url = f"{tiny_server.url}/v1"
    body = {"model": TINY_MODEL_NAME, "max_tokens": 2}
    cmpl = httpx.post(f"{url}/completions", json={**body, "prompt": [999999]})
    assert "out of vocabulary" in assert_error_shape(cmpl, 400)["message"]
    for seed, words in ((-(2**63) - 1, "greater_than_equal"), (2**63, "less_than_equal")):
        error = assert_error_shape(httpx.post(f"{url}/chat/completions", json={**body, "messages": CHAT,
                                                                               "seed": seed}), 400)
        assert words in error["message"] and error["param"] == "seed"
    keys = assert_error_shape(httpx.post(f"{url}/chat/completions", json={
        **body, "messages": CHAT, "logit_bias": {"bad1": 50.0, "bad2": 20.0, "²": 1.0, "7": 1.0}}), 400)
    assert all(key in keys["message"] for key in ("bad1", "bad2", "²")) and keys["param"] == "logit_bias"
    value = assert_error_shape(httpx.post(f"{url}/chat/completions", json={
        **body, "messages": CHAT, "logit_bias": {"1": "not_a_number"}}), 400)
    assert "logit_bias" in value["message"]
    vocab = httpx.get(f"{tiny_server.url}/tokenizer_info").json()["vocab_size"]
    beyond = assert_error_shape(httpx.post(f"{url}/chat/completions", json={
        **body, "messages": CHAT, "logit_bias": {str(vocab + 1): 1.0}}), 400)
    assert str(vocab + 1) in beyond["message"] and str(vocab) in beyond["message"]
    wait_until_idle(tiny_server.url)


def test_usage_has_no_prompt_tokens_details_unless_enabled(client, tiny_server):
    reply = httpx.post(f"{tiny_server.url}/v1/completions", json={"model": TINY_MODEL_NAME, "prompt": PROMPT,
                                                                  "max_tokens": 2}).json()
    assert set(reply["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    chunks = list(client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details is None


# ----------------------------------------------------------- vLLM's flags and metric names


VLLM_FLAGS = ["--metrics-prefix", "vllm:", "--enable-prompt-tokens-details", "--return-tokens-as-token-ids",
              "--enable-per-request-metrics", "--max-num-seqs", "1", "--max-waiting-requests", "2",
              "--max-logprobs", "-1"]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, tiny_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "vllm-flags", tiny_server_args(tiny_model_path)
                          + VLLM_FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_client(vllm_server):
    return openai.OpenAI(base_url=f"{vllm_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def metric_totals(url: str) -> dict[str, float]:
    """Every sample of /metrics but histogram buckets, summed over its labels, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def wait_for(url: str, name: str, value: float, timeout_s: float = 30.0) -> None:
    """Poll /metrics until ``name`` reads ``value`` (the engine's snapshot is refreshed as it steps)."""
    import time

    deadline = time.monotonic() + timeout_s
    while metric_totals(url).get(name) != value:
        assert time.monotonic() < deadline, f"{name} never read {value}"
        time.sleep(0.05)


# vLLM's own test lists these (its EXPECTED_METRICS_V1, as sample names).
VLLM_SAMPLES = [
    "num_requests_running", "num_requests_waiting", "num_requests_waiting_by_reason", "kv_cache_usage_perc",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total", "admission_rejections_total",
    "prompt_tokens_total", "generation_tokens_total", "cache_config_info", "request_success_total",
    *(f"{histogram}_{part}" for part in ("sum", "bucket", "count") for histogram in (
        "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens", "request_params_n",
        "request_params_max_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds", "request_inference_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds", "request_num_preemptions")),
]


def test_every_metric_vllms_clients_read_is_exported(vllm_client, vllm_server):
    vllm_client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=3)
    text = httpx.get(f"{vllm_server.url}/metrics").text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert not any(name.startswith("minivllm:") for name in names)
    missing = [sample for sample in VLLM_SAMPLES if f"vllm:{sample}" not in names]
    assert not missing
    # --num-kvcache-blocks 2048 (one the reserved null block) of 16 tokens; contexts of 4096 tokens.
    assert ('vllm:cache_config_info{block_size="16",cache_dtype="auto",kv_cache_max_concurrency="8.00",'
            'kv_cache_size_tokens="32752",num_gpu_blocks="2047"} 1.0') in text
    assert 'vllm:admission_rejections_total{reason="max_num_queued_tokens"} 0.0' in text


def test_metric_counts_follow_vllms_arithmetic(vllm_server):
    """vLLM's test: 10 requests of a 10-token prompt and 10 generated tokens each. A step counts the prompt tokens
    it computed for the requests that got their first token plus the tokens it generated, so each request adds
    10 + 10 tokens over 10 steps."""
    url, num_requests, max_tokens = vllm_server.url, 10, 10
    prompt = list(range(1000, 1010))  # less than a block: nothing of it is found in the prefix cache
    before = metric_totals(url)
    for _ in range(num_requests):
        reply = httpx.post(f"{url}/v1/completions", json={"model": TINY_MODEL_NAME, "prompt": prompt,
                                                          "max_tokens": max_tokens, "ignore_eos": True}, timeout=60)
        assert reply.json()["usage"]["completion_tokens"] == max_tokens
    after = metric_totals(url)
    expected = {
        "time_to_first_token_seconds_count": num_requests,
        "inter_token_latency_seconds_count": num_requests * (max_tokens - 1),
        "e2e_request_latency_seconds_count": num_requests, "request_queue_time_seconds_count": num_requests,
        "request_inference_time_seconds_count": num_requests, "request_prefill_time_seconds_count": num_requests,
        "request_decode_time_seconds_count": num_requests, "request_num_preemptions_count": num_requests,
        "request_num_preemptions_sum": 0,
        "request_prompt_tokens_sum": num_requests * len(prompt), "request_prompt_tokens_count": num_requests,
        "request_generation_tokens_sum": num_requests * max_tokens, "request_generation_tokens_count": num_requests,
        "request_params_n_sum": num_requests, "request_params_n_count": num_requests,
        "request_params_max_tokens_sum": num_requests * max_tokens, "request_params_max_tokens_count": num_requests,
        "iteration_tokens_total_sum": num_requests * (len(prompt) + max_tokens),
        "iteration_tokens_total_count": num_requests * max_tokens,
        "prompt_tokens_total": num_requests * len(prompt), "generation_tokens_total": num_requests * max_tokens,
        "request_success_total": num_requests,
    }
    deltas = {name: after[f"vllm:{name}"] - before.get(f"vllm:{name}", 0.0) for name in expected}
    assert deltas == expected


def test_a_full_waiting_queue_counts_admission_rejections(vllm_server):
    url = vllm_server.url
    body = {"model": TINY_MODEL_NAME, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    before = metric_totals(url).get("vllm:admission_rejections_total", 0.0)
    with httpx.Client(base_url=url, timeout=60) as http:
        streams = [http.send(http.build_request("POST", "/v1/completions", json={**body, "prompt": "a"}), stream=True)]
        try:
            wait_for(url, "vllm:num_requests_running", 1)  # --max-num-seqs 1: the others wait
            for prompt in ("b", "c"):
                streams.append(http.send(http.build_request("POST", "/v1/completions",
                                                            json={**body, "prompt": prompt}), stream=True))
            wait_for(url, "vllm:num_requests_waiting", 2)
            refused = http.post("/v1/completions", json={**body, "stream": False, "prompt": "d"})
            assert_error_shape(refused, 503)
            assert all(s.status_code == 200 for s in streams)
        finally:
            for stream in streams:
                stream.close()
    assert metric_totals(url)["vllm:admission_rejections_total"] - before == 1
    wait_for(url, "vllm:num_requests_running", 0)
    wait_for(url, "vllm:num_requests_waiting", 0)


def test_prompt_tokens_details_report_prefix_cache_hits(vllm_client):
    prompt = "In a quiet village by the sea, " * 12
    first = vllm_client.completions.create(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=2)
    second = vllm_client.completions.create(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens > 64
    assert 0 < second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens
    chunks = list(vllm_client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=2,
                                                      stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details is not None


def test_the_server_flag_names_logprob_tokens_by_id(vllm_client):
    kwargs = {"model": TINY_MODEL_NAME, "prompt": "Say 'Hello, world! 🎉'", "echo": True, "temperature": 0,
              "max_tokens": 6, "logprobs": 1}
    choice = vllm_client.completions.create(**kwargs, extra_body={"return_token_ids": True}).choices[0]
    tokens = choice.logprobs.tokens
    assert tokens == [f"token_id:{t}" for t in choice.prompt_token_ids + choice.token_ids]
    assert tokens[1:] == [next(iter(top)) for top in choice.logprobs.top_logprobs[1:]]
    chat = vllm_client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=4, logprobs=True)
    assert all(entry.token.startswith("token_id:") for entry in chat.choices[0].logprobs.content)
    # A request's own field wins over the flag.
    texts = vllm_client.completions.create(**kwargs, extra_body={"return_tokens_as_token_ids": False}).choices[0]
    assert not any(t.startswith("token_id:") for t in texts.logprobs.tokens) and texts.logprobs.tokens[0] == "Say"


TIMINGS = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}


def test_per_request_metrics_in_responses_and_usage_chunks(vllm_client):
    reply = vllm_client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_completion_tokens=4,
                                                temperature=0, extra_body={"min_tokens": 4})
    metrics = reply.model_extra["metrics"]
    assert metrics.keys() == TIMINGS and all(value >= 0 for value in metrics.values())
    cmpl = vllm_client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert cmpl.model_extra["metrics"].keys() == TIMINGS
    chunks = list(vllm_client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_completion_tokens=1,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"min_tokens": 1}))
    assert len(chunks) > 1
    for chunk in chunks[:-1]:
        assert chunk.usage is None and "metrics" not in (chunk.model_extra or {})
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 1
    assert last.model_extra["metrics"].keys() == TIMINGS - {"mean_itl_ms"}  # one token: no inter-token latency
    # Several choices are not one stream's timings: none.
    several = vllm_client.completions.create(model=TINY_MODEL_NAME, prompt=[PROMPT, "Hello"], max_tokens=2)
    assert several.model_extra["metrics"] is None


def test_force_include_usage_puts_usage_on_every_chunk(tmp_path, tiny_model_path):
    server = start_server(tmp_path, "forced-usage", tiny_server_args(tiny_model_path)
                          + ["--enable-force-include-usage"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for chunks in (list(client.completions.create(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=3,
                                                      stream=True, extra_body={"ignore_eos": True})),
                       list(client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=3,
                                                           stream=True, extra_body={"ignore_eos": True}))):
            assert all(chunk.usage is not None for chunk in chunks)
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
            assert [c.usage.completion_tokens for c in chunks] == sorted(c.usage.completion_tokens for c in chunks)
    finally:
        server.stop()


# ------------------------------------------------------------------------ logprob_token_ids


NAMED = [100, 1000, 5000]


def as_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


def test_logprob_token_ids_are_the_models_logprobs(client, tiny_server, tiny_model_path):
    """At each generated position: the sampled token and the named ones, with the model's own logprobs (those of
    transformers' forward pass over the same tokens), whatever logprobs asks for."""
    import torch
    import transformers

    prompt = tokenize(tiny_server.url, prompt=PROMPT)
    extra = {"logprob_token_ids": NAMED, "return_token_ids": True, "return_tokens_as_token_ids": True,
             "ignore_eos": True}
    choice = client.completions.create(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                       logprobs=5, extra_body=extra).choices[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([prompt + choice.token_ids])).logits[0].log_softmax(-1)
    assert [as_id(t) for t in choice.logprobs.tokens] == choice.token_ids
    for position, (token, top) in enumerate(zip(choice.logprobs.tokens, choice.logprobs.top_logprobs)):
        row = expected[len(prompt) - 1 + position]
        assert next(iter(top)) == token and {as_id(key) for key in top} == {as_id(token), *NAMED}
        for key, value in top.items():
            assert value == pytest.approx(row[as_id(key)].item(), abs=1e-4)
    streamed = [top for chunk in client.completions.create(model=TINY_MODEL_NAME, prompt=prompt, max_tokens=3,
                                                           temperature=0, logprobs=5, stream=True, extra_body=extra)
                if chunk.choices[0].logprobs for top in chunk.choices[0].logprobs.top_logprobs]
    assert streamed == choice.logprobs.top_logprobs


@pytest.mark.parametrize("named, sampled", [([5000], 42), (NAMED, 42), (NAMED, 5000)])
def test_logprob_token_ids_on_chat(client, named, sampled):
    """vLLM's test: the sampled token (forced with allowed_token_ids) and the named ones, each once, finite."""
    kwargs = {"model": TINY_MODEL_NAME, "messages": CHAT, "max_tokens": 1, "temperature": 0, "logprobs": True,
              "extra_body": {"logprob_token_ids": named, "allowed_token_ids": [sampled],
                             "return_tokens_as_token_ids": True}}
    content = client.chat.completions.create(top_logprobs=3, **kwargs).choices[0].logprobs.content[0]
    ids = [as_id(entry.token) for entry in content.top_logprobs]
    assert as_id(content.token) == sampled and ids[0] == sampled
    assert set(ids) == {*named, sampled} and len(ids) == len(set(ids))
    assert all(-1e4 < entry.logprob <= 0 for entry in content.top_logprobs)
    streamed = [as_id(entry.token) for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs
                for content in chunk.choices[0].logprobs.content for entry in content.top_logprobs]
    assert set(streamed) == {*named, sampled}


@pytest.mark.parametrize("endpoint, extra, words", [
    ("completions", {}, "`logprobs` must be set."),
    ("chat", {}, "`logprobs` must be set to true."),
    ("completions", {"logprobs": 1, "use_beam_search": True, "n": 2}, "not supported with beam search"),
    ("completions", {"logprobs": 1, "logprob_token_ids": list(range(129))}, "1 to 128"),
    ("chat", {"logprobs": True, "logprob_token_ids": [10**6]}, "out of vocabulary"),
])
def test_bad_logprob_token_ids_are_400s(tiny_server, endpoint, extra, words):
    body = {"model": TINY_MODEL_NAME, "max_tokens": 2, "logprob_token_ids": [5000], **extra}
    body.update({"messages": CHAT} if endpoint == "chat" else {"prompt": PROMPT})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    error = assert_error_shape(httpx.post(f"{tiny_server.url}{path}", json=body), 400)
    assert error["param"] == "logprob_token_ids" and words in error["message"]


# ---------------------------------------------------------------------------- prompt_embeds


def test_prompt_embeds_are_refused_with_vllms_words(client):
    import base64
    import io

    import torch

    with pytest.raises(openai.BadRequestError, match="Either prompt or prompt_embeds must be provided and non-empty."):
        client.completions.create(model=TINY_MODEL_NAME, prompt=None, max_tokens=2, extra_body={"prompt_embeds": []})
    with pytest.raises(openai.BadRequestError, match="Either prompt or prompt_embeds must be provided"):
        client.completions.create(model=TINY_MODEL_NAME, prompt="", max_tokens=2)
    buffer = io.BytesIO()
    torch.save(torch.zeros(3, 64), buffer)
    embeds = base64.b64encode(buffer.getvalue()).decode()
    for given in (embeds, [embeds]):
        with pytest.raises(openai.BadRequestError, match="prompt_embeds are not supported") as refused:
            client.completions.create(model=TINY_MODEL_NAME, prompt=None, max_tokens=2,
                                      extra_body={"prompt_embeds": given})
        assert refused.value.body["param"] == "prompt_embeds"
    # An empty list gives no embeddings: the prompt is served (as vLLM does).
    assert client.completions.create(model=TINY_MODEL_NAME, prompt="Hello", max_tokens=2,
                                     extra_body={"prompt_embeds": []}).choices[0].finish_reason is not None


def test_enable_prompt_embeds_is_refused_at_start_up(tiny_model_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_path),
                           "--enable-prompt-embeds"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not take prompt embeddings" in proc.stderr


def test_whole_vocabulary_logprobs_are_bounded_and_said_at_start_up(vllm_client, vllm_server):
    vocab = httpx.get(f"{vllm_server.url}/tokenizer_info").json()["vocab_size"]
    assert "a response carries at most 1048576 logprob entries" in vllm_server.log_path.read_text()
    short = vllm_client.completions.create(model=TINY_MODEL_NAME, prompt=[1000, 1001, 1002], max_tokens=1,
                                           extra_body={"prompt_logprobs": -1})
    assert [len(entry) for entry in short.choices[0].prompt_logprobs[1:]] == [vocab, vocab]
    chat = vllm_client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, max_tokens=1, logprobs=True,
                                               top_logprobs=-1)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == vocab
    # 40 prompt tokens of the whole vocabulary: some 2 million entries, past the bound of 2**20.
    with pytest.raises(openai.BadRequestError, match="logprob entries") as refused:
        vllm_client.completions.create(model=TINY_MODEL_NAME, prompt=list(range(1000, 1040)), max_tokens=1,
                                       extra_body={"prompt_logprobs": -1})
    assert refused.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError, match="max_tokens") as refused:  # the rest of the context, each
        vllm_client.chat.completions.create(model=TINY_MODEL_NAME, messages=CHAT, logprobs=True, top_logprobs=-1)
    assert refused.value.body["param"] == "logprobs"


def test_the_logprob_entry_bound_is_a_flag_and_0_lifts_it():
    """--max-logprob-entries sets the bound (a 400 past it, naming the flag); 0 lifts it, as vLLM has none."""
    from types import SimpleNamespace

    from engine.sampling_params import SamplingParams
    from server.cli import build_parser, limits_from_args
    from server.errors import APIError
    from server.serving import check_logprob_entries

    def limits(*flags):
        return limits_from_args(build_parser().parse_args(["serve", *flags]))

    assert limits().max_logprob_entries == 2**20
    assert limits("--max-logprob-entries", "1000").max_logprob_entries == 1000
    assert limits("--max-logprob-entries", "0").max_logprob_entries is None
    info = SimpleNamespace(vocab_size=49152, max_model_len=2048)
    whole = SamplingParams(max_tokens=1, prompt_logprobs=-1)
    check_logprob_entries([40], whole, info, None)  # 39 positions x 49,153 entries: no bound, no refusal
    with pytest.raises(APIError, match="--max-logprob-entries") as refused:
        check_logprob_entries([40], whole, info, 2**20)
    assert refused.value.param == "prompt_logprobs"
    check_logprob_entries([3], whole, info, 2**20)
