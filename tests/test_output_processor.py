"""The one output processor (n fan-out, detokenization, stop strings, logprobs), driven with hand-built
engine outputs, and the offline ``LLM`` against a real server: the same requests give the same text,
tokens and finish reasons on both paths."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import transformers

pytest.register_assert_rewrite("tests.server_helpers")
from engine import LLM, SamplingParams  # noqa: E402
from engine.frontend.async_engine import RequestStream  # noqa: E402
from engine.frontend.output_processor import ChoiceDelta, OutputProcessor  # noqa: E402
from engine.outputs import EngineOutput, FinishReason, Logprobs  # noqa: E402
from tests.server_helpers import DEFAULT_MODEL_NAME  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return transformers.AutoTokenizer.from_pretrained(str(default_model_path))


class Sink:
    def __init__(self):
        self.deltas: list[ChoiceDelta] = []

    def put(self, delta: ChoiceDelta) -> None:
        self.deltas.append(delta)

    def text(self, index: int) -> str:
        return "".join(d.text for d in self.deltas if d.index == index)

    def finish(self, index: int):
        return [(d.finish_reason, d.stop_reason) for d in self.deltas if d.index == index and d.finish_reason][-1]


def feed(processor: OutputProcessor, child_id: str, token_ids: list[int], last: EngineOutput | None = None):
    """One engine output per token; ``last`` replaces the final one (to finish the request)."""
    to_abort = []
    for i, token_id in enumerate(token_ids):
        out = EngineOutput(child_id, [token_id], num_prompt_tokens=3)
        if last is not None and i == len(token_ids) - 1:
            out = last
        to_abort += processor.process([out])
    return to_abort


def test_fan_out_gives_each_choice_its_id_seed_and_index(tokenizer):
    processor = OutputProcessor(tokenizer)
    sink = Sink()
    state, children = processor.add_request("r", [[1, 2, 3], [4, 5]], SamplingParams(n=2, seed=10, max_tokens=5), sink)
    assert [c.request_id for c in children] == ["r-0", "r-1", "r-2", "r-3"]
    assert [c.params.seed for c in children] == [10, 11, 10, 11]
    assert all(c.params.n == 1 for c in children)
    assert [c.prompt_token_ids for c in children] == [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5]]
    hello = tokenizer.encode(" hello")
    processor.process([EngineOutput("r-3", hello, num_cached_tokens=2), EngineOutput("r-0", hello)])
    assert [(d.index, d.prompt_index, d.text) for d in sink.deltas] == [(3, 1, " hello"), (0, 0, " hello")]
    for child in children:
        processor.process([EngineOutput(child.request_id, [7], finished=True, finish_reason=FinishReason.LENGTH)])
    assert state.finished and len(processor) == 0
    usage = state.usage()
    assert usage.prompt_tokens == 5 and usage.completion_tokens == 2 * len(hello) + 4
    assert usage.cached_tokens == 0  # r-2 found nothing cached, so prompt 1 counts none


def test_stop_string_across_tokens_is_held_back_cut_and_aborted(tokenizer):
    processor = OutputProcessor(tokenizer)
    sink = Sink()
    _, children = processor.add_request("r", [[1]], SamplingParams(stop=["lazy dog"], max_tokens=50), sink)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog and more")
    to_abort = feed(processor, children[0].request_id, ids)
    assert to_abort == ["r-0"]  # the engine does not know about stop strings: abort it there
    assert sink.text(0) == "The quick brown fox jumps over the "
    assert sink.finish(0) == (FinishReason.STOP, "lazy dog")
    assert all("lazy" not in d.text for d in sink.deltas)
    before = len(sink.deltas)
    processor.process([EngineOutput("r-0", [5])])  # from a step that was already in flight
    assert len(sink.deltas) == before and len(processor) == 0


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_and_stop_reason(tokenizer, include):
    processor = OutputProcessor(tokenizer)
    sink = Sink()
    stop_id = tokenizer.encode(" France")[0]  # an ordinary, non-special token
    params = SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=include, max_tokens=50)
    processor.add_request("r", [[1]], params, sink)
    ids = tokenizer.encode("Paris is in") + [stop_id]
    last = EngineOutput("r-0", [stop_id], finished=True, finish_reason=FinishReason.STOP, stop_token_id=stop_id)
    feed(processor, "r-0", ids, last)
    assert sink.text(0) == ("Paris is in France" if include else "Paris is in")
    assert sink.finish(0) == (FinishReason.STOP, stop_id)
    assert [t for d in sink.deltas for t in d.token_ids] == ids  # the stop token is an output token either way


def test_eos_is_not_text_and_not_a_stop_reason(tokenizer):
    processor = OutputProcessor(tokenizer)
    sink = Sink()
    processor.add_request("r", [[1]], SamplingParams(max_tokens=50, skip_special_tokens=False), sink)
    eos = tokenizer.eos_token_id
    feed(processor, "r-0", tokenizer.encode("Paris.") + [eos],
         EngineOutput("r-0", [eos], finished=True, finish_reason=FinishReason.STOP, stop_token_id=eos))
    assert sink.text(0) == "Paris." and sink.finish(0) == (FinishReason.STOP, None)


def test_abort_finishes_every_unfinished_choice(tokenizer):
    processor = OutputProcessor(tokenizer)
    sink = Sink()
    processor.add_request("r", [[1]], SamplingParams(n=3, max_tokens=50), sink)
    processor.process([EngineOutput("r-1", [5], finished=True, finish_reason=FinishReason.LENGTH)])
    assert processor.abort("r") == ["r-0", "r-2"]
    assert sorted((d.index, d.finish_reason) for d in sink.deltas) == [
        (0, FinishReason.ABORT), (1, FinishReason.LENGTH), (2, FinishReason.ABORT)]
    assert processor.abort("r") == [] and len(processor) == 0


def test_logprobs_travel_with_their_tokens(tokenizer):
    processor = OutputProcessor(tokenizer)
    sink = Sink()
    processor.add_request("r", [[1]], SamplingParams(logprobs=1, max_tokens=50), sink)
    entry = Logprobs(42, -0.5, 1, [42], [-0.5])
    processor.process([EngineOutput("r-0", [42], new_logprobs=[entry])])
    assert sink.deltas[0].logprobs == [entry] and sink.deltas[0].token_ids == [42]


def test_a_stream_merges_what_its_reader_has_not_taken():
    events = []

    async def scenario():
        stream = RequestStream("r", num_choices=2, abort=lambda rid: events.append(("abort", rid)),
                               on_last_delta=lambda rid: events.append(("done", rid)))
        stream.put(ChoiceDelta(1, 0, "a", [1], []))
        stream.put(ChoiceDelta(0, 0, "x", [9], []))
        stream.put(ChoiceDelta(1, 0, "b", [2], [], FinishReason.LENGTH))
        first = await stream.__anext__()
        stream.put(ChoiceDelta(0, 0, "y", [8], [], FinishReason.STOP, "z"))
        second = await stream.__anext__()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
        stream.close()  # after the end: nothing to abort
        return first, second

    first, second = asyncio.run(scenario())
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in first] == [
        (0, "x", [9], None), (1, "ab", [1, 2], FinishReason.LENGTH)]
    assert [(d.index, d.text, d.finish_reason, d.stop_reason) for d in second] == [(0, "y", FinishReason.STOP, "z")]
    assert events == [("done", "r")]


def test_closing_a_stream_early_aborts_it_once():
    aborted = []
    stream = RequestStream("r", num_choices=1, abort=aborted.append, on_last_delta=lambda rid: None)
    stream.put(ChoiceDelta(0, 0, "a", [1], []))
    stream.close()
    stream.close()
    assert aborted == ["r"]


# ------------------------------------------------------------------ offline == HTTP

AGREEMENT_CASES = [
    ("greedy", "The capital of France is", dict(temperature=0, max_tokens=12)),
    ("stop-string", "The capital of France is", dict(temperature=0, max_tokens=12, stop=[" answer"])),
    ("stop-token-id", "The capital of France is", dict(temperature=0, max_tokens=12, stop_token_ids=[314])),
    ("stop-token-id-kept", "The capital of France is",
     dict(temperature=0, max_tokens=12, stop_token_ids=[314], include_stop_str_in_output=True)),
    ("seeded-n2", "Once upon a time", dict(temperature=1.0, top_p=0.9, seed=5, n=2, max_tokens=10)),
    ("eos", "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
     dict(temperature=0, max_tokens=30)),
]


@pytest.mark.server
def test_offline_and_http_give_the_same_text_tokens_and_finish_reasons(default_server, default_model_path, tokenizer):
    """One request at a time on both paths, so batches (and so float rounding) are the same."""
    llm = LLM(str(default_model_path), max_model_len=1024, num_kvcache_blocks=256)
    for case, prompt, fields in AGREEMENT_CASES:
        prompt_ids = tokenizer.encode(prompt)
        offline = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(**fields), use_tqdm=False)[0]
        body = {"model": DEFAULT_MODEL_NAME, "prompt": prompt_ids, "logprobs": 0, **fields}
        response = httpx.post(f"{default_server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert len(choices) == len(offline.outputs), case
        for choice, completion in zip(choices, offline.outputs):
            assert choice["text"] == completion.text, case
            assert choice["finish_reason"] == completion.finish_reason, case
            token_strings = [tokenizer.decode([t]) for t in completion.token_ids]
            assert choice["logprobs"]["tokens"] == token_strings, case
    stop_token_case = llm.generate([{"prompt_token_ids": tokenizer.encode("The capital of France is")}],
                                   SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[314]),
                                   use_tqdm=False)[0].outputs[0]
    assert stop_token_case.finish_reason == "stop" and stop_token_case.stop_reason == 314, \
        "the stop-token cases must stop on their token to mean something"
