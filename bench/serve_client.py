"""One streamed ``/v1/completions`` request, timed chunk by chunk.

    send ──> first chunk with a choice (TTFT) ──> more chunks (ITL: gaps between them)
         ──> usage chunk (prompt_tokens, completion_tokens) ──> [DONE] (end-to-end latency)

A request succeeds only if the stream ends with ``[DONE]`` after a ``usage`` chunk and no
error event: token counts always come from the server, never from the client's guesses.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
from serve_datasets import SampleRequest


@dataclass
class RequestResult:
    """Times are ``time.perf_counter()`` seconds; ``chunk_times_s`` are absolute, the rest durations."""

    success: bool = False
    error: str = ""
    start_s: float = 0.0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of every chunk that carries a choice
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive chunks: one per chunk after the first."""
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first; 0 for a single-token answer."""
        if self.completion_tokens <= 1:
            return 0.0
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout_s: float = 6 * 60 * 60  # a long benchmark must not fail on a client timeout


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def completion_payload(config: ClientConfig, request: SampleRequest) -> dict:
    payload = {
        "model": config.model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        payload["ignore_eos"] = True
    return payload


async def send_request(client: httpx.AsyncClient, config: ClientConfig, request: SampleRequest,
                       token_ids: list[int] | None = None) -> RequestResult:
    """Stream one completion; never raises (a failure is a result with ``success=False``). ``token_ids``: a list
    to collect the answer's token ids into (the request asks for ``return_token_ids``)."""
    result = RequestResult(start_s=time.perf_counter())
    url = config.base_url.rstrip("/") + "/v1/completions"
    payload = completion_payload(config, request)
    if token_ids is not None:
        payload["return_token_ids"] = True
    try:
        async with client.stream("POST", url, json=payload, headers=headers(config.api_key)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            await read_stream(response, result, token_ids)
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:  # includes malformed JSON
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def read_stream(response: httpx.Response, result: RequestResult, token_ids: list[int] | None = None) -> None:
    """Fill ``result`` from the SSE lines of ``response`` (and ``token_ids`` with the chunks' token ids)."""
    got_usage = False
    async for line in response.aiter_lines():
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue  # blank separators and SSE comments
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            result.latency_s = now - result.start_s
            finish(result, got_usage)
            return
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = f"error event: {chunk['error'].get('message', chunk['error'])}"
            return
        if chunk.get("choices"):
            if not result.chunk_times_s:
                result.ttft_s = now - result.start_s
            result.chunk_times_s.append(now)
            if token_ids is not None:
                token_ids += chunk["choices"][0].get("token_ids") or []
        if chunk.get("usage"):
            got_usage = True
            read_usage(chunk["usage"], result)
    result.error = "the stream ended without [DONE]"


def read_usage(usage: dict, result: RequestResult) -> None:
    result.prompt_tokens = int(usage["prompt_tokens"])
    result.completion_tokens = int(usage["completion_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = int(details.get("cached_tokens") or 0)


def finish(result: RequestResult, got_usage: bool) -> None:
    if not got_usage:
        result.error = "the stream had no usage chunk (the server must honour stream_options.include_usage)"
    elif not result.chunk_times_s:
        result.error = "the stream had no chunk with a choice"
    else:
        result.success = True


async def warm_up(client: httpx.AsyncClient, config: ClientConfig) -> None:
    """One untimed request (``/v1/models``) before the timed ones. A client's first request pays for the lazy
    imports and the connection behind it (20-50 ms in a fresh process on a desktop, more on a busy host): without
    this that cost would land on the first timed request's TTFT."""
    response = await client.get(config.base_url.rstrip("/") + "/v1/models", headers=headers(config.api_key))
    response.raise_for_status()


async def first_model_id(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    response = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers(api_key))
    response.raise_for_status()
    models = response.json()["data"]
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]
