"""minivllm's HTTP server: an OpenAI-compatible API on FastAPI and uvicorn.

    cli/            ``minivllm serve``: flags (the engine's from EngineConfig) -> uvicorn, draining shutdown
    listeners.py    the listening sockets, bound before the model loads
    app.py          the FastAPI app: routes, lifespan
    routing.py      the root path; each route's API key and body limits
    completions.py  /v1/completions          chat.py  /v1/chat/completions
    serving.py      what both share: admission, whole vs streamed answers
    generation.py   one request fanned out into engine requests, merged back
    streaming.py    SSE framing and client disconnects
    tokenization.py prompts, chat templates, token strings
    protocol/       the OpenAI wire format (pydantic), by endpoint
    metrics.py      Prometheus metrics          errors.py  OpenAI-shaped errors
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path


def _version() -> str:
    try:
        return metadata.version("minivllm")
    except metadata.PackageNotFoundError:  # running from a source checkout
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.is_file() else None
        return found.group(1) if found else "unknown"


__version__ = _version()
