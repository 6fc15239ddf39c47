"""The default model behind a real server, driven by the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import transformers

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import DEFAULT_MODEL_NAME, scrape_metrics, wait_until_idle  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

MODEL = DEFAULT_MODEL_NAME
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(default_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return transformers.AutoTokenizer.from_pretrained(str(default_model_path))


def complete(client, prompt, **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def stream_completion_text(client, prompt, **kwargs) -> tuple[str, str | None]:
    text, finish_reason = "", None
    for chunk in complete(client, prompt, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason


def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


def test_chat_capital_of_france(client, tokenizer):
    response = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    expected_prompt = tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    assert response.usage.prompt_tokens == len(tokenizer(expected_prompt, add_special_tokens=False)["input_ids"])
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_content_parts_render_like_a_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    response = client.chat.completions.create(model=MODEL, messages=parts, temperature=0, max_tokens=30)
    assert response.choices[0].message.content == "The capital of France is Paris."


def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "Tell me a short story about a dragon."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=30,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize("prompt", [
    "The history of the Roman Empire",
    "日本語の文章と絵文字 😀 🎉 🚀: 東京は",  # kanji and emojis span several tokens each
])
def test_completion_stream_equals_non_stream(client, prompt):
    whole = complete(client, prompt, temperature=0, max_tokens=24)
    streamed, finish_reason = stream_completion_text(client, prompt, temperature=0, max_tokens=24)
    assert streamed == whole.choices[0].text
    assert finish_reason == whole.choices[0].finish_reason
    assert "\ufffd" not in streamed


def test_split_characters_are_never_emitted_half_done(client):
    prompt = "Write a short poem about the sea with emojis 🌊"
    chunks = list(complete(client, prompt, temperature=0, max_tokens=30, stream=True, logprobs=0))
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    assert any("\ufffd" in t for t in tokens), "expected some tokens that end inside a character"
    assert all("\ufffd" not in c.choices[0].text for c in chunks)


def test_usage_counts_prompt_tokens_like_the_tokenizer(client, tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog"
    response = complete(client, prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert response.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"


def test_repeated_long_prompt_hits_the_prefix_cache(client, default_server):
    prompt = "In a quiet village by the sea, " * 20
    first = complete(client, prompt, max_tokens=2, temperature=0)
    hits = scrape_metrics(default_server.url)["minivllm:prefix_cache_hits_total"]
    second = complete(client, prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 64
    found = scrape_metrics(default_server.url)["minivllm:prefix_cache_hits_total"] - hits
    assert 0 < found <= second.usage.prompt_tokens
    # The hits are in usage only with --enable-prompt-tokens-details, as in vLLM (tests/test_vllm_compat.py).
    assert second.usage.prompt_tokens_details is None


def test_stop_string_is_matched_and_not_emitted(client):
    prompt = "The history of the Roman Empire"
    reference = complete(client, prompt, temperature=0, max_tokens=30).choices[0].text
    stop = reference[12:20]  # a piece from the middle of the output: likely spans a token boundary
    expected = reference[: reference.index(stop)]
    whole = complete(client, prompt, temperature=0, max_tokens=30, stop=[stop, "@@never@@"])
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "stop"
    streamed, finish_reason = stream_completion_text(client, prompt, temperature=0, max_tokens=30, stop=stop)
    assert (streamed, finish_reason) == (expected, "stop")
    kept = complete(client, prompt, temperature=0, max_tokens=30, stop=stop,
                    extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop


def test_max_tokens_ends_with_length(client):
    response = complete(client, "Once upon a time", max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 7


def test_n_samples_and_multiple_prompts(client):
    prompts = ["Once upon a time", "The weather today"]
    kwargs = dict(n=3, max_tokens=8, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    response = complete(client, prompts, **kwargs)
    assert [c.index for c in response.choices] == list(range(6))
    assert response.usage.completion_tokens == 6 * 8
    texts = [c.text for c in response.choices]
    assert len(set(texts[:3])) > 1, "samples of one prompt should differ"
    streamed = {}
    for chunk in complete(client, prompts, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(6)] == texts


def test_seed_reproduces_across_batch_mates(client):
    kwargs = dict(max_tokens=12, temperature=1.0, seed=1234)
    alone = complete(client, "My favourite animal is", **kwargs).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(complete, client, f"Noise prompt {i}", max_tokens=12, temperature=1.0) for i in range(5)]
        crowded = pool.submit(complete, client, "My favourite animal is", **kwargs)
        assert crowded.result().choices[0].text == alone
        for f in noise:
            f.result()
    other = [complete(client, "My favourite animal is", **{**kwargs, "seed": s}).choices[0].text for s in (1, 2, 3)]
    assert any(text != alone for text in other)


def test_completion_logprobs(client):
    response = complete(client, "The capital of France is", max_tokens=6, temperature=0, logprobs=5,
                        extra_body={"ignore_eos": True})
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert logprob <= 0
        values = list(top.values())
        assert 1 <= len(values) <= 5 and values == sorted(values, reverse=True)
        assert logprob == pytest.approx(max(values), abs=1e-5)  # greedy picks the most likely token
        assert top.get(token) == pytest.approx(logprob, abs=1e-5)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=10,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert "".join(t.token for t in content).startswith(response.choices[0].message.content)
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)


def test_stream_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30,
                                                 stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 8  # "The capital of France is Paris." + <|im_end|>
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_sdk_raises_on_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, "hello", temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hello")


def test_no_blocks_held_afterwards(client, default_server):
    """Stop strings (whole and streamed), refused requests and n > 1 all release their blocks."""
    prompt = "The history of the Roman Empire"
    reference = complete(client, prompt, temperature=0, max_tokens=16).choices[0].text
    stop = reference[12:20]
    assert complete(client, prompt, temperature=0, max_tokens=16, stop=stop).choices[0].finish_reason == "stop"
    assert stream_completion_text(client, prompt, temperature=0, max_tokens=16, stop=stop)[1] == "stop"
    with pytest.raises(openai.BadRequestError):
        complete(client, prompt, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        complete(client, prompt, max_tokens=10**6)
    assert len(complete(client, prompt, n=3, max_tokens=4, temperature=1.0, seed=11).choices) == 3
    metrics = wait_until_idle(default_server.url, timeout_s=10)
    assert metrics["minivllm:num_requests_running"] == 0
    assert metrics["minivllm:kv_cache_blocks_used"] == 0


def test_generation_config_defaults_apply_and_requests_override(client):
    """The default model's generation config asks for temperature 0.2 and top_p 0.9 (its model card's)."""
    kwargs = dict(prompt="Once upon a time", max_tokens=20, seed=3)
    default = complete(client, **kwargs).choices[0].text
    assert default == complete(client, temperature=0.2, top_p=0.9, **kwargs).choices[0].text
    assert default != complete(client, temperature=1.0, top_p=1.0, **kwargs).choices[0].text
