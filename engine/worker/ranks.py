"""Tensor-parallel ranks other than 0: processes that run every step's forward pass on their shard.

Rank 0 (the engine) schedules, samples and returns tokens; every other rank only follows::

    rank 0: schedule -> build the step's inputs -> send(header, payload) -> input ids -> forward -> sample
    rank r:                      recv(header, payload) -> input ids -> forward (its heads, its vocab slice)

A step is one fixed-size header of integers (``StepShape`` and two counts) and one integer payload with
the host buffers' rows in use, both broadcast over a gloo group, then the device input ids (rank 0 fills
the tokens that a step in flight samples on the device, so they cross on the device). No Python object
is pickled per step. The forward passes meet in the model's own collectives (engine/distributed.py), CUDA
graphs included: each rank captured the same sizes and replays the one rank 0 names.

On one machine rank 0 starts the others (``spawn_local_workers``); on several, each other machine runs
``minivllm worker`` with the same model and parallel options (``python -m engine.worker.ranks``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

from engine import distributed, settings
from engine.config import EngineConfig
from engine.worker.prompt_logprobs import follow_prompt_logprobs
from engine.worker.step_channel import StepChannel

logger = logging.getLogger("minivllm")

def follow(runner) -> None:
    """Run rank 0's steps on this rank's shard until it stops."""
    channel = StepChannel()
    buf = runner.buffers
    with torch.inference_mode():
        while True:
            # The last step's copies read the host buffers recv rewrites.
            runner.input_preparer.wait_for_input_copies()
            step = channel.recv(buf, runner.lora)
            if step is None:
                return
            shape, prompt_lp_indices, copies = step
            runner.copy_blocks(copies)
            input_ids, positions, meta, logits_indices = runner.input_preparer.device_inputs(shape)
            distributed.broadcast_from_rank0(input_ids)
            if shape.graph_size:
                runner.graphs.replay(shape.graph_size)
                continue
            if shape.mixed_size:
                rows = runner.mixed_graphs.run(shape.mixed_size)
                if shape.num_sampled:
                    runner.model.compute_logits(rows[: shape.num_sampled])
                continue
            hidden = runner.model(input_ids, positions, meta)
            # In rank 0's order (ModelRunner._forward): the prompt logprobs' gathered logits, then the sampled rows'.
            if len(prompt_lp_indices):
                follow_prompt_logprobs(runner.model, hidden, torch.from_numpy(prompt_lp_indices).to(runner.device))
            if shape.num_logits:
                runner.model.compute_logits(hidden[logits_indices])


# ------------------------------------------------------------------------------------------ processes


def init_method(config: EngineConfig) -> str:
    return f"tcp://{config.master_addr}:{config.master_port}"


def spawn_local_workers(config: EngineConfig, first_rank: int, count: int) -> list[subprocess.Popen]:
    """Start ``count`` ranks from ``first_rank`` as processes of this machine (``python -m engine.worker.ranks``)."""
    payload = json.dumps(dataclasses.asdict(config))
    procs = []
    for rank in range(first_rank, first_rank + count):
        env = settings.worker_env(payload)
        procs.append(subprocess.Popen([sys.executable, "-m", "engine.worker.ranks", "--rank", str(rank)], env=env))
    logger.info("tensor parallel: started ranks %d-%d (pids %s)", first_rank, first_rank + count - 1,
                ", ".join(str(p.pid) for p in procs))
    return procs


def stop_workers(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> list[int]:
    """Wait for the processes to end, killing those still running after ``timeout_s``; their exit statuses."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("tensor parallel: rank process %d did not stop in %.0f s: killed", proc.pid, timeout_s)
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]


class LocalRanks:
    """Rank 0's hold on the ranks it started on this machine: their processes and, once the model runner
    exists, the channel that stops them. It holds nothing of the engine, so that the engine's finalizer and
    the thread that watches the ranks do not keep the engine (its model, its KV cache) alive."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.channel: StepChannel | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(message)`` from a daemon thread when a rank exits before ``stop``."""
        threading.Thread(target=self._watch, args=(on_death,), name="minivllm-rank-watch", daemon=True).start()

    def _watch(self, on_death: Callable[[str], None]) -> None:
        while not self._stopped.wait(0.2):
            for proc in self.procs:
                code = proc.poll()
                if code is not None and not self._stopped.is_set():
                    on_death(f"tensor-parallel rank process {proc.pid} exited with status {code}")
                    return

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the ranks and leave the process group: the stop message when the channel is up (else, or when
        it is not taken, SIGTERM), their processes joined (killed after ``timeout_s``). Runs once; later
        calls return at once."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            told = self.channel is not None and self.channel.stop(timeout_s)
            self.channel = None
            if not told:
                for proc in self.procs:
                    if proc.poll() is None:
                        proc.terminate()
            codes = stop_workers(self.procs, timeout_s)
            distributed.destroy_tensor_parallel()
            logger.info("tensor parallel: ranks stopped (exit statuses %s), process group destroyed", codes)


def run_node(config: EngineConfig) -> int:
    """Run this node's ranks (``minivllm worker``) until they end; a signal ends them. Returns the exit status."""
    import signal

    first = config.node_rank * config.ranks_per_node
    if config.master_port == 0:
        raise ValueError("a worker node needs --master-port: the port node 0's server listens on for the ranks")
    procs = spawn_local_workers(config, first, config.ranks_per_node)

    def end(signum, frame) -> None:
        for proc in procs:
            proc.terminate()

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)
    codes = [proc.wait() for proc in procs]
    logger.info("ranks %d-%d ended: exit codes %s", first, first + len(procs) - 1, codes)
    return 0 if all(c == 0 for c in codes) else 1


def _exit_with_parent() -> None:
    """A rank started by rank 0's process ends when that process does, however it ended."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="minivllm-parent-watch", daemon=True).start()


def run_worker(config: EngineConfig, rank: int) -> None:
    """One follower rank: join the group, load this rank's shard, size the KV pool with rank 0, follow."""
    from engine.loading.default_model import resolve_model_path
    from engine.loading.model_config import ModelConfig, resolve_max_model_len
    from engine.worker.model_runner import ModelRunner

    distributed.init_tensor_parallel(rank, config.tensor_parallel_size, init_method(config),
                                     timeout_s=config.distributed_timeout_s)
    try:
        model_config = ModelConfig.from_pretrained(resolve_model_path(config), config.trust_remote_code)
        runner = ModelRunner(config, model_config, resolve_max_model_len(config, model_config))
        runner.init_kv_cache(runner.determine_num_blocks())
        runner.warm_up_kernels()
        runner.capture_cuda_graphs()
        logger.info("rank %d ready", rank)
        follow(runner)
    finally:
        distributed.destroy_tensor_parallel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank of a minivllm engine")
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s [rank {args.rank}]: "
                        "%(message)s")
    config = EngineConfig(**settings.worker_config())
    _exit_with_parent()
    run_worker(config, args.rank)


if __name__ == "__main__":
    main()
