"""Multi-turn chat against a small device KV pool: what the host KV tier buys over recomputing evicted history.

    # CPU smoke (embedded default model, float32), both servers, a couple of minutes on 2 cores:
    python bench/multi_turn_kv.py --conversations 6 --turns 3 --system-tokens 128 --user-tokens 32 \\
        --max-tokens 8 --concurrency 3
    # GPU (dummy bf16 weights of a real shape; the tokenizer only bounds the random token ids):
    python bench/multi_turn_kv.py --shape qwen3-0.6b --tokenizer DIR

The conversations (the same script for every server, reproducible with --seed): N conversations (--conversations)
of T turns (--turns). Turn 1's prompt is a system prompt of S tokens (--system-tokens, the same for every
conversation) and a user message of U tokens (--user-tokens LO HI: uniform, per turn); turn k+1's prompt is turn
k's whole prompt, the O tokens (--max-tokens) the server answered (their ids, from ``return_token_ids``) and a new
user message. Random token ids below the tokenizer's size, sent as token-id prompts to a streamed
``/v1/completions`` (temperature 0, ``ignore_eos``), so every turn answers exactly O tokens.

Load: closed loop. At most C turns are in flight (--concurrency), each of a different conversation; a conversation
sends its next turn only once its last one has finished (+ --think-time). --active-conversations A (default: all N)
conversations are open at once, and a conversation whose turns are done gives its place to the next one. With A = N
the turns go round: turn 1 of every conversation, then turn 2 of every one, ..., so between two turns of one
conversation the other A - 1 conversations' turns pass through the device pool. Conversations are dealt over
--client-processes processes (conversation i to process i mod P), each with its share of C and A.

The device pool (--num-kvcache-blocks, or computed) is a fraction of the working set: the blocks of every
conversation's final history (prompt of its last turn + its answer), the system prompt's full blocks counted once
(they are one cached prefix), is --working-set-ratio (default 4) times the pool. The pool never goes below what one
final history needs. The host tier (--kv-offloading-size, or computed) holds the whole working set, +10%.

Servers, one after the other, on the same script: (a) "recompute": no host tier; (b) "host-tier":
``--kv-offloading-size G --preemption-mode auto``. --variant NAME=FLAGS (repeatable) runs these servers instead,
each with its own extra flags; ``{tier_gib}`` in FLAGS is replaced by the computed tier size (e.g.
``--variant recompute= --variant swap="--kv-offloading-size {tier_gib} --preemption-mode swap"``). The first one
is the baseline of the ratios. On CUDA, a plain pinned-memory copy (1 GiB, host -> device and back, non_blocking,
timed with CUDA events) is measured in the same invocation, to quote the tier's copies as a fraction of it.

Printed columns, per server:
  out tok/s, req/s          generated tokens (and finished turns) per second, first send to last answer
  TTFT all p50/p90/p99      time to first token of every turn (ms, client side)
  TTFT t>=2 p50/p90/p99     of turns 2 and later: the ones whose history may be cached (device or host tier)
  TPOT p50/p99              per turn, (last token - first token) / (tokens - 1), ms
  prefix hit                device prefix cache, tokens found / tokens looked up (/metrics deltas)
  host hit                  host tier (external prefix cache): tokens found / tokens looked up there
  cached t>=2               the turns >= 2's prompt tokens the server reported cached (usage.cached_tokens)
  preempt                   requests preempted during the run
  swap out/in               blocks of requests preempted by swap, out and back (kv_swap_*_blocks_total: blocks the
                            host tier or the device cache still held count too; the copies are the next columns)
  to host / to device       GiB copied each way (kv_offload_bytes_total), the copies' seconds
                            (kv_offload_seconds_total) and their rate, GB/s (and the fraction of the pinned copy)
  same outputs              the turns whose answer matched the baseline server's token for token (a divergence,
                            which other batches' rounding may cause, changes the conversation's later prompts)
  engine CPU s              CPU seconds the engine core process used during the run
Figures the server does not export print n/a. The ratios at the end: TTFT p50 baseline / this server (overall and
turns >= 2; > 1: this server is faster) and output tok/s this server / baseline. A JSON record goes to $OUT (or
bench/out), the servers' logs next to it.

On a CPU that other jobs share, the servers' torch threads wait for each other and a run can take many times longer
(CPU seconds too: they spin while they wait); OMP_NUM_THREADS=1 in the environment keeps the two servers comparable.
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
import sys
import time
from argparse import Namespace
from pathlib import Path

import httpx
import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from serve_client import ClientConfig, RequestResult, send_request, warm_up  # noqa: E402
from serve_datasets import SampleRequest  # noqa: E402
from serve_metrics import LatencyStats, compute_metrics  # noqa: E402
from serve_vs_offline import Server, run_in_subprocess  # noqa: E402
from workloads import shape_dir  # noqa: E402

PREFIX = "minivllm:"
DIRECTIONS = ("to_host", "to_device")
TIER_MARGIN = 1.1  # the computed host tier holds the working set and this much more


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default=None, help="a model shape of bench/workloads.py, with dummy weights")
    p.add_argument("--model", default=None, help="a model directory (default: the embedded default model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's, or the default "
                                                     "model's for a --shape)")
    p.add_argument("--conversations", type=int, default=200, help="N")
    p.add_argument("--turns", type=int, default=5, help="T")
    p.add_argument("--system-tokens", type=int, default=2048, help="S: the shared system prompt")
    p.add_argument("--user-tokens", type=int, nargs="+", default=[100, 300], metavar="U",
                   help="a user message's tokens: LO HI (uniform, inclusive) or one fixed length")
    p.add_argument("--max-tokens", type=int, default=128, help="O: tokens answered per turn")
    p.add_argument("--concurrency", type=int, default=32, help="C: turns in flight at once")
    p.add_argument("--active-conversations", type=int, default=None,
                   help="A: conversations open at once (default: all of them)")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds between a turn's answer and the next turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (--kvcache-block-size)")
    p.add_argument("--num-kvcache-blocks", type=int, default=None, help="the device pool (default: computed)")
    p.add_argument("--working-set-ratio", type=float, default=4.0, help="working set / device pool, when computed")
    p.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GiB of the host tier (default: the working set + 10%%)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="a server to run, with these extra flags (repeatable; replaces the default pair; "
                        "{tier_gib} in FLAGS is the computed tier size); the first is the baseline")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the longest final history, rounded up "
                                                                    "to a block")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the concurrency")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--client-processes", type=int, default=None, help="default: 4 on CUDA, 1 on the CPU")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for every server (repeatable)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", BENCH / "out")))
    return p


# ------------------------------------------------------------------------------ the script


def make_script(args, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt, and each conversation's user messages (T lists of token ids)."""
    rng = np.random.default_rng(args.seed)
    lo, hi = (args.user_tokens * 2)[:2]
    system = rng.integers(0, vocab, args.system_tokens).tolist()
    conversations = []
    for _ in range(args.conversations):
        lens = rng.integers(lo, hi + 1, args.turns)
        conversations.append([rng.integers(0, vocab, int(n)).tolist() for n in lens])
    return system, conversations


def final_lengths(args, conversations: list[list[list[int]]]) -> list[int]:
    """Each conversation's final history: its last prompt and its last answer."""
    return [args.system_tokens + sum(len(m) for m in msgs) + args.turns * args.max_tokens for msgs in conversations]


def working_set_blocks(args, lengths: list[int]) -> tuple[int, int]:
    """(distinct blocks: the system prompt's full blocks once, every conversation's own after them;
    the plain sum of every final history's blocks)."""
    bs = args.block_size
    shared = args.system_tokens // bs
    per_conversation = [-(-n // bs) for n in lengths]
    return shared + sum(b - shared for b in per_conversation), sum(per_conversation)


# ------------------------------------------------------------------------------ clients


async def send_turn(client: httpx.AsyncClient, config: ClientConfig, request: SampleRequest
                    ) -> tuple[RequestResult, list[int]]:
    """One streamed turn (``serve_client.send_request``), with the answer's token ids (``return_token_ids``)."""
    token_ids: list[int] = []
    result = await send_request(client, config, request, token_ids)
    if result.success and len(token_ids) != result.completion_tokens:
        result.success = False
        result.error = f"{len(token_ids)} token ids streamed for {result.completion_tokens} completion tokens"
    return result, token_ids


def _client_process(config: ClientConfig, system: list[int], conversations: list[tuple[int, list[list[int]]]],
                    max_tokens: int, slots: int, active: int, think_s: float, t0: float, queue) -> None:
    """Run this process's conversations from ``t0`` (perf_counter seconds: CLOCK_MONOTONIC, the same in every
    process): at most ``slots`` turns in flight, ``active`` conversations open."""

    async def conversation(index, messages, client, inflight, open_, records):
        async with open_:  # FIFO: conversations open in their order
            history: list[int] = list(system)
            for turn, message in enumerate(messages):
                if turn and think_s:
                    await asyncio.sleep(think_s)
                prompt = history + message
                async with inflight:
                    result, answer = await send_turn(client, config, SampleRequest(prompt, len(prompt), max_tokens))
                records.append({"conversation": index, "turn": turn + 1, "prompt_len": len(prompt),
                                "result": result, "answer": answer})
                if not result.success:
                    return  # its later turns cannot be built
                history = prompt + answer

    async def run():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as client:
            await warm_up(client, config)
            await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
            inflight, open_, records = asyncio.Semaphore(slots), asyncio.Semaphore(active), []
            await asyncio.gather(*(conversation(i, msgs, client, inflight, open_, records)
                                   for i, msgs in conversations))
            return records

    cpu_start = time.process_time()
    records = asyncio.run(run())
    queue.put((records, time.process_time() - cpu_start))


def _share(total: int, k: int, parts: int) -> int:
    return total // parts + (1 if k < total % parts else 0)


def run_conversations(url: str, model: str, args, system, conversations, num_processes: int) -> dict:
    config = ClientConfig(base_url=url, model=model, ignore_eos=True, temperature=0.0)
    active = args.active_conversations or len(conversations)
    num_processes = max(1, min(num_processes, args.concurrency, active))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    t0 = time.perf_counter() + 2.0  # every client process is up and waiting by then
    procs = []
    for k in range(num_processes):
        mine = [(i, c) for i, c in enumerate(conversations) if i % num_processes == k]
        procs.append(context.Process(target=_client_process, args=(
            config, system, mine, args.max_tokens, _share(args.concurrency, k, num_processes),
            max(1, _share(active, k, num_processes)), args.think_time, t0, queue)))
    for proc in procs:
        proc.start()
    records, client_cpu_s = [], 0.0
    for _ in procs:
        done, cpu_s = queue.get()
        records += done
        client_cpu_s += cpu_s
    for proc in procs:
        proc.join()
    queue.close()
    queue.join_thread()
    records.sort(key=lambda r: (r["conversation"], r["turn"]))
    ends = [r["result"].start_s + r["result"].latency_s for r in records if r["result"].success]
    duration = (max(ends) if ends else time.perf_counter()) - t0
    return {"records": records, "duration_s": duration, "t0": t0, "client_cpu_s": client_cpu_s}


def warm_up_completion(url: str, model: str, vocab: int, length: int, seed: int) -> None:
    """One untimed short turn of unrelated tokens, so the first timed turn pays for no lazy start-up."""
    config = ClientConfig(base_url=url, model=model, ignore_eos=True, temperature=0.0)
    prompt = np.random.default_rng(seed + 12345).integers(0, vocab, length).tolist()

    async def one():
        async with httpx.AsyncClient(timeout=config.timeout_s) as client:
            return await send_turn(client, config, SampleRequest(prompt, len(prompt), 4))

    result, _ = asyncio.run(one())
    if not result.success:
        raise RuntimeError(f"the warm-up turn failed: {result.error}")


# ------------------------------------------------------------------------------ metrics


def scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed ``name`` or ``name{label=value,...}`` (labels sorted, ``le`` included)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def delta(before: dict, after: dict, name: str, **labels) -> float | None:
    """How much a counter grew between two scrapes; None when the server does not export it."""
    key = PREFIX + name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
    if key not in after:
        return None
    return after[key] - before.get(key, 0.0)


def gauge(samples: dict, name: str) -> float | None:
    return samples.get(PREFIX + name)


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def kv_figures(before: dict, after: dict) -> dict:
    q, h = delta(before, after, "prefix_cache_queries_total"), delta(before, after, "prefix_cache_hits_total")
    eq = delta(before, after, "external_prefix_cache_queries_total")
    eh = delta(before, after, "external_prefix_cache_hits_total")
    out = {
        "prefix_cache_queries": q, "prefix_cache_hits": h, "prefix_cache_hit_rate": ratio(h, q),
        "external_prefix_cache_queries": eq, "external_prefix_cache_hits": eh,
        "external_prefix_cache_hit_rate": ratio(eh, eq),
        "num_preemptions": delta(before, after, "num_preemptions_total"),
        "swap_out_blocks": delta(before, after, "kv_swap_out_blocks_total"),
        "swap_in_blocks": delta(before, after, "kv_swap_in_blocks_total"),
        "device_blocks_total": gauge(after, "kv_cache_blocks_total"),
        "host_blocks_total": gauge(after, "kv_host_blocks_total"),
        "host_blocks_used_after": gauge(after, "kv_host_blocks_used"),
        "copies": {},
    }
    for d in DIRECTIONS:
        nbytes = delta(before, after, "kv_offload_bytes_total", direction=d)
        seconds = delta(before, after, "kv_offload_seconds_total", direction=d)
        out["copies"][d] = {"bytes": nbytes, "seconds": seconds,
                            "gb_s": ratio(nbytes / 1e9, seconds) if nbytes else None}  # None: nothing copied
    return out


def turn_figures(run: dict, turns_from: int = 1) -> dict:
    ok = [r for r in run["records"] if r["result"].success and r["turn"] >= turns_from]
    ttft = LatencyStats.of([r["result"].ttft_s * 1e3 for r in ok])
    prompt = sum(r["result"].prompt_tokens for r in ok)
    cached = sum(r["result"].cached_tokens for r in ok)
    return {"count": len(ok), "ttft_ms": _stats(ttft), "cached_fraction": ratio(cached, prompt),
            "prompt_tokens": prompt, "cached_tokens": cached}


def _stats(s: LatencyStats) -> dict:
    return {"p50": s.median, "p90": s.p90, "p99": s.p99, "mean": s.mean, "count": s.count}


def summarize(run: dict, before: dict, after: dict) -> dict:
    results = [r["result"] for r in run["records"]]
    m = compute_metrics(results, run["duration_s"], {})
    lat = m.latency_ms
    return {
        "completed": m.completed, "failed": m.failed,
        "turns_not_sent": None,  # filled by the caller, which knows the script
        "duration_s": run["duration_s"], "output_tokens": m.total_output_tokens, "prompt_tokens": m.total_input_tokens,
        "tok_s": m.output_throughput, "req_s": m.request_throughput,
        "ttft_ms": _stats(lat["ttft"]), "tpot_ms": _stats(lat["tpot"]), "itl_ms": _stats(lat["itl"]),
        "turn1": turn_figures({"records": [r for r in run["records"] if r["turn"] == 1]}),
        "turns2plus": turn_figures(run, 2),
        "kv": kv_figures(before, after),
        "errors": sorted({r.error for r in results if not r.success})[:3],
        "turns": [{"conversation": r["conversation"], "turn": r["turn"], "prompt_len": r["prompt_len"],
                   "offset_s": r["result"].start_s - run["t0"], "ttft_ms": r["result"].ttft_s * 1e3,
                   "e2el_ms": r["result"].latency_s * 1e3, "tokens": r["result"].completion_tokens,
                   "cached_tokens": r["result"].cached_tokens, "ok": r["result"].success}
                  for r in run["records"]],
    }


# ------------------------------------------------------------------------------ pinned copies


def pinned_copy_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> dict:
    """GB/s of a plain pinned host <-> device copy (non_blocking, CUDA events): best and median of ``repeats``."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = {"bytes": nbytes}
    for name, dst, src in (("to_device", device, host), ("to_host", host, device)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        rates = []
        for _ in range(repeats):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            rates.append(nbytes / (start.elapsed_time(end) * 1e-3) / 1e9)
        out[name] = {"gb_s_best": max(rates), "gb_s_median": float(np.median(rates))}
    return out


# ------------------------------------------------------------------------------ main


def parse_variants(specs: list[str], tier_gib: float) -> list[tuple[str, str]]:
    if not specs:
        return [("recompute", ""), ("host-tier", f"--kv-offloading-size {tier_gib:g} --preemption-mode auto")]
    variants = []
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name:
            raise SystemExit(f"--variant takes NAME=FLAGS, got {spec!r}")
        variants.append((name, flags.replace("{tier_gib}", f"{tier_gib:g}")))
    return variants


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import logging

    import torch
    from offline_throughput import git_commit
    from serve_datasets import load_tokenizer

    from engine.config import EngineConfig
    from engine.core.llm_engine import resolve_model_path
    from engine.loading.model_config import ModelConfig
    from kvcache.paged_cache import PagedKVCache

    logging.basicConfig(level=logging.WARNING)
    if len(args.user_tokens) > 2 or min(args.user_tokens) < 1:
        raise SystemExit("--user-tokens takes LO HI or one length, at least 1")
    on_cuda = torch.cuda.is_available()
    if args.shape:
        model_dir = str(shape_dir(args.shape))
        args.tokenizer = args.tokenizer or resolve_model_path(EngineConfig())
    else:
        model_dir = args.model or resolve_model_path(EngineConfig())
    label = args.shape or Path(model_dir).name
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    model_config = ModelConfig.from_pretrained(model_dir)
    vocab = min(model_config.vocab_size, len(tokenizer))
    args.out.mkdir(parents=True, exist_ok=True)

    system, conversations = make_script(args, vocab)
    lengths = final_lengths(args, conversations)
    ws_blocks, ws_blocks_plain = working_set_blocks(args, lengths)
    bs = args.block_size
    max_len = -(-max(lengths) // bs) * bs
    args.max_model_len = args.max_model_len or max_len
    if args.max_model_len < max(lengths):
        raise SystemExit(f"--max-model-len {args.max_model_len} is shorter than the longest history ({max(lengths)})")
    min_pool = -(-args.max_model_len // bs) + 1  # the engine's floor (block 0 is the null block)
    pool = args.num_kvcache_blocks or max(min_pool, round(ws_blocks / args.working_set_ratio))
    kv_dtype = torch.bfloat16 if on_cuda else torch.float32  # the engine's "auto"
    block_bytes = PagedKVCache.bytes_per_block(model_config.num_hidden_layers, bs, model_config.num_key_value_heads,
                                               model_config.head_dim, kv_dtype)
    tier_gib = args.kv_offloading_size or math.ceil(ws_blocks * TIER_MARGIN * block_bytes / 2**30 * 100) / 100
    args.max_num_seqs = args.max_num_seqs or args.concurrency
    variants = parse_variants(args.variant, tier_gib)
    num_clients = args.client_processes or (4 if on_cuda else 1)
    # in flight at worst: C final histories, the system prompt once
    in_flight_blocks = args.system_tokens // bs + args.concurrency * (-(-max(lengths) // bs) - args.system_tokens // bs)

    print(f"{label}: {args.conversations} conversations x {args.turns} turns, system prompt {args.system_tokens}, "
          f"user messages {'-'.join(map(str, args.user_tokens))}, answers {args.max_tokens} tokens, concurrency "
          f"{args.concurrency}, {args.active_conversations or args.conversations} open, {num_clients} client "
          f"process(es)", flush=True)
    print(f"working set: {ws_blocks} blocks of {bs} tokens ({ws_blocks * block_bytes / 2**30:.2f} GiB at "
          f"{block_bytes} B a block; {ws_blocks_plain} counting the system prompt in every conversation); device "
          f"pool: {pool} blocks ({ws_blocks / pool:.2f}x smaller than the working set); host tier: {tier_gib:g} GiB "
          f"(~{int(tier_gib * 2**30 // block_bytes)} blocks); longest history {max(lengths)} tokens", flush=True)
    if pool < in_flight_blocks:
        print(f"note: {args.concurrency} turns in flight may need up to {in_flight_blocks} blocks, more than the "
              f"pool's {pool}: expect preemptions", flush=True)

    pinned = None
    if on_cuda:
        pinned = run_in_subprocess(pinned_copy_bandwidth)  # its pinned memory and GPU memory are freed
        print(f"pinned copy, 1 GiB: to device {pinned['to_device']['gb_s_best']:.1f} GB/s, to host "
              f"{pinned['to_host']['gb_s_best']:.1f} GB/s (best of 5)", flush=True)

    server_args = Namespace(shape=args.shape, tokenizer=args.tokenizer, max_model_len=args.max_model_len,
                            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            server_arg=["--num-kvcache-blocks", str(pool), "--kvcache-block-size", str(bs),
                                        "--enable-prompt-tokens-details", *args.server_arg])
    runs: dict[str, dict] = {}
    answers: dict[str, dict] = {}
    server_rc = 0
    for name, flags in variants:
        print(f"{name}: {flags or '(no extra flags)'}", flush=True)
        server = Server(server_args, model_dir, args.out / f"multi_turn_kv_{name}.log", shlex.split(flags))
        try:
            server.wait_healthy()
            model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
            warm_up_completion(server.url, model, vocab, min(args.system_tokens + 64, args.max_model_len - 4),
                               args.seed)
            before, cpu_before = scrape(server.url), server.cpu_seconds()
            run = run_conversations(server.url, model, args, system, conversations, num_clients)
            after, cpu_after = scrape(server.url), server.cpu_seconds()
            summary = summarize(run, before, after)
            summary["cpu_s"] = {"api_server": cpu_after[0] - cpu_before[0], "engine_core": cpu_after[1] - cpu_before[1],
                                "clients": run["client_cpu_s"]}
            summary["turns_not_sent"] = args.conversations * args.turns - len(run["records"])
            summary["flags"] = flags
            runs[name] = summary
            answers[name] = {(r["conversation"], r["turn"]): r["answer"] for r in run["records"]
                             if r["result"].success}
            print(f"  {summary['completed']} turns in {summary['duration_s']:.1f} s, {summary['tok_s']:.1f} tok/s, "
                  f"{summary['failed']} failed", flush=True)
        except Exception as exc:  # noqa: BLE001 - the other servers still run; the record says what failed
            runs[name] = {"flags": flags, "error": f"{type(exc).__name__}: {exc}"}
            print(f"  failed: {exc}", flush=True)
        finally:
            server_rc = server.stop() or server_rc

    baseline = next(iter(answers), None)
    for name, got in answers.items():
        same = sum(got.get(k) == v for k, v in answers[baseline].items())
        runs[name]["same_outputs_as_baseline"] = {"baseline": baseline, "same": same, "of": len(answers[baseline])}

    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": git_commit(), "model": label,
              "tokenizer": args.tokenizer, "machine": torch.cuda.get_device_name() if on_cuda else
              f"{platform.machine()} CPU, {os.cpu_count()} cores",
              "script": {"conversations": args.conversations, "turns": args.turns, "system_tokens": args.system_tokens,
                         "user_tokens": args.user_tokens, "max_tokens": args.max_tokens,
                         "concurrency": args.concurrency, "active_conversations": args.active_conversations,
                         "think_time_s": args.think_time, "seed": args.seed, "longest_history": max(lengths),
                         "total_turns": args.conversations * args.turns},
              "block_size": bs, "block_bytes": block_bytes, "working_set_blocks": ws_blocks,
              "working_set_blocks_plain_sum": ws_blocks_plain, "device_pool_blocks": pool, "tier_gib": tier_gib,
              "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens, "client_processes": num_clients,
              "pinned_copy": pinned, "runs": runs, "ratios": ratios(runs), "server_exit_code": server_rc}
    path = args.out / f"multi_turn_kv_{label}.json"
    path.write_text(json.dumps(record, indent=2))
    print(report(record))
    print(f"record: {path}")
    bad = any("error" in r or r["failed"] or r["turns_not_sent"] for r in runs.values())
    return 1 if bad or server_rc != 0 else 0


def ratios(runs: dict) -> dict:
    good = {n: r for n, r in runs.items() if "error" not in r}
    if len(good) < 2:
        return {}
    base_name, base = next(iter(good.items()))
    out = {}
    for name, run in list(good.items())[1:]:
        out[name] = {"baseline": base_name,
                     "ttft_p50_baseline_over_this": ratio(base["ttft_ms"]["p50"], run["ttft_ms"]["p50"]),
                     "ttft_p50_turns2plus_baseline_over_this": ratio(base["turns2plus"]["ttft_ms"]["p50"],
                                                                     run["turns2plus"]["ttft_ms"]["p50"]),
                     "tok_s_this_over_baseline": ratio(run["tok_s"], base["tok_s"])}
    return out


# ------------------------------------------------------------------------------ report


def _f(value, fmt: str = ".1f", scale: float = 1.0) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value * scale, fmt)


def _trio(s: dict) -> str:
    return f"{s['p50']:.0f} / {s['p90']:.0f} / {s['p99']:.0f}" if s.get("count") else "-"


def _same(name: str, same: dict | None) -> str:
    if not same:
        return "n/a"
    return "baseline" if same["baseline"] == name else f"{same['same']}/{same['of']}"


def report(record: dict) -> str:
    sc = record["script"]
    lines = [(f"\n{record['model']} on {record['machine']}, commit {record['commit']}: {sc['conversations']} "
             f"conversations x {sc['turns']} turns (system {sc['system_tokens']}, user "
             f"{'-'.join(map(str, sc['user_tokens']))}, answers {sc['max_tokens']}), concurrency {sc['concurrency']}; "
             f"device pool {record['device_pool_blocks']} blocks, working set {record['working_set_blocks']} "
             f"({record['working_set_blocks'] / record['device_pool_blocks']:.1f}x), host tier "
             f"{record['tier_gib']:g} GiB (computed; where a server has one)"),
             (f"{'server':<12} {'out tok/s':>9} {'req/s':>6}  {'TTFT all p50/p90/p99':>22}  "
              f"{'TTFT t>=2 p50/p90/p99':>22}  {'TPOT p50/p99':>13}")]
    runs = record["runs"]
    for name, r in runs.items():
        if "error" in r:
            lines.append(f"{name:<12} failed: {r['error']}")
            continue
        lines.append(f"{name:<12} {r['tok_s']:>9.1f} {r['req_s']:>6.2f}  {_trio(r['ttft_ms']):>22}  "
                     f"{_trio(r['turns2plus']['ttft_ms']):>22}  "
                     f"{r['tpot_ms']['p50']:>6.1f}/{r['tpot_ms']['p99']:<6.1f}")
    pinned = record.get("pinned_copy")
    lines.append(f"\n{'server':<12} {'prefix hit':>10} {'host hit':>9} {'cached t>=2':>11} {'preempt':>7} "
                 f"{'swap out/in':>11}  {'to host GiB, s, GB/s':>24}  {'to device GiB, s, GB/s':>24}  "
                 f"{'same outputs':>12} {'engine CPU s':>12}")
    for name, r in runs.items():
        if "error" in r:
            continue
        kv = r["kv"]
        copies = []
        for d in DIRECTIONS:
            c = kv["copies"][d]
            text = f"{_f(c['bytes'], '.3f', 2**-30)}, {_f(c['seconds'], '.2f')}, {_f(c['gb_s'], '.1f')}"
            if pinned and c["gb_s"] is not None:
                text += f" ({c['gb_s'] / pinned[d]['gb_s_best']:.0%})"
            copies.append(text)
        same = r.get("same_outputs_as_baseline")
        swap = f"{_f(kv['swap_out_blocks'], '.0f')}/{_f(kv['swap_in_blocks'], '.0f')}"
        lines.append(f"{name:<12} {_f(kv['prefix_cache_hit_rate'], '.1%'):>10} "
                     f"{_f(kv['external_prefix_cache_hit_rate'], '.1%'):>9} "
                     f"{_f(r['turns2plus']['cached_fraction'], '.1%'):>11} {_f(kv['num_preemptions'], '.0f'):>7} "
                     f"{swap:>11}  {copies[0]:>24}  {copies[1]:>24}  "
                     f"{_same(name, same):>12} {r['cpu_s']['engine_core']:>12.1f}")
    if pinned:
        lines.append(f"pinned copy of 1 GiB (best of 5): to device {pinned['to_device']['gb_s_best']:.1f} GB/s, "
                     f"to host {pinned['to_host']['gb_s_best']:.1f} GB/s; the tier's rates above in % of these")
    for name, q in record["ratios"].items():
        lines.append(f"{name} against {q['baseline']}: TTFT p50 {q['baseline']} / {name} "
                     f"{_f(q['ttft_p50_baseline_over_this'], '.2f')}x (turns >= 2: "
                     f"{_f(q['ttft_p50_turns2plus_baseline_over_this'], '.2f')}x), output tok/s {name} / "
                     f"{q['baseline']} {_f(q['tok_s_this_over_baseline'], '.2f')}x")
    for name, r in runs.items():
        if "error" not in r and (r["failed"] or r["turns_not_sent"]):
            lines.append(f"{name}: {r['failed']} turns failed, {r['turns_not_sent']} not sent, e.g. {r['errors']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
