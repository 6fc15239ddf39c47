"""``--compile``: the CPU decode step through ``torch.compile`` (inductor), one graph for the whole model.

On the CPU a decode step of a small model spends much of its time in a few hundred small ops (norms, rope, casts,
SwiGLU, the attention's gathers and masks) and in their Python; inductor fuses them into C++ loops between the
linear products and SDPA, which it calls as they are. Decode-only steps (one new token per request, up to
``MAX_COMPILED_BATCH`` requests) go through the compiled forward; every other step runs the model eagerly.

The graph writes no KV cache. Every layer's K and V caches are views of one tensor, and a graph that mutated some
would copy the whole tensor around each write (AOTAutograd's handling of mutated inputs that alias others). So the
torch attention backend hands each layer's new K and V out instead (``DEFERRED_KV_WRITES``), attending with them
in place of the cache rows they will fill, and ``CompiledCpuDecode.forward`` writes them after the forward pass: the
rows the eager step writes, and the same attention inputs.

Two graphs are compiled at start-up, on dummy steps that read only the null block (block 0) and write nothing: one
request, and 2 to ``MAX_COMPILED_BATCH`` (torch specializes a dimension of size 1). For the default model on 2 cores
that takes ~1.5 minutes the first time, hence opt-in; inductor keeps what it compiled on disk
(``TORCHINDUCTOR_CACHE_DIR``), and later start-ups take ~15 s. After the warm-up a step that the graphs' guards do not
admit runs eagerly instead of compiling again (``torch.compiler.set_stance("eager_on_recompile")``).

Needs torch >= 2.6 (``set_stance``) and a C++ compiler; without them, or for a configuration it does not cover
(another device or attention backend, an FP8 KV cache, LoRA, tensor parallelism, experts routed on the host), it logs
why and the engine runs eagerly.
"""

from __future__ import annotations

import logging
import os
import shutil
import time

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import DEFERRED_KV_WRITES, write_kv
from engine.config import EngineConfig
from engine.distributed import tp_size

logger = logging.getLogger("minivllm")

# The largest decode batch the compiled graph takes: past ~80 tokens the int4 products take another path
# (``INT4_CPU_OP_MAX_TOKENS``), which would need a third graph.
MAX_COMPILED_BATCH = 64


def compile_cpu_decode(model: nn.Module, config: EngineConfig, backend, dtype: torch.dtype) -> None:
    """With ``config.compile``, compile the model's CPU decode step and route its decode-only steps through it (the
    model's ``forward`` is replaced on the instance); call once its KV caches are bound. Logs why where it does
    not apply."""
    if not config.compile:
        return
    reason = _unsupported(model, config, backend)
    if reason:
        logger.warning("--compile: the decode step runs eagerly (%s)", reason)
        return
    CompiledCpuDecode(model, backend, dtype).warm_up(config.kvcache_block_size, config.max_num_seqs)


def compiled_decode(model: nn.Module) -> CompiledCpuDecode | None:
    """The compiled decode step ``compile_cpu_decode`` installed on ``model``, if any."""
    owner = getattr(model.forward, "__self__", None)
    return owner if isinstance(owner, CompiledCpuDecode) else None


def _unsupported(model: nn.Module, config: EngineConfig, backend) -> str | None:
    """Why the compiled step does not apply here, or None."""
    layers = model.attention_layers()
    if not hasattr(torch.compiler, "set_stance"):
        return f"torch {torch.__version__} has no torch.compiler.set_stance: torch >= 2.6 is needed"
    if next(model.parameters()).device.type != "cpu":
        return "it compiles the CPU step; CUDA replays CUDA graphs"
    if backend.name != "torch":
        return f"it compiles the torch attention backend, not {backend.name}"
    if any(layer.kv_scales is not None for layer in layers):
        return "an FP8 KV cache"
    if config.enable_lora or tp_size() > 1:
        return "LoRA adapters" if config.enable_lora else "tensor parallelism"
    if not getattr(model, "supports_cuda_graphs", True):
        return "its experts route tokens on the host (the torch reference)"
    if not any(shutil.which(cxx) for cxx in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        return "no C++ compiler (g++) for inductor's CPU kernels"
    return None


class CompiledCpuDecode:
    """Replaces ``model.forward``: decode-only steps through the compiled graph, the others through the original."""

    def __init__(self, model: nn.Module, backend, dtype: torch.dtype):
        self.eager_forward = model.forward
        self.layers = model.attention_layers()
        self.backend = backend
        self.dtype = dtype
        options = {}
        if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
            # The modules' weights and structure never change once loaded: checking them on every call costs more
            # than the small ops the graph saves.
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        # Sizes are static but for those a decode step varies (marked in ``warm_up``): dynamic parameter shapes
        # and floats would cost a size or tensor per parameter and norm on every call.
        self.compiling = torch.compile(self.eager_forward, options=options)
        self.compiled = torch.compiler.set_stance("eager_on_recompile")(self.compiling)
        self.num_steps = 0  # steps handed to the graphs (one their guards refuse runs eagerly)
        model.forward = self.forward

    def takes(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              inputs_embeds: torch.Tensor | None, aux_layers: tuple[int, ...]) -> bool:
        """Whether a step goes through the graph: decodes only, no padding, no images or auxiliary states."""
        d = meta.num_decodes
        return (inputs_embeds is None and not aux_layers and meta.decode_seq_lens is None and positions.dim() == 1
                and 1 <= d <= MAX_COMPILED_BATCH and d == meta.num_reqs == input_ids.shape[0]
                == meta.slot_mapping.shape[0])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None, aux_layers: tuple[int, ...] = ()):
        if not self.takes(input_ids, positions, meta, inputs_embeds, aux_layers):
            return self.eager_forward(input_ids, positions, meta, inputs_embeds, aux_layers)
        self.num_steps += 1
        return self._run(self.compiled, input_ids, positions, meta)

    def _run(self, fn, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             write: bool = True, mark_dynamic: bool = False) -> torch.Tensor:
        """The model's forward through ``fn`` with the step's K/V writes deferred to the end (``write``: made; else
        dropped). ``mark_dynamic``: compile with the sizes that vary from step to step dynamic (the requests, where
        more than one, and the context's blocks)."""
        # The host-side values the graph reads (data-dependent sizes): one plan per sliding window.
        plans = {id(plan): plan for plan in (self.backend.plan_decode_step(layer.bound_cache, meta, self.dtype)
                                             for layer in self.layers)}
        if mark_dynamic:
            import torch._dynamo  # here: importing it costs every engine ~1.5 s of start-up

            batched = meta.num_decodes > 1  # a size of 1 is its own graph
            for plan in plans.values():
                for tensor, context_dim in zip(plan, (1, 3, 2)):
                    torch._dynamo.mark_dynamic(tensor, [0, context_dim] if batched else context_dim)
            if batched:
                for tensor in (input_ids, positions, meta.slot_mapping, meta.seq_lens):
                    torch._dynamo.mark_dynamic(tensor, 0)
        writes = meta.derive(DEFERRED_KV_WRITES, list)
        hidden = fn(input_ids, positions, meta)
        if len(writes) != len(self.layers):
            raise RuntimeError(f"compiled decode step: {len(writes)} layers handed out their K/V, not "
                               f"{len(self.layers)}")
        if write:
            for layer, (k, v) in zip(self.layers, writes):
                write_kv(layer.k_cache, layer.v_cache, k, v, meta.slot_mapping)
        return hidden

    def warm_up(self, block_size: int, max_num_seqs: int) -> None:
        """Compile the graphs before the first request: one decode request, and several."""
        start = time.perf_counter()
        sizes = (1, 2) if max_num_seqs > 1 else (1,)
        logger.info("--compile: compiling the CPU decode step for %s request(s) at a time (minutes the first time; "
                    "inductor caches it on disk)", " and ".join(map(str, sizes)))
        import torch.fx.experimental._config  # here, as torch._dynamo in ``_run``

        for d in sizes:
            # Made outside inference mode, like a step's inputs (the guards check it); run inside, like a step.
            step = _dummy_decode_step(d, block_size, self.layers[0].k_cache.device)
            # No duck sizing: sizes that happen to be equal in the dummy step (its context's two blocks, the cache's
            # K/V axis) must not be assumed equal in every step.
            with torch.inference_mode(), torch.fx.experimental._config.patch(use_duck_shape=False):
                self._run(self.compiling, *step, write=False, mark_dynamic=True)
        logger.info("--compile: CPU decode step compiled in %.1f s", time.perf_counter() - start)


def _dummy_decode_step(d: int, block_size: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, meta) of a decode step of ``d`` requests whose contexts (two blocks each, so that no
    size is 1) are all the null block; its K/V are not written (``_run``'s ``write``)."""
    seq_len, width = block_size + 1, 4
    seq_lens = torch.full((d,), seq_len, dtype=torch.int32)
    query_start = torch.arange(d + 1, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(d, dtype=torch.int64, device=device), query_start_loc=query_start.to(device),
        seq_lens=seq_lens.to(device), block_tables=torch.zeros((d, width), dtype=torch.int32, device=device),
        num_reqs=d, num_decodes=d, num_decode_tokens=d, max_query_len=1, max_seq_len=seq_len, block_size=block_size,
        query_start_loc_cpu=query_start, seq_lens_cpu=seq_lens)
    positions = torch.full((d,), seq_len - 1, dtype=torch.int64, device=device)
    return torch.zeros(d, dtype=torch.int64, device=device), positions, meta
