"""One request must not stall or leak the server: bad values are 400s that leave nothing behind, limits are
checked before the work they bound, tokenizer work is bounded, and a request's images are bounded together.

"Before tokenizing" is made observable with a lone surrogate (``"\\ud800"``) at the start of the text: the
encoder refuses it with a Unicode error, so an answer about the count or the length shows the text never
reached it.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import httpx
import pytest
import torch
import transformers

pytest.register_assert_rewrite("tests.server_helpers")
from tests.helpers import SMALL_CONFIG, random_image  # noqa: E402
from tests.server_helpers import (  # noqa: E402
    assert_error_shape,
    scrape_metrics,
    start_server,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_MODEL_LEN = 1024  # the default_server's
SURROGATE = "\ud800"
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity. ")


@pytest.fixture(scope="module")
def http(default_server):
    with httpx.Client(base_url=default_server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return transformers.AutoTokenizer.from_pretrained(default_model_path)


def post_raw(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """JSON with every non-ASCII character escaped, so a lone surrogate travels as ``\\ud800``."""
    return http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def assert_nothing_left(server) -> None:
    """No request in flight (/load), no KV block held, and the server still answers."""
    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    metrics = wait_until_idle(server.url)
    assert metrics["minivllm:kv_cache_blocks_used"] == 0 and metrics["minivllm:num_requests_running"] == 0
    reply = httpx.post(f"{server.url}{CMPL}", json={"prompt": "Hello", "max_tokens": 2}, timeout=120)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("length", "stop")


# ---------------------------------------------------------------- values that reached msgspec or the tokenizer

IDS = [1, 2, 3]
BAD_VALUES = [
    ("stop_token_ids past uint64", CMPL, {"prompt": IDS, "stop_token_ids": [2**64]}, "stop_token_ids", "out-of-vocab"),
    ("stop_token_ids past the vocabulary", CMPL, {"prompt": IDS, "stop_token_ids": [49152]}, "stop_token_ids",
     "Vocabulary size: 49152"),
    ("a lone surrogate as stop", CMPL, {"prompt": "Hello", "stop": [SURROGATE]}, "stop", "not valid Unicode"),
    ("a lone surrogate as chat stop", CHAT, {"messages": [{"role": "user", "content": "hi"}], "stop": SURROGATE},
     "stop", "not valid Unicode"),
    ("superscript digit key", CMPL, {"prompt": "Hello", "logit_bias": {"²": 1}}, "logit_bias", "'²'"),
    ("Arabic-Indic digits key", CMPL, {"prompt": "Hello", "logit_bias": {"١٢": 1}}, "logit_bias", "'١٢'"),
    ("a key of 5000 digits", CMPL, {"prompt": "Hello", "logit_bias": {"9" * 5000: 1}}, "logit_bias",
     "cannot be converted"),
    ("logit_bias past the vocabulary", CMPL, {"prompt": "Hello", "logit_bias": {str(2**70): 1}}, "logit_bias",
     "out of range"),
    ("allowed_token_ids past int64", CMPL, {"prompt": "Hello", "allowed_token_ids": [2**70]}, "allowed_token_ids",
     "out of range"),
    ("prompt ids past int64", CMPL, {"prompt": [5, 2**70]}, "prompt", "out of range"),
    ("seed past int64", CMPL, {"prompt": "Hello", "seed": 2**64}, "seed", "less than or equal"),
    ("a lone surrogate in a choice", CMPL, {"prompt": "Hello", "guided_choice": ["a", SURROGATE]}, None,
     "cannot be sent to the engine"),
]


@pytest.mark.parametrize("name, path, body, param, says", BAD_VALUES, ids=[c[0] for c in BAD_VALUES])
def test_a_value_the_engine_cannot_take_is_a_400_that_leaves_nothing(default_server, http, name, path, body, param,
                                                                     says):
    for stream in (False, True):
        for _ in range(3):
            response = post_raw(http, path, {**body, "max_tokens": 2, "stream": stream})
            error = assert_error_shape(response, 400)
            assert error["param"] == param and says in error["message"], error
    assert_nothing_left(default_server)


def test_a_request_is_registered_only_once_it_was_encoded_and_sent():
    """AsyncEngine.generate on a socket that records (or refuses) what is sent: a request whose values cannot be
    encoded is a RequestError (a 400), one whose send fails raises; neither leaves a stream or a request behind."""
    from types import SimpleNamespace

    from engine.frontend.async_engine import AsyncEngine
    from engine.loading.model_info import RequestError
    from engine.sampling_params import SamplingParams

    sent = []

    class Inputs:
        refuse = False

        def send(self, frame, flags=0, copy=True):
            if self.refuse:
                raise RuntimeError("the socket is closed")
            sent.append(frame)

    sockets = SimpleNamespace(inputs=Inputs())
    engine = AsyncEngine(SimpleNamespace(max_num_seqs=4), None, None, None, None, None, sockets)
    with pytest.raises(RequestError, match="cannot be sent"):
        engine.generate("a", [[1, 2]], SamplingParams(stop=[SURROGATE]))
    with pytest.raises(RequestError, match="cannot be sent"):
        engine.generate("b", [[1, 2**64]], SamplingParams(n=2))
    sockets.inputs.refuse = True
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate("c", [[1, 2]], SamplingParams())
    assert engine.num_in_flight == 0 and len(engine.processor) == 0 and sent == []
    sockets.inputs.refuse = False
    engine.generate("d", [[1, 2]], SamplingParams(n=2))
    assert engine.num_in_flight == 1 and len(engine.processor) == 1 and len(sent) == 1


def test_outputs_the_server_cannot_handle_end_the_engine_loudly(caplog):
    """A step message the API server fails on (here: bytes that are no message) would end the task that reads the
    core's outputs; the engine is then marked dead with the reason logged, and every open stream fails at once
    instead of waiting for ever."""
    import asyncio
    from types import SimpleNamespace

    from engine.frontend.async_engine import AsyncEngine, EngineDeadError
    from engine.sampling_params import SamplingParams

    class Outputs:
        async def recv(self, copy=True):
            return SimpleNamespace(buffer=b"\xc1 not msgpack")

    sockets = SimpleNamespace(inputs=SimpleNamespace(send=lambda frame, flags=0, copy=True: None), outputs=Outputs())
    engine = AsyncEngine(SimpleNamespace(max_num_seqs=4), None, None, None, None, None, sockets)

    async def scenario():
        stream = engine.generate("a", [[1, 2]], SamplingParams(max_tokens=4))
        await engine._receive_outputs()
        with pytest.raises(EngineDeadError, match="could not handle the engine's outputs"):
            await stream.__anext__()

    asyncio.run(scenario())
    assert engine.dead_error is not None and engine.num_in_flight == 0
    assert "could not handle the engine's outputs" in caplog.text


def test_deeply_nested_json_is_a_400(default_server, http):
    deep = "[" * 10000 + "]" * 10000
    for path in ("/invocations", CMPL):
        response = http.post(path, content=b'{"prompt": ' + deep.encode() + b"}",
                             headers={"Content-Type": "application/json"})
        assert_error_shape(response, 400)
    assert_nothing_left(default_server)


# ------------------------------------------------------------------------ limits before the expensive work


def test_too_many_choices_are_refused_before_any_prompt_is_tokenized(http):
    prompts = [SURROGATE] + ["a"] * 300  # the first prompt alone would be refused by the encoder
    error = assert_error_shape(post_raw(http, CMPL, {"prompt": prompts, "max_tokens": 1}), 400)
    assert error["param"] == "n" and "301 prompts" in error["message"]


@pytest.mark.parametrize("path, body, param", [
    (CMPL, {"prompt": SURROGATE + TEXT * 2000, "max_tokens": 1}, "prompt"),
    (CMPL, {"prompt": ["short", SURROGATE + TEXT * 2000], "max_tokens": 1}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": SURROGATE + TEXT * 2000}], "max_tokens": 1}, "messages"),
    ("/tokenize", {"prompt": SURROGATE + TEXT * 2000}, "prompt"),
], ids=["completion", "one-of-several", "chat", "tokenize"])
def test_text_longer_than_the_context_can_hold_is_refused_before_tokenizing(http, tokenizer, path, body, param):
    """About 360,000 characters: the default server's context of 1024 tokens can span at most 1024 times the
    tokenizer's longest token."""
    longest = max(len(t) for t in tokenizer.get_vocab())
    error = assert_error_shape(post_raw(http, path, body), 400)
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    assert f"at most {MAX_MODEL_LEN * longest:,} characters" in error["message"]


def test_the_bound_admits_text_as_long_as_the_longest_tokens_allow(http, tokenizer):
    """The text of the vocabulary's longest token, repeated: as many characters per token as any text has, and
    it fits (a prompt the bound must not refuse)."""
    longest = max((t for t in tokenizer.get_vocab() if t.isascii() and t.isprintable()), key=len)
    text = tokenizer.convert_tokens_to_string([longest])
    count = len(tokenizer(text * 8, add_special_tokens=False)["input_ids"])
    repeats = 8 * (MAX_MODEL_LEN - 8) // count
    body = {"prompt": text * repeats, "max_tokens": 1, "return_token_ids": True}
    reply = http.post(CMPL, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["prompt_token_ids"] == tokenizer(text * repeats)["input_ids"]


def test_the_bound_follows_what_the_tokenizer_folds_or_drops():
    """The longest vocabulary entry bounds the characters per token, unless the normalizer folds a run of
    characters into fewer tokens (the bound takes that), or drops some altogether (then there is no bound)."""
    from server.text_bound import TextBound, max_chars_per_token

    class Tokenizer:
        def __init__(self, whitespace_per_token: int | None):
            self.per_token = whitespace_per_token

        def get_vocab(self):
            return {"ab": 0, "c": 1}

        def __call__(self, text, add_special_tokens=False):
            if text.isspace() or not text.isprintable():
                return {"input_ids": [] if self.per_token is None else [0] * -(-len(text) // self.per_token)}
            return {"input_ids": [0] * len(text)}

    assert max_chars_per_token(Tokenizer(1)) == 2
    assert max_chars_per_token(Tokenizer(128)) == 128
    assert max_chars_per_token(Tokenizer(None)) is None
    bound = TextBound.of(Tokenizer(None), 8)
    bound.check("x" * 10**6, "prompt")  # no bound: nothing refused
    assert bound.kept_text("x" * 10**6, 4) == "x" * 10**6
    bound = TextBound.of(Tokenizer(1), 8)
    assert bound.max_chars == 16
    with pytest.raises(Exception, match="16 characters"):
        bound.check("x" * 17, "prompt")


LONG_TEXT = TEXT * 2000  # about 90,000 tokens


@pytest.fixture(scope="module")
def long_text_ids(tokenizer) -> dict[str, list[int]]:
    """The tokens of LONG_TEXT whole, as a prompt and as a chat's one message, tokenized once for the module."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": LONG_TEXT}], add_generation_prompt=True,
                                             tokenize=False)
    return {"prompt": tokenizer(LONG_TEXT)["input_ids"],
            "chat": tokenizer(rendered, add_special_tokens=False)["input_ids"]}


@pytest.mark.parametrize("keep", [1, 16, 500])
def test_truncation_tokenizes_only_the_end_and_keeps_its_tokens(http, long_text_ids, keep):
    """A text far past the context with a lone surrogate at its start: with truncate_prompt_tokens it is
    answered (its start never reached the tokenizer), and the tokens kept are those of tokenizing it whole."""
    body = {"prompt": SURROGATE + LONG_TEXT, "max_tokens": 1, "truncate_prompt_tokens": keep,
            "return_token_ids": True}
    reply = post_raw(http, CMPL, body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["prompt_token_ids"] == long_text_ids["prompt"][-keep:]
    chat = {"messages": [{"role": "user", "content": SURROGATE + LONG_TEXT}], "max_tokens": 1,
            "truncate_prompt_tokens": keep, "return_token_ids": True}
    reply = post_raw(http, CHAT, chat)
    assert reply.status_code == 200, reply.text
    assert reply.json()["prompt_token_ids"] == long_text_ids["chat"][-keep:]


@pytest.mark.parametrize("keep", [1, 500])
def test_right_truncation_tokenizes_only_the_start_and_keeps_its_tokens(http, long_text_ids, keep):
    """truncation_side "right" keeps the first tokens: a lone surrogate at the end of a text far past the context
    never reaches the tokenizer, and the tokens kept are the first ones of tokenizing the text whole."""
    body = {"prompt": LONG_TEXT + SURROGATE, "max_tokens": 1, "truncate_prompt_tokens": keep,
            "truncation_side": "right", "return_token_ids": True}
    reply = post_raw(http, CMPL, body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["prompt_token_ids"] == long_text_ids["prompt"][:keep]


# ------------------------------------------------------------------------------------ tokenizer routes


def test_detokenize_takes_a_context_of_ids(http, tokenizer):
    ids = tokenizer(TEXT * 40)["input_ids"][:MAX_MODEL_LEN]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == tokenizer.decode(ids)
    error = assert_error_shape(http.post("/detokenize", json={"tokens": ids * 5000}), 400)
    assert error["param"] == "tokens" and f"at most {MAX_MODEL_LEN}" in error["message"]
    error = assert_error_shape(http.post("/detokenize", json={"tokens": [2**70]}), 400)
    assert error["param"] == "tokens"


def test_tokenize_returns_token_strings(http, tokenizer):
    reply = http.post("/tokenize", json={"prompt": TEXT * 20, "return_token_strs": True}).json()
    assert reply["tokens"] == tokenizer(TEXT * 20)["input_ids"]
    assert reply["token_strs"] == tokenizer.convert_ids_to_tokens(reply["tokens"])


# ------------------------------------------------------------------------------ a request's images


def png_declaring(width: int, height: int) -> str:
    """A PNG data URL whose header declares ``width`` x ``height`` pixels and whose data is a few bytes: opening
    it reads the size; decoding it fails (the data is truncated)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory, default_model_path):
    """A tiny random LLaVA (CLIP tower of 32x32 images) with the default model's tokenizer, the media flags at
    their defaults."""
    path = tmp_path_factory.mktemp("tiny-llava")
    tok = transformers.AutoTokenizer.from_pretrained(default_model_path)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    text = transformers.LlamaConfig(**{**SMALL_CONFIG, "vocab_size": -(-len(tok) // 64) * 64,
                                       "max_position_embeddings": 512})
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(path)
    template = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}{% if p['type'] == 'image' %}"
                "<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}assistant:")
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    transformers.LlavaProcessor(image_processor=processor, tokenizer=tok, patch_size=8, chat_template=template,
                                vision_feature_select_strategy="default",
                                num_additional_image_tokens=1).save_pretrained(path)
    server = start_server(tmp_path_factory.mktemp("servers"), "vision",
                          ["--model", str(path), "--max-model-len", "256", "--num-kvcache-blocks", "64",
                           "--kvcache-block-size", "8"])
    yield server
    server.stop()


def image_chat(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe."}]}],
            "max_tokens": 2}


def test_a_requests_images_are_bounded_together_before_any_is_decoded(vision_server):
    """Four 7000x7000 images (49 megapixels each, under the per-image 50) are 196 together, past the default 100:
    a 400 naming --max-request-megapixels, from their headers (decoding any would have failed: their data is
    truncated). One of them alone is decoded, and fails as corrupt. A real image is answered."""
    huge = png_declaring(7000, 7000)
    with vision_server.client(timeout=120) as http:
        error = assert_error_shape(http.post(CHAT, json=image_chat(huge, huge, huge, huge)), 400)
        assert error["param"] == "messages" and "--max-request-megapixels" in error["message"]
        assert "196,000,000 pixels" in error["message"]
        error = assert_error_shape(http.post(CHAT, json=image_chat(huge)), 400)
        assert error["param"] == "messages.0.content.0.image_url" and "corrupt" in error["message"]
        png = io.BytesIO()
        random_image(3, 40, 30).save(png, format="PNG")
        small = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        assert http.post(CHAT, json=image_chat(small, small)).status_code == 200
    assert httpx.get(f"{vision_server.url}/load").json() == {"server_load": 0}
    assert scrape_metrics(vision_server.url)["minivllm:num_requests_running"] == 0
