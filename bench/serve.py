"""Serving benchmark: load a running server with streamed completions and measure what clients see.

    python bench/serve.py --num-prompts 200 --random-input-len 512 --random-output-len 128 --request-rate 8
    python bench/serve.py --dataset-name sharegpt --dataset-path sharegpt.json --tokenizer /models/X \\
        --max-concurrency 16 --goodput ttft:500 tpot:50

Requests arrive as a Poisson process at ``--request-rate`` (``inf``: all at once), at most
``--max-concurrency`` in flight. Each streams ``/v1/completions`` with usage included; token
counts come from the server's usage, TTFT and ITL from chunk arrival times. Prints a table and
writes a JSON result plus PNG plots (latency CDFs, output throughput over time) to --result-dir.
Exits with 1 when no request succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_client import ClientConfig, RequestResult, first_model_id, send_request, warm_up  # noqa: E402
from serve_datasets import (  # noqa: E402
    SampleRequest,
    allowed_token_ids,
    load_tokenizer,
    sample_random,
    sample_sharegpt,  # noqa: E402
)
from serve_metrics import (  # noqa: E402
    BenchmarkMetrics,
    compute_metrics,
    format_table,
    latency_samples_ms,
    output_token_timeline,
    parse_goodput,
)

DEFAULT_RESULT_DIR = Path(__file__).resolve().parent / "out"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--model", default=None, help="model name to send; default: the first of /v1/models")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory: random prompts avoid its special tokens and span its vocabulary; "
                        "ShareGPT lengths are counted in its tokens (else in words)")
    p.add_argument("--dataset-name", choices=["random", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)]")
    p.add_argument("--random-prefix-len", type=int, default=0, help="tokens of a prefix every prompt shares")
    p.add_argument("--random-vocab-size", type=int, default=None,
                   help="random token ids are below this; default: the tokenizer's size, else 256")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="override every reply's length")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly max_tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, any of ttft:MS tpot:MS e2el:MS")
    p.add_argument("--result-dir", type=Path, default=DEFAULT_RESULT_DIR)
    p.add_argument("--result-filename", default=None, help="default: serve-<model>-<rate>qps-<time>.json")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def sample_requests(args: argparse.Namespace) -> list[SampleRequest]:
    rng = np.random.default_rng(args.seed)
    tokenizer = load_tokenizer(args.tokenizer)
    if args.dataset_name == "sharegpt":
        return sample_sharegpt(args.dataset_path, args.num_prompts, tokenizer, rng, args.sharegpt_output_len)
    token_ids = allowed_token_ids(tokenizer, args.random_vocab_size)
    return sample_random(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                         args.random_prefix_len, token_ids, rng)


# --------------------------------------------------------------------------- the run


async def arrivals(requests: list[SampleRequest], rate: float, rng: np.random.Generator):
    """Yield the requests with exponential gaps of mean 1/rate between them (none at rate inf)."""
    for i, request in enumerate(requests):
        if i > 0 and math.isfinite(rate):
            await asyncio.sleep(rng.exponential(1.0 / rate))
        yield request


async def run_benchmark(config: ClientConfig, requests: list[SampleRequest], rate: float,
                        max_concurrency: int | None, seed: int, show_progress: bool):
    """Send every request; return (results in send order, start time, duration in s)."""
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(requests), disable=not show_progress, desc="requests")

    async def limited(client: httpx.AsyncClient, request: SampleRequest) -> RequestResult:
        if semaphore is None:
            result = await send_request(client, config, request)
        else:
            async with semaphore:
                result = await send_request(client, config, request)
        progress.update(1)
        return result

    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as client:
        await warm_up(client, config)
        start_s = time.perf_counter()
        tasks = [asyncio.create_task(limited(client, r))
                 async for r in arrivals(requests, rate, np.random.default_rng(seed + 1))]
        results = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start_s
    progress.close()
    return list(results), start_s, duration_s


async def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    async with httpx.AsyncClient(timeout=30.0) as client:
        return await first_model_id(client, args.base_url, args.api_key)


# ------------------------------------------------------------------------- reporting


def result_paths(args: argparse.Namespace, model: str) -> tuple[Path, Path, Path]:
    """The JSON file, then the two PNGs beside it (same stem)."""
    if args.result_filename:
        json_path = args.result_dir / args.result_filename
    else:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        json_path = args.result_dir / f"serve-{Path(model).name}-{rate}qps-{stamp}.json"
    stem = json_path.with_suffix("")
    return json_path, Path(f"{stem}-latency-cdf.png"), Path(f"{stem}-throughput.png")


def request_record(request: SampleRequest, result: RequestResult, t0_s: float) -> dict:
    return {
        "success": result.success,
        "error": result.error,
        "dataset_prompt_len": request.prompt_len,
        "max_tokens": request.output_len,
        "start_s": result.start_s - t0_s,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "ttft_ms": result.ttft_s * 1000,
        "tpot_ms": result.tpot_s * 1000,
        "e2el_ms": result.latency_s * 1000,
        "itl_ms": [gap * 1000 for gap in result.itl_s],
        "num_chunks": len(result.chunk_times_s),
    }


def timeline_records(edges_s: np.ndarray, tokens_per_s: np.ndarray) -> list[dict]:
    return [{"start_s": float(start), "end_s": float(end), "output_tok_s": float(rate)}
            for start, end, rate in zip(edges_s[:-1], edges_s[1:], tokens_per_s)]


def result_document(args: argparse.Namespace, model: str, metrics: BenchmarkMetrics, requests: list[SampleRequest],
                    results: list[RequestResult], t0_s: float, timeline: tuple[np.ndarray, np.ndarray]) -> dict:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        "model": model,
        "config": config,
        **metrics.to_dict(),
        "output_throughput_timeline": timeline_records(*timeline),
        "requests": [request_record(q, r, t0_s) for q, r in zip(requests, results)],
    }


def write_outputs(args: argparse.Namespace, model: str, metrics: BenchmarkMetrics, requests: list[SampleRequest],
                  results: list[RequestResult], t0_s: float) -> Path:
    json_path, cdf_path, throughput_path = result_paths(args, model)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    timeline = output_token_timeline(results, t0_s, metrics.duration_s)
    document = result_document(args, model, metrics, requests, results, t0_s, timeline)
    # The numbers are written before any plot is drawn: a missing plotting library costs the pictures only.
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    if args.no_plots:
        return json_path
    from serve_plots import plot_latency_cdfs, plot_throughput

    title = f"{model}: {len(results)} requests, rate {document['config']['request_rate']}/s"
    try:
        plot_latency_cdfs(latency_samples_ms(results), cdf_path, title)
        plot_throughput(*timeline, metrics.output_throughput, throughput_path, title)
    except ImportError as exc:  # matplotlib is imported when the first plot is drawn
        print(f"no plots: {exc} (pip install matplotlib, or pass --no-plots); the results are in {json_path}",
              file=sys.stderr)
        return json_path
    document["plots"] = {"latency_cdf": str(cdf_path), "throughput": str(throughput_path)}
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    return json_path


def print_failures(results: list[RequestResult], max_shown: int = 5) -> None:
    errors = [r.error for r in results if not r.success]
    for error in errors[:max_shown]:
        print(f"failed request: {error}", file=sys.stderr)
    if len(errors) > max_shown:
        print(f"... and {len(errors) - max_shown} more failed requests", file=sys.stderr)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, float]]:
    """The arguments, checked, and the goodput SLOs in ms."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if not args.request_rate > 0:
        parser.error("--request-rate must be positive (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    if args.dataset_name == "sharegpt" and args.dataset_path is None:
        parser.error("--dataset-name sharegpt needs --dataset-path")
    try:
        return args, parse_goodput(args.goodput)
    except ValueError as exc:
        parser.error(str(exc))


def print_chunking_note(results: list[RequestResult]) -> None:
    """Warn when chunks carried many tokens each: TTFT and ITL then describe chunks, not tokens."""
    ok = [r for r in results if r.success and r.completion_tokens > 1]
    num_chunks, num_tokens = sum(len(r.chunk_times_s) for r in ok), sum(r.completion_tokens for r in ok)
    if ok and num_chunks < 0.5 * num_tokens:
        print(f"note: {num_tokens} tokens came in {num_chunks} chunks, so TTFT and ITL time chunks, not tokens "
              "(the server sends text only once it decodes; a model without a tokenizer sends none until the end)",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args, slos_ms = parse_args(argv)
    requests = sample_requests(args)
    model = asyncio.run(resolve_model(args))
    config = ClientConfig(base_url=args.base_url, model=model, api_key=args.api_key, ignore_eos=args.ignore_eos,
                          temperature=args.temperature)
    concurrency = args.max_concurrency or "unlimited"
    print(f"{len(requests)} {args.dataset_name} requests to {args.base_url} ({model}), "
          f"rate {args.request_rate}/s, max concurrency {concurrency}")
    results, t0_s, duration_s = asyncio.run(
        run_benchmark(config, requests, args.request_rate, args.max_concurrency, args.seed, not args.disable_tqdm))
    metrics = compute_metrics(results, duration_s, slos_ms)
    print_failures(results)
    print_chunking_note(results)
    print(format_table(metrics, slos_ms))
    print(f"results: {write_outputs(args, model, metrics, requests, results, t0_s)}")
    return 0 if metrics.completed else 1


if __name__ == "__main__":
    sys.exit(main())
