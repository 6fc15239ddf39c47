"""The engine's configuration: one tree, validated once, passed down."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported by the methods that return its types: the API server reads this module before it starts
# the engine core and should not wait for torch to do so.
_DTYPES = ("float32", "bfloat16", "float16")
_BACKENDS = ("auto", "torch", "triton")
_LOAD_FORMATS = ("auto", "safetensors", "dummy")
# KV cache element types: "auto" stores K/V in the model's dtype; "fp8" (= "fp8_e4m3") stores float8_e4m3 with a
# float32 scale per token and KV head (kvcache/paged_cache.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Weight quantization: None keeps the checkpoint's weights in the compute dtype; "fp8" quantizes the linear
# layers to float8_e4m3 at load time (engine/models/fp8.py). FP8 checkpoints are read as they are stored.
QUANTIZATIONS = (None, "fp8")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


@dataclass
class EngineConfig:
    """Every knob of the engine. ``model=None`` serves the embedded default model."""

    model: str | None = None
    tokenizer: str | None = None  # defaults to the model directory
    # Run a model directory's own Python code for its config, tokenizer or processor (transformers' auto_map).
    trust_remote_code: bool = False
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available, else cpu
    load_format: str = "auto"
    quantization: str | None = None  # one of QUANTIZATIONS
    # Request defaults from generation_config.json: "auto" (the model's), "vllm" (none), or a folder.
    generation_config: str = "auto"
    seed: int = 0
    max_logprobs: int = 20  # the most logprobs one token may ask for (vLLM's default); -1: the whole vocabulary
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # KV cache (the seed's names).
    kvcache_block_size: int = 16
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    num_kvcache_blocks: int = -1  # -1: size the pool from the memory budget
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_space_gib: float = 2.0
    enable_prefix_caching: bool = True
    # Scheduler.
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    # Structured outputs: the largest spec a request may give (its schema, regex, EBNF or choices, in UTF-8
    # bytes; the API server refuses larger ones before anything starts), how long one grammar may compile
    # before its request fails, and what xgrammar's cache of compiled grammars may hold (vLLM's
    # VLLM_XGRAMMAR_CACHE_MB; 0: no cache).
    structured_outputs_max_bytes: int = 256 * 1024
    structured_outputs_compile_timeout_s: float = 60.0
    xgrammar_cache_mb: int = 512
    # Execution.
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere
    enforce_eager: bool = False
    # Queue the next step on the device before returning this step's outputs (None: on CUDA only).
    overlap_steps: bool | None = None
    # Also plan the next step before this step's tokens are known, so the device never waits for the
    # host between decode steps (None: on with CUDA). Penalties and min_tokens turn it off for the
    # steps they run in.
    async_scheduling: bool | None = None
    cuda_graph_batch_sizes: list[int] = field(default_factory=list)  # empty: 1, 2, 4, 8, 16, 24, ... max_num_seqs
    # Steps that mix decodes with prefill chunks (and decode batches past the largest decode graph) replay a CUDA
    # graph up to this many tokens (``graph_token_sizes``); larger steps run eagerly. 0: all of them do.
    cuda_graph_max_tokens: int = 2048
    # Tensor parallelism (engine/distributed.py, engine/worker/ranks.py): one process per rank, this one rank 0.
    tensor_parallel_size: int = 1
    # Several machines: each runs tensor_parallel_size / nnodes ranks; node 0 runs the engine (rank 0), the
    # others `minivllm worker` (torch.distributed's rendezvous at master_addr:master_port).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port (one machine only)
    distributed_timeout_s: float = 60.0  # a collective that waits longer fails (a rank died or hangs)
    # Check the KV manager's invariants when idle: after LLM.generate, and in the server once no request
    # has run for a second (the check takes ~1 us per block, so never while requests wait).
    check_invariants_when_idle: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        need(self.dtype == "auto" or self.dtype in _DTYPES, f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        need(self.device in ("auto", "cpu") or self.device.startswith("cuda"),
             f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        need(self.load_format in _LOAD_FORMATS, f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        need(self.quantization in QUANTIZATIONS,
             f"quantization must be None or one of {QUANTIZATIONS[1:]}, got {self.quantization!r}")
        need(self.attention_backend in _BACKENDS,
             f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        need(self.kvcache_block_size > 0 and self.kvcache_block_size % 8 == 0,
             f"kvcache_block_size must be a positive multiple of 8, got {self.kvcache_block_size}")
        need(self.num_kvcache_blocks == -1 or self.num_kvcache_blocks >= 2,
             f"num_kvcache_blocks must be -1 (size from memory) or at least 2, got {self.num_kvcache_blocks}")
        need(0.0 < self.gpu_memory_utilization <= 1.0,
             f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        need(self.cpu_kvcache_space_gib > 0, f"cpu_kvcache_space_gib must be positive, got {self.cpu_kvcache_space_gib}")
        need(self.max_logprobs >= -1, f"max_logprobs must be -1 (the whole vocabulary) or non-negative, got "
                                      f"{self.max_logprobs}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= 1, f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        need(self.structured_outputs_max_bytes >= 1,
             f"structured_outputs_max_bytes must be at least 1, got {self.structured_outputs_max_bytes}")
        need(self.structured_outputs_compile_timeout_s > 0, f"structured_outputs_compile_timeout_s must be positive, "
                                                            f"got {self.structured_outputs_compile_timeout_s}")
        need(self.xgrammar_cache_mb >= 0, f"xgrammar_cache_mb must be at least 0, got {self.xgrammar_cache_mb}")
        need(self.max_model_len is None or self.max_model_len >= 1, f"max_model_len must be at least 1, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            need(self.max_num_batched_tokens >= self.max_model_len,
                 f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                 f"max_model_len ({self.max_model_len}) so that every prompt fits in one step")
        need(all(b >= 1 for b in self.cuda_graph_batch_sizes), "cuda_graph_batch_sizes must be positive")
        need(self.cuda_graph_max_tokens >= 0, f"cuda_graph_max_tokens must be non-negative, got "
                                              f"{self.cuda_graph_max_tokens}")
        need(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        need(self.nnodes >= 1 and self.tensor_parallel_size % self.nnodes == 0,
             f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of nnodes ({self.nnodes})")
        need(0 <= self.node_rank < self.nnodes, f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        need(self.nnodes == 1 or self.master_port > 0, "several nodes need a master_port to meet at")
        need(self.distributed_timeout_s > 0, "distributed_timeout_s must be positive")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def rank_device(self, rank: int) -> torch.device:
        """The device of a tensor-parallel rank: its local index's GPU, or the CPU."""
        import torch

        device = self.resolve_device()
        if device.type != "cuda" or self.tensor_parallel_size == 1:
            return device
        local = rank % self.ranks_per_node
        if local >= torch.cuda.device_count():
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} needs {self.ranks_per_node} GPUs per "
                              f"node; this node has {torch.cuda.device_count()}")
        return torch.device("cuda", local)

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} was asked for, but CUDA is not available")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def resolve_kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The element type of the KV cache for a model computing in ``dtype``."""
        import torch

        return dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def resolve_attention_backend(self, device: torch.device) -> str:
        if self.attention_backend == "auto":
            return "triton" if device.type == "cuda" else "torch"
        return self.attention_backend

    def graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes that get a CUDA graph; a batch is padded up to the next one."""
        if self.cuda_graph_batch_sizes:
            return sorted(set(min(b, self.max_num_seqs) for b in self.cuda_graph_batch_sizes))
        sizes = [1, 2, 4, 8] + list(range(16, self.max_num_seqs + 1, 16))
        return sorted(set(s for s in sizes if s <= self.max_num_seqs) | {self.max_num_seqs})

    def graph_token_sizes(self) -> list[int]:
        """Token counts of the mixed-step CUDA graphs (``engine.worker.cuda_graphs.MixedGraphs``), up to
        ``cuda_graph_max_tokens`` and the step's token budget: every 16 tokens up to 128, every 32 up to 256, then
        every 64. A step is padded up to the next one. Padding costs device time where a step is bound by its
        products (a few hundred tokens on an 8B model), so past 256 tokens a step gains at most 63 tokens, 6% at
        1,024."""
        limit = min(self.cuda_graph_max_tokens, self.max_num_batched_tokens)
        sizes, size = [], 16
        while size <= limit:
            sizes.append(size)
            size += 16 if size < 128 else 32 if size < 256 else 64
        if limit > 0 and (not sizes or sizes[-1] < limit):
            sizes.append(limit)
        return sizes
