"""Tensor parallelism's process group: which rank this process is, and the collectives the sharded layers use.

One process per rank. With one rank (the default) nothing is initialised and every collective is the
identity, so the single-device path runs exactly the code it always did. With several, each rank holds
a slice of every sharded layer (``engine.models.parallel``) and the layers meet in two collectives:

    row-parallel linear, vocab-parallel embedding:  partial sums  --all_reduce-->  full activations
    vocab-parallel LM head:                         logit slices  --all_gather-->  full logits

NCCL on CUDA, gloo on the CPU; every collective has the group's timeout, so a rank that died makes the
others fail instead of hanging.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger("minivllm")

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    group: object | None = None  # the model's collectives (NCCL on CUDA); None with one rank
    control: object | None = None  # gloo, for rank 0's step messages: waits as long as the engine idles


_state = ParallelState()


def tp_rank() -> int:
    return _state.rank


def tp_size() -> int:
    return _state.world_size


def init_tensor_parallel(rank: int, world_size: int, init_method: str, backend: str | None = None,
                         timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the tensor-parallel group as ``rank`` of ``world_size`` (``init_method``: a ``tcp://host:port``
    or ``env://`` rendezvous, as torch.distributed takes it)."""
    global _state
    if world_size == 1:
        _state = ParallelState()
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    # A rank that died breaks its connections, and the others' collectives fail at once; the control group
    # only waits for the next step, however long the engine is idle.
    try:
        control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    except BaseException:
        dist.destroy_process_group()  # else the next init in this process finds the default group taken
        raise
    _state = ParallelState(rank, world_size, dist.group.WORLD, control)
    logger.info("tensor parallel: rank %d of %d (%s)", rank, world_size, backend)


def destroy_tensor_parallel() -> None:
    """Leave the group and destroy every process group of this process, so that it can join another."""
    global _state
    if _state.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _state = ParallelState()


@contextlib.contextmanager
def single_rank():
    """Build or run a model unsharded on this rank alone, whatever the group: inside, this process is rank 0 of 1
    (every layer whole, every collective the identity). Rank 0's draft model beside a sharded target runs so."""
    global _state
    saved, _state = _state, ParallelState()
    try:
        yield
    finally:
        _state = saved


def control_group():
    return _state.control


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place (a device tensor, over the model's group)."""
    if _state.world_size > 1:
        dist.broadcast(x, src=0, group=_state.group)
    return x


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's ``value`` (the KV pool is sized by the rank with the least memory)."""
    if _state.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_state.control)
    return int(t.item())


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place; the identity with one rank."""
    if _state.world_size > 1:
        dist.all_reduce(x, group=_state.group)
    return x


def max_over_ranks_(x: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of every rank's ``x``, in place; ``x`` with one rank."""
    if _state.world_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=_state.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in rank order; ``x`` with one rank."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.cat(parts, dim=-1)


def shard_range(size: int, rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(start, length) of ``rank``'s equal share of ``size`` items; ``size`` must divide evenly."""
    rank = tp_rank() if rank is None else rank
    world_size = tp_size() if world_size is None else world_size
    if size % world_size:
        raise ValueError(f"{size} does not split evenly over {world_size} tensor-parallel ranks")
    length = size // world_size
    return rank * length, length


def kv_head_range(num_kv_heads: int, rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(first KV head, count) this rank holds: an equal share when there are at least as many KV heads as
    ranks; else one head, replicated on ``world_size / num_kv_heads`` consecutive ranks (as vLLM does)."""
    rank = tp_rank() if rank is None else rank
    world_size = tp_size() if world_size is None else world_size
    if num_kv_heads >= world_size:
        return shard_range(num_kv_heads, rank, world_size)
    if world_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {world_size} ranks")
    return rank * num_kv_heads // world_size, 1
