"""The KV dashboard: its snapshot against ``/metrics``, and the page in headless Chromium on a live server.

The browser test needs Debian's ``chromium`` and the ``playwright`` package (never
``playwright install``: the system browser is used). Without them it skips, or fails under CI.
"""

from __future__ import annotations

import base64
import os
import random
import shutil
import threading
import time

import httpx
import numpy as np
import pytest

pytest.register_assert_rewrite("tests.server_helpers")
from engine.outputs import EngineStats  # noqa: E402
from kvcache.metrics import KVCacheStats  # noqa: E402
from server.dashboard import STATE_NAMES, snapshot_from_stats  # noqa: E402
from tests.server_helpers import (  # noqa: E402
    REPO_ROOT,
    TINY_MODEL_NAME,
    assert_error_shape,
    start_server,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The README's picture; the test refreshes it only when asked, so a test run leaves the tree as it was.
README_SCREENSHOT = REPO_ROOT / "docs" / "kv-map.png"
API_KEY = "dashboard-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_BLOCKS = 96
BLOCK_SIZE = 16
SHARED_PREFIX = list(range(1000, 1000 + 4 * BLOCK_SIZE))  # four full blocks every request shares
NUM_CLIENTS = 6
FREE, IN_USE, CACHED_FREE, SHARED, NULL = range(5)

# The state each cell is painted in, read back from the canvas pixels with the page's own layout.
READ_CANVAS_JS = """() => {
  const {layout, colors} = window.kvDashboard;
  const canvas = document.getElementById("kv-map");
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  const rgb = colors.map(hex => parseInt(hex.slice(1), 16));
  const half = Math.floor((layout.cellPx - layout.gapPx) / 2);
  const states = [];
  for (let b = 0; b < layout.numBlocks; b++) {
    const x = (b % layout.cols) * layout.cellPx + half, y = Math.floor(b / layout.cols) * layout.cellPx + half;
    const i = 4 * (y * canvas.width + x);
    states.push(rgb.indexOf((data[i] << 16) | (data[i + 1] << 8) | data[i + 2]));
  }
  return states;
}"""

# The numbers the page shows, by element id.
SHOWN_IDS = ("running", "waiting", "preemptions", "gen-tokens", "prompt-tokens", "blocks-used", "blocks-free",
             "blocks-cached", "blocks-total", "steps-decode-graph", "steps-mixed-graph", "steps-eager")
METRIC_OF_ID = {
    "running": "minivllm:num_requests_running", "waiting": "minivllm:num_requests_waiting",
    "preemptions": "minivllm:num_preemptions_total", "gen-tokens": "minivllm:generation_tokens_total",
    "prompt-tokens": "minivllm:prompt_tokens_total", "blocks-used": "minivllm:kv_cache_blocks_used",
    "blocks-free": "minivllm:kv_cache_blocks_free", "blocks-cached": "minivllm:kv_cache_blocks_cached",
    "blocks-total": "minivllm:kv_cache_blocks_total",
    **{f"steps-{kind.replace('_', '-')}": f'minivllm:engine_steps_total{{kind="{kind}"}}'
       for kind in ("decode_graph", "mixed_graph", "eager")},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path):
    """A tiny model with a 96-block pool (a map small enough to read), behind an API key."""
    args = ["--model", str(tiny_model_path), "--served-model-name", TINY_MODEL_NAME,
            "--num-kvcache-blocks", str(NUM_BLOCKS), "--kvcache-block-size", str(BLOCK_SIZE),
            "--max-model-len", "1024", "--api-key", API_KEY]
    server = start_server(tmp_path_factory.mktemp("servers"), "dashboard", args)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser():
    missing = _browser_missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{missing}; CI must run the dashboard browser test")
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright; no browser download needed)"
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        return f"{CHROMIUM} is missing (apt-get install -y chromium)"
    return None


# ------------------------------------------------------------------------ snapshot


def decode_states(snapshot: dict) -> np.ndarray:
    assert snapshot["states_encoding"] == "base64-int8"
    return np.frombuffer(base64.b64decode(snapshot["states"]), dtype=np.int8)


def test_snapshot_agrees_with_metrics_and_routes_are_open(server):
    page = httpx.get(f"{server.url}/dashboard", timeout=10)  # no API key: open, like /metrics
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="kv-map"' in page.text and "http://" not in page.text and "https://" not in page.text  # offline
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401  # the key is on
    assert_error_shape(httpx.post(f"{server.url}/dashboard/snapshot", timeout=10), 405)

    # The module's server is shared: counters are compared as what this request added to them.
    before = wait_until_idle(server.url)
    assert before["minivllm:num_requests_running"] == before["minivllm:kv_cache_blocks_used"] == 0
    body = {"prompt": SHARED_PREFIX + [7, 8, 9], "max_tokens": 20, "ignore_eos": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    metrics = wait_until_idle(server.url)
    eager_steps = 'minivllm:engine_steps_total{kind="eager"}'
    added = {name: metrics[name] - before[name]
             for name in ("minivllm:generation_tokens_total", "minivllm:prompt_tokens_total", eager_steps)}
    snap = httpx.get(f"{server.url}/dashboard/snapshot", timeout=10).json()

    states = decode_states(snap)
    assert snap["num_blocks"] == len(states) == NUM_BLOCKS and snap["block_size"] == BLOCK_SIZE
    assert snap["state_names"] == list(STATE_NAMES)
    counts = snap["counts"]
    assert counts["by_state"] == dict(zip(STATE_NAMES, np.bincount(states, minlength=5).tolist()))
    assert counts["by_state"]["cached_free"] >= 4  # at least the shared prefix stays cached
    assert counts["by_state"]["null"] == 1 and states[0] == NULL
    for name in ("total", "free", "used", "cached"):
        assert counts[name] == metrics[f"minivllm:kv_cache_blocks_{name}"], name
    assert snap["num_running"] == metrics["minivllm:num_requests_running"] == 0
    assert snap["generation_tokens_total"] == metrics["minivllm:generation_tokens_total"]
    assert snap["prompt_tokens_total"] == metrics["minivllm:prompt_tokens_total"]
    assert snap["prefix_cache_hits"] == metrics["minivllm:prefix_cache_hits_total"]
    assert added["minivllm:generation_tokens_total"] == 20
    assert added["minivllm:prompt_tokens_total"] == len(body["prompt"])
    steps = snap["num_steps_by_kind"]
    assert steps["eager"] == metrics[eager_steps] and added[eager_steps] >= 20  # the CPU: all eager
    assert steps["decode_graph"] == steps["mixed_graph"] == 0
    assert snap["engine_status"] == "ok"


@pytest.mark.unit
def test_snapshot_of_a_large_pool_is_exact():
    num_blocks = 100_000
    rng = np.random.default_rng(0)
    states = rng.integers(0, 4, num_blocks, dtype=np.int8)
    states[0] = NULL
    by_state = np.bincount(states, minlength=5)
    kv = KVCacheStats(block_size=16, num_total_blocks=num_blocks - 1,
                      num_free_blocks=int(by_state[FREE] + by_state[CACHED_FREE]),
                      num_used_blocks=int(by_state[IN_USE] + by_state[SHARED]), num_cached_blocks=0, usage=0.5,
                      fragmentation=0.1, prefix_cache_queries=10, prefix_cache_hits=5)
    stats = EngineStats(num_running=3, num_waiting=1, num_preemptions=0, kv=kv, block_states=states)
    snap = snapshot_from_stats(stats, "ok", generation_tokens_total=7, prompt_tokens_total=9)
    assert np.array_equal(decode_states(snap.model_dump()), states)
    assert snap.counts.by_state["shared"] == by_state[SHARED] and snap.counts.by_state["null"] == 1


# ------------------------------------------------------------------------- browser


class Traffic:
    """Clients that stream long completions sharing a prefix, back to back, until stopped."""

    def __init__(self, url: str, num_clients: int):
        self.url = url
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(num_clients)]

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop_event.set()  # each client closes its stream: the server aborts the request
        for thread in self.threads:
            thread.join(timeout=30)

    def _client(self, index: int) -> None:
        rng = random.Random(index)
        for turn in range(1000):
            suffix = [5000 + 1000 * index + 10 * turn + k for k in range(8)]
            body = {"prompt": SHARED_PREFIX + suffix, "max_tokens": rng.randint(40, 160), "ignore_eos": True,
                    "stream": True}
            try:
                with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=AUTH,
                                  timeout=60) as response:
                    response.raise_for_status()
                    for _ in response.iter_lines():
                        if self.stop_event.is_set():
                            return
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)
                return
            if self.stop_event.is_set():
                return


def shown_numbers(page) -> dict[str, int]:
    texts = page.evaluate(f"() => {list(SHOWN_IDS)}.map(id => document.getElementById(id).textContent)")
    return {name: int(text.replace(",", "")) for name, text in zip(SHOWN_IDS, texts)}


def test_dashboard_page_live_in_chromium(browser, server, tmp_path):
    screenshot = README_SCREENSHOT if os.environ.get("MINIVLLM_UPDATE_SCREENSHOT") else tmp_path / "kv-map.png"
    page = browser.new_page(viewport={"width": 1120, "height": 600})
    console_errors: list[str] = []
    page.on("pageerror", lambda exc: console_errors.append(str(exc)))
    page.goto(f"{server.url}/dashboard")
    page.wait_for_function("window.kvDashboard.numSnapshots > 0", timeout=10_000)
    wait_until_idle(server.url)

    maps: list[tuple[int, ...]] = []
    seen_states: set[int] = set()
    max_throughput = 0.0
    best_score = 0  # the screenshot shows the busiest map seen: in-use, shared and cached cells at once
    with Traffic(server.url, NUM_CLIENTS) as traffic:
        start = time.monotonic()
        while time.monotonic() - start < 30 and not traffic.errors:
            drawn = tuple(page.evaluate(READ_CANVAS_JS))
            assert -1 not in drawn, f"a cell is painted in no state's color: {drawn}"
            if not maps or drawn != maps[-1]:
                maps.append(drawn)
            seen_states.update(drawn)
            max_throughput = max(max_throughput, page.evaluate("window.kvDashboard.throughput"))
            score = min(drawn.count(IN_USE), 3 * drawn.count(CACHED_FREE)) if SHARED in drawn else 0
            if score > best_score:
                screenshot.parent.mkdir(exist_ok=True)
                page.screenshot(path=str(screenshot))
                best_score = score
            if best_score >= 15 and len(maps) >= 5 and time.monotonic() - start > 3:
                break
            time.sleep(0.25)
    assert not traffic.errors, traffic.errors
    assert len(maps) >= 5, f"the map changed only {len(maps) - 1} times in 30 s: the page is not updating"
    assert {FREE, IN_USE, SHARED, CACHED_FREE, NULL} <= seen_states, seen_states
    assert best_score > 0 and screenshot.read_bytes().startswith(b"\x89PNG")
    assert max_throughput > 0

    # At a quiet moment, what the page shows (canvas and numbers) is what /metrics says.
    metrics = wait_until_idle(server.url)
    num_snapshots = page.evaluate("window.kvDashboard.numSnapshots")
    page.wait_for_function(f"window.kvDashboard.numSnapshots >= {num_snapshots + 2}", timeout=10_000)
    shown = shown_numbers(page)
    assert shown == {name: int(metrics[METRIC_OF_ID[name]]) for name in SHOWN_IDS}
    assert shown["blocks-used"] == 0 and shown["blocks-total"] == NUM_BLOCKS - 1
    drawn = page.evaluate(READ_CANVAS_JS)
    assert drawn == list(decode_states(page.evaluate("window.kvDashboard.snapshot")))
    assert drawn.count(FREE) + drawn.count(CACHED_FREE) == metrics["minivllm:kv_cache_blocks_free"]
    assert not console_errors, console_errors
    page.close()
