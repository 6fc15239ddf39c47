"""``bench/serve.py`` against a real server: its numbers must agree with each other and with /metrics.

The server is a tiny random-weight Llama with the default model's tokenizer, a 64-block KV pool
and a 256-token context, so a run mixes finished requests, rejected ones (prompt plus
max_tokens past the context) and preemptions (four long requests do not fit in the pool).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import REPO_ROOT, scrape_metrics, start_server  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "bench"))
from serve_client import RequestResult  # noqa: E402
from serve_datasets import sample_sharegpt, sharegpt_pairs  # noqa: E402
from serve_metrics import LatencyStats, output_token_timeline, parse_goodput  # noqa: E402

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

BENCH = REPO_ROOT / "bench" / "serve.py"
NUM_PROMPTS = 12
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LATENCY_KINDS = ("ttft", "tpot", "itl", "e2el")
SLOS = {"ttft": 2000.0, "tpot": 200.0, "e2el": 5000.0}
SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "Name three colours."},
                                  {"from": "gpt", "value": "Red, green and blue are three colours."}]},
    {"id": "b", "conversations": [{"from": "human", "value": "What is two plus two?"},
                                  {"from": "gpt", "value": "Two plus two is four."},
                                  {"from": "human", "value": "And three plus three?"}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "A reply with no question first."},
                                  {"from": "human", "value": "Skipped."}]},
    {"id": "d", "conversations": [{"from": "human", "value": "Only a question."}]},
]


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory, tiny_model_path):
    server = start_server(tmp_path_factory.mktemp("servers"), "bench",
                          ["--model", str(tiny_model_path), "--num-kvcache-blocks", "64", "--max-model-len", "256",
                           "--enable-prompt-tokens-details"])  # the cached tokens the bench reports
    yield server
    server.stop()


def run_bench(url: str, out_dir: Path, *args: str, expect_rc: int = 0, env: dict | None = None,
              stderr_has: str = "") -> dict:
    cmd = [sys.executable, str(BENCH), "--base-url", url, "--num-prompts", str(NUM_PROMPTS), "--seed", "0",
           "--result-dir", str(out_dir), "--result-filename", "result.json", *args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == expect_rc, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Serving Benchmark Result" in proc.stdout
    assert stderr_has in proc.stderr
    return json.loads((out_dir / "result.json").read_text())


def goodput_args() -> list[str]:
    return ["--goodput", *(f"{name}:{ms:g}" for name, ms in SLOS.items())]


# ------------------------------------------------------------------------- checks


def check_counts(doc: dict) -> None:
    records = doc["requests"]
    ok = [r for r in records if r["success"]]
    assert len(records) == NUM_PROMPTS
    assert doc["completed"] + doc["failed"] == NUM_PROMPTS
    assert doc["completed"] == len(ok)
    assert doc["total_output_tokens"] == sum(r["completion_tokens"] for r in ok)
    assert doc["total_input_tokens"] == sum(r["prompt_tokens"] for r in ok)
    for r in ok:
        assert 1 <= r["completion_tokens"] <= r["max_tokens"]
        assert 1 <= r["num_chunks"] <= r["completion_tokens"]
        assert r["error"] == ""
    for r in records:
        assert r["success"] or r["error"]


def check_latency_stats(doc: dict) -> None:
    ok = [r for r in doc["requests"] if r["success"]]
    samples = {
        "ttft": [r["ttft_ms"] for r in ok],
        "tpot": [r["tpot_ms"] for r in ok if r["completion_tokens"] > 1],
        "itl": [gap for r in ok for gap in r["itl_ms"]],
        "e2el": [r["e2el_ms"] for r in ok],
    }
    assert len(samples["itl"]) == sum(r["num_chunks"] - 1 for r in ok)
    for kind in LATENCY_KINDS:
        stats = doc["latency_ms"][kind]
        assert stats["count"] == len(samples[kind]), kind
        if not samples[kind]:
            continue
        assert stats["min"] <= stats["median"] <= stats["p90"] <= stats["p99"] <= stats["max"], (kind, stats)
        assert stats["min"] <= stats["mean"] <= stats["max"], (kind, stats)
        assert stats["min"] == pytest.approx(min(samples[kind]))
        assert stats["max"] == pytest.approx(max(samples[kind]))
        assert stats["median"] == pytest.approx(float(np.median(samples[kind])))
        assert stats["mean"] == pytest.approx(float(np.mean(samples[kind])))
    for r in ok:
        assert 0 < r["ttft_ms"] <= r["e2el_ms"]
        assert r["tpot_ms"] >= 0
        assert all(gap >= 0 for gap in r["itl_ms"])


def check_throughput(doc: dict) -> None:
    duration = doc["duration_s"]
    ok = [r for r in doc["requests"] if r["success"]]
    assert duration > 0
    assert duration * 1000 >= doc["latency_ms"]["e2el"]["max"]
    assert duration * 1000 >= max(r["start_s"] * 1000 + r["e2el_ms"] for r in ok)
    assert doc["request_throughput"] == pytest.approx(doc["completed"] / duration)
    assert doc["input_throughput"] == pytest.approx(doc["total_input_tokens"] / duration)
    assert doc["output_throughput"] == pytest.approx(doc["total_output_tokens"] / duration)
    assert doc["total_token_throughput"] == pytest.approx(
        (doc["total_input_tokens"] + doc["total_output_tokens"]) / duration)
    bins = doc["output_throughput_timeline"]
    assert bins[0]["start_s"] == 0 and bins[-1]["end_s"] == pytest.approx(duration)
    tokens_in_bins = sum(b["output_tok_s"] * (b["end_s"] - b["start_s"]) for b in bins)
    assert tokens_in_bins == pytest.approx(doc["total_output_tokens"])


def check_goodput(doc: dict) -> None:
    ok = [r for r in doc["requests"] if r["success"]]
    good = [r for r in ok if all(r[f"{name}_ms"] <= ms for name, ms in SLOS.items())]
    assert doc["good_requests"] == len(good)
    assert doc["request_goodput"] == pytest.approx(len(good) / doc["duration_s"])
    assert doc["request_goodput"] <= doc["request_throughput"]


def check_plots(doc: dict) -> None:
    for path in doc["plots"].values():
        data = Path(path).read_bytes()
        assert len(data) > len(PNG_MAGIC) and data.startswith(PNG_MAGIC), path


def check_against_server(doc: dict, before: dict[str, float], after: dict[str, float]) -> None:
    """The server counted the same tokens as the usage chunks the benchmark added up."""
    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("minivllm:generation_tokens_total") == doc["total_output_tokens"]
    assert delta("minivllm:prompt_tokens_total") == doc["total_input_tokens"]
    finished = sum(delta(f'minivllm:request_success_total{{finished_reason="{reason}"}}')
                   for reason in ("stop", "length"))
    assert finished == doc["completed"]


def check_all(doc: dict) -> None:
    check_counts(doc)
    check_latency_stats(doc)
    check_throughput(doc)
    check_goodput(doc)
    check_plots(doc)


# -------------------------------------------------------------------------- against the server


def test_rate_inf_mixes_finished_and_rejected_requests(bench_server, tiny_model_path, tmp_path):
    """Prompts of 140 to 260 tokens plus 32 new ones: those past the 256-token context are rejected."""
    before = scrape_metrics(bench_server.url)
    doc = run_bench(bench_server.url, tmp_path, "--tokenizer", str(tiny_model_path), "--request-rate", "inf",
                    "--max-concurrency", "4", "--random-input-len", "200", "--random-output-len", "32",
                    "--random-range-ratio", "0.3", *goodput_args())
    after = scrape_metrics(bench_server.url)
    check_all(doc)
    check_against_server(doc, before, after)
    assert doc["completed"] > 0 and doc["failed"] > 0
    for r in doc["requests"]:
        too_long = r["dataset_prompt_len"] + r["max_tokens"] > 256
        assert r["success"] != too_long, r
        assert r["success"] or "HTTP 400" in r["error"]
        if r["success"]:
            assert r["prompt_tokens"] == r["dataset_prompt_len"]


def test_poisson_rate_with_shared_prefix_and_ignore_eos(bench_server, tiny_model_path, tmp_path):
    before = scrape_metrics(bench_server.url)
    doc = run_bench(bench_server.url, tmp_path, "--tokenizer", str(tiny_model_path), "--request-rate", "20",
                    "--max-concurrency", "4", "--random-input-len", "48", "--random-output-len", "24",
                    "--random-range-ratio", "0.5", "--random-prefix-len", "32", "--ignore-eos", *goodput_args())
    after = scrape_metrics(bench_server.url)
    check_all(doc)
    check_against_server(doc, before, after)
    assert doc["completed"] == NUM_PROMPTS
    assert doc["config"]["request_rate"] == 20
    starts = [r["start_s"] for r in doc["requests"]]
    assert starts[-1] > 0.05, "a finite rate spreads the arrivals out"
    for r in doc["requests"]:
        assert r["completion_tokens"] == r["max_tokens"]  # ignore_eos: exactly max_tokens
        assert r["prompt_tokens"] == r["dataset_prompt_len"]
    assert sum(r["cached_tokens"] for r in doc["requests"]) > 0, "the 32-token shared prefix hits the prefix cache"


def test_sharegpt_prompts_and_reply_lengths(bench_server, tiny_model_path, tmp_path):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model_path))
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(SHAREGPT))
    doc = run_bench(bench_server.url, tmp_path, "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
                    "--tokenizer", str(tiny_model_path), "--max-concurrency", "4", *goodput_args())
    check_all(doc)
    assert doc["completed"] == NUM_PROMPTS
    reply_lens = {len(tokenizer(reply, add_special_tokens=False)["input_ids"]) for _, reply in sharegpt_pairs(SHAREGPT)}
    assert {r["max_tokens"] for r in doc["requests"]} == reply_lens


def test_serve_vs_offline_counts_the_forward_passes_of_a_run(bench_server):
    """bench/serve_vs_offline.py reports each run's forward passes by how they ran, from /metrics: a request for
    five tokens is one prefill and four decodes, every one eager on the CPU."""
    import httpx
    from serve_vs_offline import scrape, step_counts

    model = httpx.get(f"{bench_server.url}/v1/models").json()["data"][0]["id"]
    before = scrape(bench_server.url)
    response = httpx.post(f"{bench_server.url}/v1/completions", timeout=60,
                          json={"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 5, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
    assert step_counts(before, scrape(bench_server.url)) == {"decode_graph": 0, "mixed_graph": 0, "eager": 5}


def test_unknown_model_fails_every_request(bench_server, tmp_path):
    doc = run_bench(bench_server.url, tmp_path, "--model", "no-such-model", "--random-input-len", "8",
                    "--random-output-len", "4", "--no-plots", expect_rc=1)
    assert doc["completed"] == 0 and doc["failed"] == NUM_PROMPTS
    assert all("HTTP 404" in r["error"] for r in doc["requests"])
    assert doc["total_output_tokens"] == 0 and doc["request_throughput"] == 0
    assert "plots" not in doc


# ---------------------------------------------------------------------------- pure parts


def test_sharegpt_keeps_human_then_gpt_and_counts_words_without_tokenizer(tmp_path):
    assert sharegpt_pairs(SHAREGPT) == [
        ("Name three colours.", "Red, green and blue are three colours."),
        ("What is two plus two?", "Two plus two is four."),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    requests = sample_sharegpt(path, 5, None, np.random.default_rng(0))
    assert len(requests) == 5  # two conversations, cycled
    assert {r.output_len for r in requests} == {7, 5}  # words of each reply
    assert all(r.prompt_len is None for r in requests)


def test_latency_stats_are_ordered():
    values = list(np.random.default_rng(0).exponential(10.0, 200))
    s = LatencyStats.of(values)
    assert s.count == 200 and s.min <= s.median <= s.p90 <= s.p99 <= s.max and s.min <= s.mean <= s.max
    assert LatencyStats.of([]) == LatencyStats()


def test_goodput_specs():
    assert parse_goodput(["ttft:200", "e2el:1500.5"]) == {"ttft": 200.0, "e2el": 1500.5}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_timeline_bins_add_up_to_usage_tokens():
    results = [RequestResult(success=True, completion_tokens=10, chunk_times_s=[100.2, 100.9, 102.2]),
               RequestResult(success=True, completion_tokens=4, chunk_times_s=[101.1]),
               RequestResult(success=False, completion_tokens=0, chunk_times_s=[100.5])]
    edges, rates = output_token_timeline(results, t0_s=100.0, duration_s=2.3)
    assert list(edges) == pytest.approx([0.0, 1.0, 2.3])  # the 0.3 s tail joins the bin before it
    assert float(np.sum(rates * np.diff(edges))) == pytest.approx(14.0)
    assert math.isclose(rates[0], 20 / 3)


def test_results_are_written_without_matplotlib(bench_server, tmp_path):
    """A machine without matplotlib still gets the JSON results, and a line saying why there are no plots."""
    blocker = tmp_path / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    doc = run_bench(bench_server.url, tmp_path, "--random-input-len", "8", "--random-output-len", "4",
                    env={"PYTHONPATH": str(blocker.parent)}, stderr_has="no plots: No module named 'matplotlib'")
    assert doc["completed"] == NUM_PROMPTS
    assert "plots" not in doc
    assert not list(tmp_path.glob("*.png"))
