"""The HTTP server against the offline engine, on the same requests, in one invocation.

    python bench/serve_vs_offline.py                                    # CPU: C1 on the default model
    python bench/serve_vs_offline.py --shape qwen3-0.6b --tokenizer DIR # GPU: W1, dummy bf16 weights

1. Offline: ``LLM.generate`` on every request at once (output tok/s, per-request TPOT, the
   median decode step), then one request alone (the batch-1 decode step).
2. The same engine settings behind ``minivllm serve`` (a subprocess), loaded by streaming
   ``/v1/completions`` clients spread over ``--client-processes`` processes: every request
   at once; Poisson arrivals at each ``--rates`` fraction of the capacity just measured;
   then one stream alone.

Prompts are the workload's random token ids (below the tokenizer's size, so the streams
carry real text); EOS is ignored, so both paths generate exactly the same tokens. Prints
both, their ratio and the TTFT/TPOT/ITL percentiles; writes a JSON record to $OUT or bench/out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from serve_client import ClientConfig, RequestResult, send_request, warm_up  # noqa: E402
from serve_datasets import SampleRequest  # noqa: E402
from serve_metrics import compute_metrics  # noqa: E402
from workloads import WORKLOADS, Workload, shape_dir  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help="a model shape of bench/workloads.py, with dummy weights")
    p.add_argument("--model", default=None, help="a model directory (default: the embedded default model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's, or the default "
                                                     "model's for a --shape)")
    p.add_argument("--workload", default=None, choices=sorted(WORKLOADS), help="default: W1 on CUDA, C1 on the CPU")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--rates", type=float, nargs="*", default=[0.5, 0.8],
                   help="Poisson runs, as fractions of the capacity measured with every request at once")
    p.add_argument("--single-tokens", type=int, default=256, help="output tokens of the one-stream runs")
    p.add_argument("--client-processes", type=int, default=None, help="default: 4 on CUDA, 1 on the CPU")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for minivllm serve (repeatable)")
    p.add_argument("--server-variant", action="append", default=[], metavar="FLAGS",
                   help="after the first server, one more with these extra flags (e.g. '--cuda-graph-max-tokens 0'), "
                        "loaded the same way at the same arrival rates (repeatable)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", BENCH / "out")))
    return p


# --------------------------------------------------------------------------- offline


def run_offline(args, model_dir: str, prompts: list[list[int]], output_lens: list[int]) -> dict:
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(model_dir, **engine_kwargs(args))
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], greedy[:4], use_tqdm=False)  # warm-up
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    llm.engine.measure_steps(True)
    synchronize()
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == sum(output_lens), "every request must produce exactly its output length"
    tpot_ms = [1e3 * (o.metrics.last_token_time - o.metrics.first_token_time) / (n - 1)
               for o, n in zip(outputs, output_lens) if n > 1]
    ttft_ms = [1e3 * (o.metrics.first_token_time - o.metrics.arrival_time) for o in outputs]
    decode = _decode_steps(llm)
    llm.engine.measure_steps(True)
    single = llm.generate([{"prompt_token_ids": prompts[0]}],
                          SamplingParams(temperature=0.0, max_tokens=args.single_tokens, ignore_eos=True),
                          use_tqdm=False)[0]
    single_decode = _decode_steps(llm)
    m = single.metrics
    result = {
        "elapsed_s": elapsed, "output_tokens": num_out, "tok_s": num_out / elapsed,
        "tpot_ms": percentiles(tpot_ms), "ttft_ms": percentiles(ttft_ms),
        "decode_step_ms_median": decode["wall_ms_median"], "decode_batch_median": decode["batch_median"],
        "single_tpot_ms": 1e3 * (m.last_token_time - m.first_token_time) / (args.single_tokens - 1),
        "single_decode_step_ms_median": single_decode["wall_ms_median"],
    }
    return result


def run_in_subprocess(fn, *fn_args):
    """``fn(*fn_args)`` in a fresh process: whatever it holds on the device is gone when it returns."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        return pool.apply(fn, fn_args)


def _decode_steps(llm) -> dict:
    steps = [t for t in llm.engine.step_timings if t.num_tokens == t.num_reqs]  # one token per request
    if not steps:
        return {"wall_ms_median": float("nan"), "batch_median": 0}
    return {"wall_ms_median": float(np.median([t.wall_s for t in steps]) * 1e3),
            "batch_median": float(np.median([t.num_reqs for t in steps]))}


def engine_kwargs(args) -> dict:
    kwargs = dict(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    if args.shape:
        kwargs["load_format"] = "dummy"
    if args.tokenizer:
        kwargs["tokenizer"] = args.tokenizer
    return kwargs


# ------------------------------------------------------------------------------ HTTP


class Server:
    """``minivllm serve`` with the offline run's engine settings, on a free port, logging to a file."""

    def __init__(self, args, model_dir: str, log_path: Path, extra_args: list[str] = ()):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--model", model_dir, "--log-level", "warning"]
        for key, value in engine_kwargs(args).items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        cmd += args.server_arg + list(extra_args)
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=BENCH.parent, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the server did not become healthy")

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU seconds used so far by the API server process and by the engine core process."""
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return _cpu_seconds(pid), sum(_cpu_seconds(int(c)) for c in children)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self.log.close()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _client_process(config: ClientConfig, jobs: list[tuple[int, SampleRequest, float]], t0: float, queue) -> None:
    """Send each job at ``t0 + offset`` (monotonic seconds: the same clock in every process)."""

    async def one(client, index, request, offset):
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        return index, await send_request(client, config, request)

    async def run():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as client:
            await warm_up(client, config)  # before t0: the first timed request pays nothing extra
            return await asyncio.gather(*(one(client, i, r, o) for i, r, o in jobs))

    cpu_start = time.process_time()
    results = asyncio.run(run())
    queue.put((results, time.process_time() - cpu_start))


def run_http(url: str, model: str, requests: list[SampleRequest], offsets: list[float],
             num_processes: int) -> tuple[list[RequestResult], float, float, float]:
    """Send every request at its offset from a common start; returns the results (in request order),
    the duration from the start to the last response, the start, and the clients' CPU seconds."""
    config = ClientConfig(base_url=url, model=model, ignore_eos=True, temperature=0.0)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    jobs = [(i, r, o) for i, (r, o) in enumerate(zip(requests, offsets))]
    t0 = time.monotonic() + 2.0  # every client process is up and waiting by then
    procs = [context.Process(target=_client_process, args=(config, jobs[k::num_processes], t0, queue))
             for k in range(num_processes)]
    for proc in procs:
        proc.start()
    results: list[RequestResult | None] = [None] * len(requests)
    client_cpu_s = 0.0
    for _ in procs:
        done, cpu_s = queue.get()
        client_cpu_s += cpu_s
        for index, result in done:
            results[index] = result
    for proc in procs:
        proc.join()
    queue.close()
    queue.join_thread()
    end = max(r.start_s + r.latency_s for r in results if r.success)
    return results, end - t0, t0, client_cpu_s


def http_run(server: Server, model: str, requests: list[SampleRequest], offsets: list[float],
             num_processes: int) -> dict:
    """One load run: what the clients saw, what the server's metrics saw, and who used the CPU."""
    before_metrics, before_cpu = scrape(server.url), server.cpu_seconds()
    results, duration, t0, client_cpu_s = run_http(server.url, model, requests, offsets, num_processes)
    after_metrics, after_cpu = scrape(server.url), server.cpu_seconds()
    metrics = compute_metrics(results, duration, {})
    lat = metrics.latency_ms
    return {
        "completed": metrics.completed, "failed": metrics.failed, "duration_s": duration,
        "output_tokens": metrics.total_output_tokens, "tok_s": metrics.output_throughput,
        "ttft_ms": _stats(lat["ttft"]), "tpot_ms": _stats(lat["tpot"]), "itl_ms": _stats(lat["itl"]),
        "errors": sorted({r.error for r in results if not r.success})[:3],
        "server_side_ms": {name: histogram_quantiles(before_metrics, after_metrics, f"minivllm:{name}_seconds")
                           for name in ("time_to_first_token", "request_queue_time", "engine_output_delay",
                                        "output_processing")},
        "steps": step_counts(before_metrics, after_metrics),
        "cpu_cores_busy": {"api_server": (after_cpu[0] - before_cpu[0]) / duration,
                           "engine_core": (after_cpu[1] - before_cpu[1]) / duration,
                           "clients": client_cpu_s / duration},
        "requests": [{"offset_s": r.start_s - t0, "prompt_len": q.prompt_len, "ttft_ms": r.ttft_s * 1e3,
                      "e2el_ms": r.latency_s * 1e3, "tokens": r.completion_tokens, "chunks": len(r.chunk_times_s)}
                     for q, r in zip(requests, results)],
    }


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            le, kind = sample.labels.get("le"), sample.labels.get("kind")
            label = le if le is not None else kind
            samples[f"{sample.name}{{{label}}}" if label is not None else sample.name] = sample.value
    return samples


STEP_KINDS = ("decode_graph", "mixed_graph", "eager")


def step_counts(before: dict, after: dict) -> dict[str, int]:
    """The forward passes the engine ran between two scrapes, by how they ran (``minivllm:engine_steps_total``):
    a decode graph, a mixed-step graph, or eagerly."""
    key = "minivllm:engine_steps_total{{{}}}".format
    return {kind: int(after.get(key(kind), 0) - before.get(key(kind), 0)) for kind in STEP_KINDS}


def histogram_quantiles(before: dict, after: dict, name: str, qs=(0.5, 0.9, 0.99)) -> dict:
    """Quantiles (ms, as bucket upper bounds) of the observations a histogram gained between two scrapes."""
    bounds = sorted((float(k[len(name) + 8:-1]), k) for k in after if k.startswith(name + "_bucket{"))
    total = after.get(name + "_count", 0) - before.get(name + "_count", 0)
    out = {"count": total}
    for q in qs:
        for bound, key in bounds:
            if after[key] - before.get(key, 0) >= q * total:
                out[f"p{round(q * 100)}"] = bound * 1e3
                break
    return out


def _stats(s) -> dict:
    return {"p50": s.median, "p90": s.p90, "p99": s.p99, "mean": s.mean}


def percentiles(samples: list[float]) -> dict:
    if not samples:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan")}
    p50, p90, p99 = np.percentile(samples, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(samples))}


def poisson_offsets(num: int, rate: float, seed: int) -> list[float]:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# ------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging

    import torch
    from offline_throughput import git_commit
    from serve_datasets import load_tokenizer

    from engine.config import EngineConfig
    from engine.core.llm_engine import resolve_model_path
    from engine.loading.model_config import ModelConfig

    logging.basicConfig(level=logging.WARNING)
    on_cuda = torch.cuda.is_available()
    if args.shape:
        model_dir = str(shape_dir(args.shape))
        args.tokenizer = args.tokenizer or resolve_model_path(EngineConfig())
    else:
        model_dir = args.model or resolve_model_path(EngineConfig())
    workload = WORKLOADS[args.workload or ("W1" if on_cuda else "C1")]
    if args.num_requests:
        workload = Workload(workload.name, args.num_requests, workload.prompt_len, workload.output_len, workload.seed)
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    vocab = min(ModelConfig.from_pretrained(model_dir).vocab_size, len(tokenizer))
    prompts, output_lens = workload.sample(vocab)
    num_clients = args.client_processes or (4 if on_cuda else 1)
    args.out.mkdir(parents=True, exist_ok=True)
    label = args.shape or Path(model_dir).name

    print(f"offline: {workload.name} ({len(prompts)} requests, {sum(output_lens)} output tokens) on {label}", flush=True)
    offline = run_in_subprocess(run_offline, args, model_dir, prompts, output_lens)  # its GPU memory is freed
    print(f"  {offline['tok_s']:.0f} tok/s", flush=True)

    requests = [SampleRequest(prompt=p, prompt_len=len(p), output_len=n) for p, n in zip(prompts, output_lens)]
    single = SampleRequest(prompt=prompts[0], prompt_len=len(prompts[0]), output_len=args.single_tokens)
    variants: dict[str, dict[str, dict]] = {}
    server_rc, capacity_rps = 0, None
    for i, flags in enumerate([""] + args.server_variant):
        server = Server(args, model_dir, args.out / f"server{i or ''}.log", shlex.split(flags))
        runs = variants[flags] = {}
        try:
            server.wait_healthy()
            name = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            print(f"HTTP{' with ' + flags if flags else ''}: {num_clients} client processes", flush=True)
            runs["all at once"] = http_run(server, name, requests, [0.0] * len(requests), num_clients)
            # Every server meets the arrival rates the first one's burst set.
            capacity_rps = capacity_rps or len(requests) / runs["all at once"]["duration_s"]
            for fraction in args.rates:
                rate = fraction * capacity_rps
                offsets = poisson_offsets(len(requests), rate, seed=workload.seed + 1)
                runs[f"Poisson {fraction:.0%} ({rate:.1f} req/s)"] = http_run(server, name, requests, offsets,
                                                                             num_clients)
            runs["one stream"] = http_run(server, name, [single], [0.0], 1)
        finally:
            server_rc = server.stop() or server_rc
    runs = variants.pop("")

    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": git_commit(), "model": label,
              "tokenizer": args.tokenizer, "workload": workload.__dict__, "num_requests": len(prompts),
              "machine": torch.cuda.get_device_name() if on_cuda else f"{platform.machine()} CPU, "
              f"{os.cpu_count()} cores", "client_processes": num_clients, "offline": offline, "http": runs,
              "http_variants": variants, "server_exit_code": server_rc}
    path = args.out / f"serve_vs_offline_{label}_{workload.name}.json"
    path.write_text(json.dumps(record, indent=2))
    print(report(record))
    print(f"record: {path}")
    failed = sum(r["failed"] for runs_ in [runs, *variants.values()] for r in runs_.values())
    return 1 if failed or server_rc != 0 else 0


def report(record: dict) -> str:
    off = record["offline"]
    lines = [f"\n{record['model']} {record['workload']['name']} on {record['machine']}, commit {record['commit']}",
             f"{'path':<34} {'out tok/s':>10} {'vs offline':>10}  {'TTFT p50 / p99 ms':>19}  "
             f"{'TPOT p50 / p99 ms':>19}  {'ITL p50 / p99 ms':>18}",
             f"{'LLM.generate, all at once':<34} {off['tok_s']:>10.0f} {'1.00':>10}  "
             f"{_pair(off['ttft_ms']):>19}  {_pair(off['tpot_ms']):>19}  {'':>18}"]
    variants = {"": record["http"], **record.get("http_variants", {})}
    for flags, runs in variants.items():
        if flags:
            lines.append(f"with {flags}:")
        for name, run in runs.items():
            ratio = f"{run['tok_s'] / off['tok_s']:.2f}" if name == "all at once" else ""
            lines.append(f"{'HTTP, ' + name:<34} {run['tok_s']:>10.0f} {ratio:>10}  {_pair(run['ttft_ms']):>19}  "
                         f"{_pair(run['tpot_ms']):>19}  {_pair(run['itl_ms']):>18}")
    one = record["http"]["one stream"]
    lines.append(f"decode step, offline median: {off['decode_step_ms_median']:.2f} ms at batch "
                 f"{off['decode_batch_median']:.0f}; HTTP TPOT p50 / that: "
                 f"{record['http']['all at once']['tpot_ms']['p50'] / off['decode_step_ms_median']:.2f}; "
                 f"offline TPOT p50: {off['tpot_ms']['p50']:.2f} ms")
    lines.append(f"one stream: batch-1 decode step {off['single_decode_step_ms_median']:.2f} ms, offline TPOT "
                 f"{off['single_tpot_ms']:.2f} ms, HTTP TPOT {one['tpot_ms']['p50']:.2f} ms "
                 f"({one['tpot_ms']['p50'] / off['single_decode_step_ms_median']:.2f}x the step)")
    lines.append("server side (ms, bucket bounds): TTFT p50/p99, queue p99, output delay p50/p99, "
                 "processing p50/p99 per step; CPU cores busy: API server, engine core, clients; "
                 "steps: decode graph / mixed-step graph / eager")
    for name, run in ((f"{flags + ': ' if flags else ''}{name}", run) for flags, runs in variants.items()
                      for name, run in runs.items()):
        side, cpu = run["server_side_ms"], run["cpu_cores_busy"]
        ttft, queue, delay, proc = (side[k] for k in ("time_to_first_token", "request_queue_time",
                                                      "engine_output_delay", "output_processing"))
        lines.append(f"  {name:<32} {ttft.get('p50', 0):g}/{ttft.get('p99', 0):g}  {queue.get('p99', 0):g}  "
                     f"{delay.get('p50', 0):g}/{delay.get('p99', 0):g}  {proc.get('p50', 0):g}/{proc.get('p99', 0):g}"
                     f"   cpu {cpu['api_server']:.2f} / {cpu['engine_core']:.2f} / {cpu['clients']:.2f}"
                     f"   steps {' / '.join(str(run.get('steps', {}).get(k, '-')) for k in STEP_KINDS)}")
    for name, run in ((f"{flags + ': ' if flags else ''}{name}", run) for flags, runs in variants.items()
                      for name, run in runs.items()):
        if run["failed"]:
            lines.append(f"{name}: {run['failed']} failed, e.g. {run['errors']}")
    return "\n".join(lines)


def _pair(stats: dict) -> str:
    if any(math.isnan(stats[k]) for k in ("p50", "p99")):
        return "-"
    return f"{stats['p50']:.1f} / {stats['p99']:.1f}"


if __name__ == "__main__":
    sys.exit(main())
