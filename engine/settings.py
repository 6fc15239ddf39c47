"""Every ``MINIVLLM_*`` environment variable minivllm reads, and the one module that reads them.

    variable                 default              values                                   used by
    MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING  false; true or 1: on                             server.app (serve)
    MINIVLLM_API_KEY         (none)               a key clients must send                  server.cli (serve)
    MINIVLLM_CACHE           ~/.cache/minivllm    a directory                              engine.loading.default_model
    MINIVLLM_DECODE_KSPLIT   auto                 auto, 0-16, or product=count,...         engine.models.linear.ksplit
    MINIVLLM_DECODE_TILES    (none)               BLOCK_N,warps,stages                     engine.ops.attention.launch
    MINIVLLM_GREEDY_ARGMAX   graph                graph, kernel, torch                     engine.ops.greedy
    MINIVLLM_MOE_BACKEND     triton               triton, torch                            engine.models.moe
    MINIVLLM_WORKER_CONFIG   (set by the engine)  an EngineConfig as JSON                  engine.worker.ranks

Each function below documents its variable and reads it when called, never at import: a variable changed at run
time (``monkeypatch.setenv`` in a test) counts from the next call, and there is no cache to reset. ``VARIABLES``
lists their names. Values are read here and interpreted by the module named above, whose errors name the variable
(``MINIVLLM_MOE_BACKEND must be 'triton' or 'torch', got 'cutlass'``). The performance settings (DECODE_KSPLIT,
DECODE_TILES, GREEDY_ARGMAX, MOE_BACKEND) are for measuring the engine's kernels (``bench/gpu_throughput.py
--env``); their defaults are what serving should use.

Other ``MINIVLLM_`` names belong to what surrounds the product and are not read by it: ``MINIVLLM_HEALTH_URL`` (the
Docker image's health check), ``MINIVLLM_ARGS`` and ``MINIVLLM_PORT`` (docker/compose.yaml), ``MINIVLLM_COMMIT``
(bench/offline_throughput.py, for a tree without .git), and the tests' ``MINIVLLM_TEST_TOKENIZER``,
``MINIVLLM_TEST_STEP_FAILS_AFTER`` and ``MINIVLLM_UPDATE_SCREENSHOT``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ALLOW_RUNTIME_LORA_UPDATING = "MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING"
API_KEY = "MINIVLLM_API_KEY"
CACHE = "MINIVLLM_CACHE"
DECODE_KSPLIT = "MINIVLLM_DECODE_KSPLIT"
DECODE_TILES = "MINIVLLM_DECODE_TILES"
GREEDY_ARGMAX = "MINIVLLM_GREEDY_ARGMAX"
MOE_BACKEND = "MINIVLLM_MOE_BACKEND"
WORKER_CONFIG = "MINIVLLM_WORKER_CONFIG"
VARIABLES = (ALLOW_RUNTIME_LORA_UPDATING, API_KEY, CACHE, DECODE_KSPLIT, DECODE_TILES, GREEDY_ARGMAX, MOE_BACKEND,
             WORKER_CONFIG)


def allow_runtime_lora_updating() -> bool:
    """``MINIVLLM_ALLOW_RUNTIME_LORA_UPDATING``: whether the server has ``POST /v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), read when the app is built. ``true``
    (any case) or ``1``: it has them; anything else, or unset: they are a 404, and the adapters are those of
    ``--lora-modules``."""
    return os.environ.get(ALLOW_RUNTIME_LORA_UPDATING, "").strip().lower() in ("true", "1")


def api_key() -> str | None:
    """``MINIVLLM_API_KEY``: the key every route but /health, /version, /load, /metrics, /dashboard and the OpenAPI
    docs requires (``Authorization: Bearer <key>``) when ``--api-key`` gives none. Default: unset, or empty, and no
    ``--api-key``: no authentication (the server warns when it then listens beyond the loopback)."""
    return os.environ.get(API_KEY) or None


def cache_dir() -> Path:
    """``MINIVLLM_CACHE``: the directory the embedded default model (SmolLM2-135M-Instruct) is converted into on
    first use, and read from after. Default (unset or empty): ``~/.cache/minivllm``. The Docker image sets
    ``/cache``."""
    return Path(os.environ.get(CACHE) or Path.home() / ".cache" / "minivllm")


def decode_ksplit() -> str:
    """``MINIVLLM_DECODE_KSPLIT``: how the products of decode-sized steps (up to 256 tokens) are cut along K into
    partial products that the next kernel adds as it reads them (``engine.models.linear.ksplit.decode_k_slices``), read
    when a model is built. ``auto`` (the default, and what unset or empty means): on a GPU, the products whose K is
    at least their width (o and down) get the most slices (a power of two up to 4) that keep their programs within
    one per SM, and nothing is cut on the CPU; ``0``
    or ``1``: no product is cut; one count from 2 to 16: every product (q|k|v, o, gate|up, down) in that many
    slices; ``qkv=2,o=4,gate_up=2,down=4``: counts by product, those not named whole. A count that does not cut K
    into multiples of 64 columns leaves its product whole. Returned with spaces dropped and in lower case."""
    return os.environ.get(DECODE_KSPLIT, "auto").replace(" ", "").lower() or "auto"


def decode_tiles() -> str | None:
    """``MINIVLLM_DECODE_TILES``: ``BLOCK_N,warps,stages`` (e.g. ``128,4,2``), the decode attention kernel's tiles
    for contexts it does not split, head_dim up to 128 (``engine.ops.attention``): BLOCK_N one of 16, 32, 64, 128,
    256, warps one of 1, 2, 4, 8, 16, stages 1 to 8. For measuring other tiles on a GPU. Default (unset or empty):
    None, the measured tiles (128 keys, 4 warps, 2 stages for 16-bit and FP8 caches alike)."""
    return os.environ.get(DECODE_TILES) or None


def greedy_argmax() -> str:
    """``MINIVLLM_GREEDY_ARGMAX``: where the greedy tokens of a step are taken (``engine.ops.greedy``), read when
    the decode CUDA graphs are captured and at each sampler call. ``graph`` (the default): by Triton kernels inside
    the decode CUDA graphs, by torch.argmax in eager steps; ``kernel``: by the kernels in graphs and in eager CUDA
    steps; ``torch``: by torch.argmax everywhere, after the graph."""
    return os.environ.get(GREEDY_ARGMAX, "graph")


def moe_backend() -> str:
    """``MINIVLLM_MOE_BACKEND``: how mixture-of-experts layers run their experts on CUDA (``engine.models.moe``),
    read at each forward. ``triton`` (the default, and what unset or empty means): the fused grouped-GEMM kernels,
    which CUDA graphs capture; ``torch``: the reference that gathers tokens per expert on the host, eagerly.
    Returned stripped and in lower case."""
    return os.environ.get(MOE_BACKEND, "triton").strip().lower() or "triton"


def worker_config() -> dict:
    """``MINIVLLM_WORKER_CONFIG``: the EngineConfig (``dataclasses.asdict``, as JSON) of the engine a tensor-parallel
    rank process belongs to. Rank 0 sets it for the rank processes it starts (``worker_env``); nobody sets it by
    hand. Returns the decoded fields."""
    value = os.environ.get(WORKER_CONFIG)
    if not value:
        raise RuntimeError(f"{WORKER_CONFIG} is not set: a rank process is started by the engine "
                           "(engine.worker.ranks.spawn_local_workers), not by hand")
    return json.loads(value)


def worker_env(config_json: str) -> dict[str, str]:
    """This process's environment with ``MINIVLLM_WORKER_CONFIG`` set to ``config_json``: a rank process's."""
    return dict(os.environ, **{WORKER_CONFIG: config_json})

