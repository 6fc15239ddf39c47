"""Scoring through the server, as evaluation harnesses do it: ``echo`` with ``logprobs`` on completions and
vLLM's ``prompt_logprobs``, against a float32 transformers forward pass, on the default model and a tiny one. The
default model is served dequantized to float32 here (``--quantization none``), as transformers reads its directory:
unset, its Q4_1 blocks multiply in bfloat16, which moves logprobs by more than float32's 1e-4."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
import transformers

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import DEFAULT_MODEL_NAME, TINY_MODEL_NAME, assert_error_shape, start_server  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

TEXT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def float32_default_server(tmp_path_factory, default_model_path):
    """The default model with ``--quantization none``, otherwise as the shared default server but for
    ``--max-logprobs -1`` (no bound on the logprobs a request may ask for)."""
    server = start_server(tmp_path_factory.mktemp("servers"), "default-float32",
                          ["--num-kvcache-blocks", "256", "--max-model-len", "1024", "--quantization", "none",
                           "--max-logprobs", "-1"])
    yield server
    server.stop()


@pytest.fixture(scope="module", params=["tiny", "default"])
def served(request, tiny_model_path, default_model_path):
    """(server, its model name, its checkpoint, a float32 transformers model of it)."""
    if request.param == "tiny":
        server, name, path = request.getfixturevalue("tiny_server"), TINY_MODEL_NAME, tiny_model_path
    else:
        server, name, path = request.getfixturevalue("float32_default_server"), DEFAULT_MODEL_NAME, default_model_path
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return server, name, model


def reference(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab] log-probabilities: row i scores token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)[:-1]


def tokenize(url: str, **body) -> list[int]:
    return httpx.post(f"{url}/tokenize", json=body).json()["tokens"]


def test_echo_with_logprobs_scores_every_prompt_token(served):
    """What lm-evaluation-harness sends for a log-likelihood: token ids of context + continuation, echo,
    logprobs=1, one new token; it sums ``token_logprobs[ctxlen:-1]`` and checks each token is the top one."""
    server, name, model = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    ids = tokenize(server.url, prompt=TEXT)
    ref = reference(model, ids)
    reply = client.completions.create(model=name, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = reply.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert lp.token_logprobs[1:-1] == pytest.approx(expected, abs=1e-4)
    ctxlen = len(tokenize(server.url, prompt="The capital of France is Paris. The capital of Italy is"))
    assert sum(lp.token_logprobs[ctxlen:-1]) == pytest.approx(sum(expected[ctxlen - 1:]), abs=1e-3)
    greedy = [ids[i + 1] == int(ref[i].argmax()) for i in range(len(ids) - 1)]
    tops = [max(top, key=top.get) for top in lp.top_logprobs[1:-1]]
    assert [tok == top for tok, top in zip(lp.tokens[1:-1], tops)] == greedy
    assert reply.choices[0].text.startswith(TEXT)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # The same in a stream: the prompt's entries come with the first chunk.
    chunks = list(client.completions.create(model=name, prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                            temperature=0, stream=True))
    streamed = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_prompt_logprobs_on_completions_and_chat(served):
    server, name, model = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    ids = tokenize(server.url, prompt=TEXT)
    ref = reference(model, ids)
    choice = client.completions.create(model=name, prompt=TEXT, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 3}).model_dump()["choices"][0]
    check_prompt_logprobs(choice["prompt_logprobs"], ids, ref, 3)
    chat_ids = tokenize(server.url, messages=CHAT)
    reply = client.chat.completions.create(model=name, messages=CHAT, max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 0}).model_dump()
    check_prompt_logprobs(reply["prompt_logprobs"], chat_ids, reference(model, chat_ids), 0)
    # prompt_logprobs=0 also streams: the prompt tokens' own entries come once, with the first token.
    chunks = [c.model_dump() for c in client.chat.completions.create(
        model=name, messages=CHAT, max_tokens=3, temperature=0, stream=True, extra_body={"prompt_logprobs": 0})]
    carried = [c["prompt_logprobs"] for c in chunks if c.get("prompt_logprobs") is not None]
    assert carried == [reply["prompt_logprobs"]]


def rank_bounds(row: torch.Tensor, token: int, eps: float = 1e-4) -> tuple[int, int]:
    """The rank of ``token`` in ``row``, as a range: tokens within ``eps`` of it may fall either side (the
    tail of a vocabulary holds near-ties that float rounding orders differently)."""
    return int((row > row[token] + eps).sum()) + 1, int((row > row[token] - eps).sum()) + 1


def check_prompt_logprobs(entries, ids, ref, num_top):
    assert len(entries) == len(ids) and entries[0] is None
    for pos, entry in enumerate(entries[1:], start=1):
        row, token = ref[pos - 1], ids[pos]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert rank_bounds(row, token)[0] <= own["rank"] <= rank_bounds(row, token)[1]
        top = row.topk(num_top).indices.tolist() if num_top else []
        assert set(entry) == {str(t) for t in top} | {str(token)}
        assert [entry[str(t)]["rank"] for t in top] == list(range(1, num_top + 1))
        assert isinstance(own["decoded_token"], str)


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {"prompt": "Hi", "prompt_logprobs": -1, "stream": True}, "prompt_logprobs"),
    ("completions", {"prompt": "Hi", "prompt_logprobs": -2}, "prompt_logprobs"),
    ("completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),  # more than --max-logprobs
    ("completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
])
def test_logprob_requests_the_server_cannot_honour_are_400s(tiny_server, path, body, param):
    response = httpx.post(f"{tiny_server.url}/v1/{path}", json={"model": TINY_MODEL_NAME, "max_tokens": 2, **body})
    assert assert_error_shape(response, 400)["param"] == param


def test_the_whole_vocabulary_with_max_logprobs_unlimited(float32_default_server):
    """--max-logprobs -1 lets -1 ask for every token's logprob, as vLLM's."""
    url = float32_default_server.url
    vocab = httpx.get(f"{url}/tokenizer_info").json()["vocab_size"]
    ids = tokenize(url, prompt="The capital")
    reply = httpx.post(f"{url}/v1/completions", json={
        "model": DEFAULT_MODEL_NAME, "prompt": ids, "max_tokens": 1, "prompt_logprobs": -1}, timeout=60).json()
    assert [len(e) for e in reply["choices"][0]["prompt_logprobs"][1:]] == [vocab] * (len(ids) - 1)
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "model": DEFAULT_MODEL_NAME, "messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": -1},
        timeout=60).json()
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == vocab
