"""``minivllm serve --speculative-config``: a real server speculating with n-gram proposals answers the openai SDK
with the tokens the engine gives without speculation, streamed or not; /metrics counts the proposals with vLLM's
names, and the dashboard shows their acceptance rate."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine import LLM, SamplingParams

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import start_server, wait_until_idle  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = "Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Copy: apple, banana,"


@pytest.fixture(scope="module")
def speculating(tmp_path_factory, default_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "speculating",
                          ["--num-kvcache-blocks", "128", "--max-model-len", "512", "--quantization", "none",
                           "--speculative-config", json.dumps(NGRAM)])
    yield server
    server.stop()


def test_completions_match_the_engine_without_speculation_and_metrics_count(speculating, default_model_path):
    client = openai.OpenAI(base_url=f"{speculating.url}/v1", api_key="none", max_retries=0, timeout=60)
    whole = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=32, temperature=0)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=32, temperature=0, stream=True))
    with LLM(max_model_len=512, quantization="none") as plain:
        expected = plain.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert whole.choices[0].text == streamed == expected[0].outputs[0].text
    wait_until_idle(speculating.url)
    metrics = httpx.get(f"{speculating.url}/metrics", timeout=10).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("minivllm:spec_decode")}
    assert values["minivllm:spec_decode_num_drafts_total"] > 0
    accepted, drafted = (values[f"minivllm:spec_decode_num_{name}_tokens_total"] for name in ("accepted", "draft"))
    assert 0 < accepted <= drafted
    assert values['minivllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    # The dashboard shows the same counters and the acceptance rate.
    spec = httpx.get(f"{speculating.url}/dashboard/snapshot", timeout=10).json()["spec_decode"]
    assert spec["num_accepted_tokens"] == accepted and spec["acceptance_rate"] == pytest.approx(accepted / drafted)


def test_logprobs_come_for_every_token_of_a_speculating_request(speculating):
    """A chat request asking for logprobs takes proposals like any other: streamed or not, its answer has one
    logprobs entry per token, each with its top 2, and they are the engine's without speculation."""
    client = openai.OpenAI(base_url=f"{speculating.url}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": PROMPT}]
    ask = dict(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24, temperature=0, logprobs=True,
               top_logprobs=2)
    metrics = lambda: httpx.get(f"{speculating.url}/metrics", timeout=10).text  # noqa: E731
    accepted = lambda text: sum(float(line.split()[1]) for line in text.splitlines()  # noqa: E731
                                if line.startswith("minivllm:spec_decode_num_accepted_tokens_total"))
    wait_until_idle(speculating.url)
    before = accepted(metrics())
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    wait_until_idle(speculating.url)
    assert accepted(metrics()) > before  # its proposals were accepted
    entries = whole.choices[0].logprobs.content
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in streamed]
    assert "".join(e.token for e in entries).startswith(whole.choices[0].message.content)  # (and its end token)
    assert all(len(e.top_logprobs) == 2 for e in entries)
    with LLM(max_model_len=512, quantization="none") as plain:
        prompt = plain.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, logprobs=2), use_tqdm=False)
    expected = out[0].outputs[0].logprobs
    assert len(entries) == len(expected)
    assert [e.logprob for e in entries] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
