"""LoRA adapters over HTTP, as vLLM serves them, on real servers through the openai SDK: ``--lora-modules`` at
start-up (``name=path`` and JSON), ``/v1/models`` listing each adapter with its parent, a request choosing an adapter
by ``model`` (an unknown name a 404), ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with
``MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING`` (a 404 without it), bad adapters refused with the reason, the API key on
those routes, and the adapters in ``/metrics``.

The adapters are PEFT's own, made here on the tiny random Llama. Whether an adapter's outputs are right is the
engine's to show (tests/test_lora.py, against peft); here a completion under an adapter must differ from the base
model's and equal what ``LLM(enable_lora=True).generate(..., lora_request=...)`` gives offline.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import peft
import pytest
import torch
import transformers

from engine import LLM, LoRARequest, SamplingParams, settings

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import (  # noqa: E402
    REPO_ROOT,
    TINY_MAX_MODEL_LEN,
    TINY_MODEL_NAME,
    assert_error_shape,
    start_server,
    tiny_server_args,
    wait_until_idle,
)

pytest_plugins = ["tests.server_helpers"]
pytestmark = pytest.mark.usefixtures("server_logs_on_failure")

API_KEY = "lora-key-5e21"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RUNTIME = {settings.ALLOW_RUNTIME_LORA_UPDATING: "true"}
PROMPT = "The capital of France is"
NUM_TOKENS = 8
SERVER_LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]


def make_adapter(base: Path, path: Path, seed: int, r: int = 8, b_scale: float = 1.0) -> Path:
    """A random PEFT adapter of the checkpoint at ``base``; ``b_scale`` multiplies its B matrices (large ones make
    sure it changes the greedy text)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=16, target_modules=TARGETS,
                                                       init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_path) -> dict[str, Path]:
    """Two good adapters, and three that the server must refuse: rank 32 (above --max-lora-rank 16), whole layers
    to save (``modules_to_save``), and a configuration without its weights."""
    root = tmp_path_factory.mktemp("lora-adapters")
    found = {"large": make_adapter(tiny_model_path, root / "large", seed=1, b_scale=8.0),
             "other": make_adapter(tiny_model_path, root / "other", seed=2),
             "rank32": make_adapter(tiny_model_path, root / "rank32", seed=3, r=32)}
    found["modules_to_save"] = shutil.copytree(found["other"], root / "modules_to_save")
    config_file = found["modules_to_save"] / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "modules_to_save": ["lm_head"]}))
    found["no_weights"] = root / "no_weights"
    found["no_weights"].mkdir()
    shutil.copy(found["other"] / "adapter_config.json", found["no_weights"])
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path, adapters):
    """The tiny model with two adapters from the start (one given as JSON), runtime loading on, and an API key."""
    static_json = json.dumps({"name": "other", "path": str(adapters["other"]), "base_model_name": TINY_MODEL_NAME})
    args = tiny_server_args(tiny_model_path) + SERVER_LORA_ARGS + [
        "--lora-modules", f"large={adapters['large']}", static_json, "--api-key", API_KEY]
    server = start_server(tmp_path_factory.mktemp("servers"), "lora", args, env=RUNTIME)
    yield server
    server.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)


def load(server, name: str, path, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      headers=headers, timeout=30)


def unload(server, headers=AUTH, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/unload_lora_adapter", json=body, headers=headers, timeout=30)


def greedy(client: openai.OpenAI, model: str, prompt=PROMPT, max_tokens: int = NUM_TOKENS):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})


def test_the_models_list_names_each_adapter_with_its_parent(client, adapters):
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards)[:3] == [TINY_MODEL_NAME, "large", "other"]  # the base model first, then in load order
    base = cards[TINY_MODEL_NAME].model_dump()
    assert base["parent"] is None and base["root"] == TINY_MODEL_NAME
    for name in ("large", "other"):
        card = cards[name].model_dump()
        assert card["parent"] == TINY_MODEL_NAME and card["root"] == str(adapters[name])
        assert card["max_model_len"] == TINY_MAX_MODEL_LEN and card["runner"] == "generate"
    assert client.models.retrieve("large").model_dump()["parent"] == TINY_MODEL_NAME


def test_an_unknown_model_is_a_404_naming_the_adapters(client, server):
    for create in (lambda: client.completions.create(model="nope", prompt=PROMPT, max_tokens=2),
                   lambda: client.chat.completions.create(model="nope", max_tokens=2,
                                                          messages=[{"role": "user", "content": "hi"}])):
        with pytest.raises(openai.NotFoundError) as info:
            create()
        error = info.value.body
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert f"serves '{TINY_MODEL_NAME}' and the LoRA adapters 'large', 'other'" in error["message"]
    response = httpx.get(f"{server.url}/v1/models/nope", headers=AUTH)
    assert_error_shape(response, 404)


def test_adapters_serve_generation_only(server):
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": "large", "input": "hi"}, headers=AUTH)
    assert "adapters serve generation only" in assert_error_shape(response, 400)["message"]


def test_every_generation_route_names_the_adapter_it_ran(client, server):
    """Completions, chat, responses and messages all take an adapter's name, and answer with it as their model."""
    assert greedy(client, "large").model == "large"
    assert greedy(client, TINY_MODEL_NAME).model == TINY_MODEL_NAME
    chat = client.chat.completions.create(model="other", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "other"
    stream = client.chat.completions.create(model="other", max_tokens=3, stream=True,
                                            messages=[{"role": "user", "content": "hi"}])
    assert {chunk.model for chunk in stream} == {"other"}
    assert client.responses.create(model="large", input="hi", max_output_tokens=3).model == "large"
    message = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY}, json={
        "model": "other", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert message.status_code == 200, message.text
    assert message.json()["model"] == "other"


def test_a_completion_under_an_adapter_is_the_offline_engines(client, tiny_model_path, adapters):
    """Waits for the engine's LoRA support: until it applies ``lora_request``, the adapter's text is the base's."""
    base, large = greedy(client, TINY_MODEL_NAME).choices[0], greedy(client, "large").choices[0]
    assert large.token_ids != base.token_ids
    llm = LLM(str(tiny_model_path), enable_lora=True, max_loras=2, max_lora_rank=16,
              max_model_len=256, num_kvcache_blocks=64)
    try:
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        (offline,) = llm.generate(PROMPT, params, use_tqdm=False,
                                  lora_request=LoRARequest("large", 1, str(adapters["large"])))
    finally:
        llm.shutdown()
    assert offline.outputs[0].token_ids == large.token_ids
    assert offline.outputs[0].text == large.text


def test_load_then_unload_at_run_time(client, server, adapters):
    response = load(server, "runtime", adapters["large"])
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'runtime' added successfully."
    assert response.headers["content-type"].startswith("text/plain")
    assert client.models.retrieve("runtime").model_dump()["parent"] == TINY_MODEL_NAME
    assert greedy(client, "runtime").model == "runtime"
    again = assert_error_shape(load(server, "runtime", adapters["other"]), 400)
    assert "has already been loaded" in again["message"] and again["param"] == "lora_name"
    assert "served model's name" in assert_error_shape(load(server, TINY_MODEL_NAME, adapters["other"]),
                                                       400)["message"]

    response = unload(server, lora_name="runtime")
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'runtime' removed successfully."
    with pytest.raises(openai.NotFoundError):
        greedy(client, "runtime")
    assert "runtime" not in {card.id for card in client.models.list().data}
    assert "cannot be found" in assert_error_shape(unload(server, lora_name="runtime"), 404)["message"]
    assert_error_shape(unload(server, lora_int_id=10_000), 404)
    assert_error_shape(unload(server, lora_name="large", lora_int_id=10_000), 404)  # the name's id is another
    assert_error_shape(unload(server), 400)  # neither a name nor an id
    # The same name may be loaded again (under a new id: the files at its path may have changed).
    assert load(server, "runtime", adapters["other"]).status_code == 200
    assert unload(server, lora_name="runtime").status_code == 200


def test_unloading_lets_running_requests_finish(client, server, adapters):
    assert load(server, "transient", adapters["other"]).status_code == 200
    stream = client.completions.create(model="transient", prompt=PROMPT, max_tokens=64, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = iter(stream)
    first = next(chunks)
    assert unload(server, lora_name="transient").status_code == 200
    rest = list(chunks)
    token_ids = [t for chunk in [first, *rest] for choice in chunk.choices for t in (choice.token_ids or [])]
    assert len(token_ids) == 64 and rest[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        greedy(client, "transient")


@pytest.mark.parametrize("adapter, problem", [
    ("rank32", "rank 32 of 'model.layers.0.mlp.down_proj' is above max_lora_rank (16)"),
    ("modules_to_save", "modules_to_save ['lm_head']"),
    ("no_weights", "no adapter_model.safetensors"),
    ("missing", "no adapter_config.json"),
])
def test_an_adapter_that_cannot_be_served_is_a_400_that_says_why(client, server, adapters, tmp_path, adapter,
                                                                 problem):
    path = adapters.get(adapter, tmp_path / "missing")
    error = assert_error_shape(load(server, f"bad-{adapter}", path), 400)
    assert problem in error["message"] and error["param"] == "lora_path"
    assert f"bad-{adapter}" not in {card.id for card in client.models.list().data}


def test_the_routes_need_the_api_key_and_say_so(server, adapters):
    for response in (load(server, "no-key", adapters["other"], headers={}), unload(server, headers={},
                                                                                  lora_name="large")):
        assert_error_shape(response, 401)
    document = httpx.get(f"{server.url}/openapi.json").json()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert document["paths"][path]["post"]["security"] == [{"APIKey": []}]


def test_without_the_variable_the_routes_are_404(tiny_server):
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        response = httpx.post(f"{tiny_server.url}{route}", json={"lora_name": "x", "lora_path": "/tmp"})
        assert_error_shape(response, 404)
    response = httpx.post(f"{tiny_server.url}/v1/completions", json={"model": "x", "prompt": "hi"})
    assert assert_error_shape(response, 404)["message"] == ("the model 'x' does not exist; this server serves "
                                                           f"'{TINY_MODEL_NAME}'")


def test_loading_needs_lora_enabled(monkeypatch):
    """A server with the routes but without --enable-lora refuses to load (an app with no engine behind it)."""
    from server.app import build_app
    from server.serving import ServingContext

    monkeypatch.setenv(settings.ALLOW_RUNTIME_LORA_UPDATING, "1")
    model = SimpleNamespace(name="m", tokenizer=None, max_model_len=64)
    app = build_app(ServingContext(None, model, None))

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as http:
            return await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nowhere"})

    error = assert_error_shape(asyncio.run(post()), 400)
    assert error["code"] == "lora_not_enabled" and "--enable-lora" in error["message"]


def test_the_metrics_name_the_adapters_of_running_requests(client, server):
    """Waits for the engine's LoRA statistics (``EngineStats.lora``): vLLM's info gauge (its value the time of the
    scrape) and the device slots' loads and evictions."""
    greedy(client, "large")
    metrics = wait_until_idle(server.url)
    info = 'minivllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    assert info in metrics, sorted(name for name in metrics if "lora" in name)
    assert abs(metrics[info] - time.time()) < 60
    assert metrics["minivllm:lora_adapter_loads_total"] >= 1
    assert metrics["minivllm:lora_adapter_evictions_total"] >= 0


def test_adapter_ids_are_never_given_twice(adapters):
    """The engine knows an adapter by its id (its slots, host cache and prefix cache): an id names one load of one
    adapter, so a name unloaded and loaded again gets a new one."""
    from engine.lora.adapter import LoRAAdapterError
    from server.lora import LoRARegistry, UnknownAdapterError

    registry = LoRARegistry("base", enabled=True, max_rank=16)
    first, second = registry.add("a", str(adapters["other"])), registry.add("b", str(adapters["large"]))
    assert (first.lora_int_id, second.lora_int_id) == (1, 2) and first.base_model_name == "base"
    assert registry.remove("a") == first and registry.get("a") is None
    assert registry.add("a", str(adapters["other"])).lora_int_id == 3
    assert registry.remove(lora_int_id=2) == second and [a.lora_name for a in registry] == ["a"]
    with pytest.raises(UnknownAdapterError):
        registry.remove("b")
    with pytest.raises(LoRAAdapterError, match="base_model_name 'another'"):
        registry.add("c", str(adapters["other"]), base_model_name="another")
    with pytest.raises(LoRAAdapterError, match="--enable-lora"):
        LoRARegistry("base").add("a", str(adapters["other"]))


def serve_error(*args: str) -> str:
    """What ``minivllm serve`` says when it refuses to start (before any model loads)."""
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--port", "0", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stderr


def test_bad_lora_modules_stop_the_start_up(tiny_model_path, adapters):
    model = ["--model", str(tiny_model_path)]
    assert "--lora-modules needs --enable-lora" in serve_error(*model, "--lora-modules", f"a={adapters['other']}")
    error = serve_error(*model, *SERVER_LORA_ARGS, "--lora-modules", f"a={adapters['other']}",
                        f"b={adapters['rank32']}")
    assert "--lora-modules b:" in error and "is above max_lora_rank (16)" in error
    assert "is not name=path" in serve_error(*model, "--enable-lora", "--lora-modules", "just-a-name")
