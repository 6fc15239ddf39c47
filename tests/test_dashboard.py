"""The KV dashboard: its snapshot against ``/metrics``, and the page in headless Chromium on a live server, with
and without a host KV tier (``--kv-offloading-size``).

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
from kvcache.metrics import HostTierStats, KVCacheStats, KVTransferStats  # noqa: E402
from server.dashboard import HOST_STATE_NAMES, STATE_NAMES, snapshot_from_stats  # noqa: E402
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
HOST_FREE, HOST_CACHED, HOST_HELD = range(3)
# The host tier server: a pool too small to keep every prompt's blocks cached, over a host tier of a few dozen
# blocks (of the tiny model's 4 or 8 KiB), so that blocks the pool evicts land there.
HOST_POOL_BLOCKS = 24
HOST_TIER_GIB = 0.00025

# The state each cell is painted in, read back from the canvas pixels with the page's own layout: the pool's
# map, or given [canvas id, layout, colors] of the page the host tier's (HOST_CANVAS).
READ_CANVAS_JS = """which => {
  const [canvasId, layoutKey, colorsKey] = which ?? ["kv-map", "layout", "colors"];
  const layout = window.kvDashboard[layoutKey], colors = window.kvDashboard[colorsKey];
  const canvas = document.getElementById(canvasId);
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
HOST_CANVAS = ["host-map", "hostLayout", "hostColors"]

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
def host_server(tmp_path_factory, tiny_model_path):
    """A tiny model with a 24-block pool over a host tier (HOST_TIER_GIB), no API key."""
    args = ["--model", str(tiny_model_path), "--served-model-name", TINY_MODEL_NAME,
            "--num-kvcache-blocks", str(HOST_POOL_BLOCKS), "--kvcache-block-size", str(BLOCK_SIZE),
            "--max-model-len", "256", "--kv-offloading-size", str(HOST_TIER_GIB)]
    server = start_server(tmp_path_factory.mktemp("servers"), "dashboard-host", args)
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


def decode_states(snapshot: dict, key: str = "states") -> np.ndarray:
    assert snapshot["states_encoding"] == "base64-int8"
    return np.frombuffer(base64.b64decode(snapshot[key]), dtype=np.int8)


def fill_host_tier(url: str, first_token: int, num_prompts: int = 10) -> list[list[int]]:
    """Send distinct 4-block prompts one by one, more than the pool keeps cached: the pool evicts the earliest
    ones' cached blocks, and the host tier keeps them. Each prompt starts with ``first_token``, so that no other
    test's prompt shares a block with them. Returns the prompts."""
    prompts = [[first_token, *range(10_000 + 100 * i, 10_000 + 100 * i + 4 * BLOCK_SIZE - 1)]
               for i in range(num_prompts)]
    assert num_prompts * 4 > HOST_POOL_BLOCKS
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    return prompts


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
    # No host tier: its fields keep their defaults.
    assert snap.host is None and snap.num_host_blocks == 0 and snap.host_states == ""
    assert snap.host_state_names == list(HOST_STATE_NAMES) == ["free", "cached", "held"]


def test_snapshot_of_a_host_tier_is_exact():
    num_host_blocks = 50_000
    host_states = np.random.default_rng(1).integers(0, 3, num_host_blocks, dtype=np.int8)
    by_state = np.bincount(host_states, minlength=3)
    host = HostTierStats(num_total_blocks=num_host_blocks, num_used_blocks=int(by_state[1:].sum()),
                         external_prefix_cache_queries=640, external_prefix_cache_hits=160, num_blocks_saved=90,
                         num_blocks_loaded=12, num_swapped_out_blocks=30, num_swapped_in_blocks=20,
                         num_swapped_requests=2)
    kv = KVCacheStats(block_size=16, num_total_blocks=9, num_free_blocks=9, num_used_blocks=0, num_cached_blocks=0,
                      usage=0.0, fragmentation=0.0, prefix_cache_queries=0, prefix_cache_hits=0, host=host)
    transfers = KVTransferStats(blocks_to_host=90, blocks_to_device=12, bytes_to_host=90 * 4096,
                                bytes_to_device=12 * 4096, seconds_to_host=0.5, seconds_to_device=0.25)
    stats = EngineStats(num_running=0, num_waiting=0, num_preemptions=2, kv=kv,
                        block_states=np.zeros(10, dtype=np.int8), kv_transfers=transfers,
                        host_block_states=host_states)
    snap = snapshot_from_stats(stats, "ok", generation_tokens_total=0, prompt_tokens_total=0).model_dump()
    assert np.array_equal(decode_states(snap, "host_states"), host_states)
    assert snap["num_host_blocks"] == num_host_blocks
    h = snap["host"]
    assert h["by_state"] == dict(zip(HOST_STATE_NAMES, by_state.tolist()))
    assert h["total"] == num_host_blocks and h["used"] == by_state[HOST_CACHED] + by_state[HOST_HELD]
    assert (h["external_prefix_cache_queries"], h["external_prefix_cache_hits"]) == (640, 160)
    assert (h["num_blocks_saved"], h["num_blocks_loaded"]) == (90, 12)
    assert (h["num_swapped_out_blocks"], h["num_swapped_in_blocks"], h["num_swapped_requests"]) == (30, 20, 2)
    assert h["to_host"] == {"blocks": 90, "bytes": 90 * 4096, "seconds": 0.5}
    assert h["to_device"] == {"blocks": 12, "bytes": 12 * 4096, "seconds": 0.25}


def test_snapshot_of_the_host_tier_agrees_with_metrics(host_server):
    url = host_server.url
    wait_until_idle(url)
    before = httpx.get(f"{url}/dashboard/snapshot", timeout=10).json()["host"]
    prompts = fill_host_tier(url, first_token=301)
    # The first prompt's blocks left the pool long ago: the host tier has them (all but its last token's block).
    body = {"prompt": prompts[0], "max_tokens": 1}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    metrics = wait_until_idle(url)
    snap = httpx.get(f"{url}/dashboard/snapshot", timeout=10).json()

    host_states = decode_states(snap, "host_states")
    h = snap["host"]
    assert snap["num_host_blocks"] == len(host_states) == h["total"] == metrics["minivllm:kv_host_blocks_total"]
    assert h["total"] >= 16, "the host tier should hold a few dozen blocks"
    assert h["by_state"] == dict(zip(HOST_STATE_NAMES, np.bincount(host_states, minlength=3).tolist()))
    assert h["used"] == h["by_state"]["cached"] + h["by_state"]["held"] == metrics["minivllm:kv_host_blocks_used"]
    assert h["by_state"]["cached"] >= 3 * 4, h  # evicted prompt blocks, still findable
    assert h["by_state"]["held"] == h["num_swapped_requests"] == 0  # idle: nothing swapped out or being copied

    delta = {key: h[key] - before[key] for key in ("num_blocks_saved", "num_blocks_loaded",
                                                   "external_prefix_cache_queries", "external_prefix_cache_hits")}
    for direction in ("to_host", "to_device"):
        for key in ("blocks", "bytes"):
            delta[f"{key}_{direction}"] = h[direction][key] - before[direction][key]
    evicted = len(prompts) * 4 - (HOST_POOL_BLOCKS - 1)  # cached prompt blocks the pool could not keep, at least
    assert delta["num_blocks_saved"] == delta["blocks_to_host"] >= evicted, delta
    assert delta["num_blocks_loaded"] == delta["blocks_to_device"] >= 3, delta  # the first prompt's full blocks
    assert delta["external_prefix_cache_hits"] >= 3 * BLOCK_SIZE, delta
    assert delta["external_prefix_cache_queries"] >= delta["external_prefix_cache_hits"]
    bytes_per_block = delta["bytes_to_host"] // delta["blocks_to_host"]
    assert bytes_per_block > 0 and delta["bytes_to_host"] == delta["blocks_to_host"] * bytes_per_block
    assert delta["bytes_to_device"] == delta["blocks_to_device"] * bytes_per_block
    assert h["to_host"]["seconds"] > 0 and h["to_device"]["seconds"] > 0
    # The counters are /metrics' too.
    assert h["external_prefix_cache_hits"] == metrics["minivllm:external_prefix_cache_hits_total"]
    assert h["external_prefix_cache_queries"] == metrics["minivllm:external_prefix_cache_queries_total"]
    assert h["num_swapped_out_blocks"] == metrics["minivllm:kv_swap_out_blocks_total"]
    for direction in ("to_host", "to_device"):
        assert h[direction]["bytes"] == metrics[f'minivllm:kv_offload_bytes_total{{direction="{direction}"}}']


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


def test_dashboard_host_strip_in_chromium(browser, host_server, tmp_path):
    url = host_server.url
    page = browser.new_page(viewport={"width": 1120, "height": 800})
    console_errors: list[str] = []
    page.on("pageerror", lambda exc: console_errors.append(str(exc)))
    page.goto(f"{url}/dashboard")
    page.wait_for_function("window.kvDashboard.numSnapshots > 0", timeout=10_000)
    fill_host_tier(url, first_token=302)  # cached blocks in the host tier, whatever else ran on this server

    # At a quiet moment, the strip has a cell per host block, painted in its state's color, and the numbers are
    # /metrics' numbers.
    metrics = wait_until_idle(url)
    num_snapshots = page.evaluate("window.kvDashboard.numSnapshots")
    page.wait_for_function(f"window.kvDashboard.numSnapshots >= {num_snapshots + 2}", timeout=10_000)
    snap = page.evaluate("window.kvDashboard.snapshot")
    assert page.is_visible("#host-map") and page.is_visible("#host-numbers") and not page.is_visible("#host-off")
    drawn = page.evaluate(READ_CANVAS_JS, HOST_CANVAS)
    assert len(drawn) == snap["num_host_blocks"] == metrics["minivllm:kv_host_blocks_total"] >= 16
    assert drawn == decode_states(snap, "host_states").tolist()
    assert drawn.count(HOST_CACHED) >= 4 and drawn.count(HOST_HELD) == 0
    assert drawn.count(HOST_CACHED) + drawn.count(HOST_HELD) == metrics["minivllm:kv_host_blocks_used"]
    shown = page.evaluate("""() => Object.fromEntries(Array.from(
        document.querySelectorAll("#host-tier b, #host-numbers dd, #host-shape"), e => [e.id, e.textContent]))""")
    assert shown["host-shape"] == f"{len(drawn)} blocks × {BLOCK_SIZE} tokens"
    assert int(shown["host-blocks-total"]) == metrics["minivllm:kv_host_blocks_total"]
    assert int(shown["host-blocks-used"]) == metrics["minivllm:kv_host_blocks_used"]
    for state, name in enumerate(HOST_STATE_NAMES):
        assert int(shown[f"host-legend-{name}"]) == drawn.count(state), name
    h = snap["host"]
    hits, queries = h["external_prefix_cache_hits"], h["external_prefix_cache_queries"]
    assert shown["host-hit-rate"] == (f"{100 * hits / queries:.1f} %" if queries else "–")
    assert shown["host-bytes-to-host"].endswith("KiB") and shown["host-bandwidth-to-host"].endswith("/s")
    assert shown["host-swapped-requests"] == "0"
    assert int(shown["host-swap-out"]) == metrics["minivllm:kv_swap_out_blocks_total"]
    assert int(shown["host-swap-in"]) == metrics["minivllm:kv_swap_in_blocks_total"]
    page.hover("#host-map", position={"x": 2, "y": 2})
    assert page.text_content("#hover").startswith("host block 0: ")
    # The pool's map, above it, is drawn as before.
    assert page.evaluate(READ_CANVAS_JS) == decode_states(snap).tolist()
    page.screenshot(path=str(tmp_path / "kv-map-host.png"), full_page=True)
    assert not console_errors, console_errors
    page.close()


def test_dashboard_host_strip_off_in_chromium(browser, server):
    page = browser.new_page(viewport={"width": 1120, "height": 600})
    console_errors: list[str] = []
    page.on("pageerror", lambda exc: console_errors.append(str(exc)))
    page.goto(f"{server.url}/dashboard")
    page.wait_for_function("window.kvDashboard.numSnapshots > 0", timeout=10_000)
    assert page.evaluate("window.kvDashboard.snapshot.host") is None
    assert page.evaluate("window.kvDashboard.hostStates") is None
    assert not page.is_visible("#host-map") and not page.is_visible("#host-legend")
    assert not page.is_visible("#host-numbers")
    assert page.is_visible("#host-off") and page.text_content("#host-off") == "host tier off (--kv-offloading-size)"
    assert page.evaluate("window.kvDashboard.layout.numBlocks") == NUM_BLOCKS
    assert not console_errors, console_errors
    page.close()
