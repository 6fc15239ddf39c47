"""The engine's configuration: one tree, validated once, passed down.

Every field a user may set is declared with ``option``: its help text, the heading it is listed under and, where
the field's name in kebab case is not the flag's, the flag. ``minivllm serve`` and ``minivllm worker`` build their
engine flags from these fields (``server/cli/engine_options.py``), so an engine option is declared here once:

    max_num_seqs: int = option(256, "most requests in one running batch", group=SCHEDULING)
        -> --max-num-seqs MAX_NUM_SEQS  (type int, default 256, under "scheduling and execution")

A ``bool`` option off by default is a switch (``--enforce-eager``); one on by default or None (decided at start-up)
also takes ``--no-...``. Fields declared without ``option`` are for the Python API only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
# Weight quantization: None (the default) serves the weights as the checkpoint stores them: a GGUF model's Q4_0,
# Q4_1 and Q8_0 linear weights in their blocks ("gguf", engine/loading/gguf_weights.py), an FP8 checkpoint in FP8,
# anything else in the compute dtype (``resolve_quantization``). "none" dequantizes a GGUF model to the compute
# dtype; "fp8" quantizes the linear layers to float8_e4m3 at load time (engine/models/fp8.py); "gguf" asks for a GGUF
# model's blocks explicitly (an error for any other model).
QUANTIZATIONS = (None, "none", "fp8", "gguf")

KV_OFFLOADING_BACKENDS = ("native",)
PREEMPTION_MODES = ("recompute", "swap", "auto")

# The headings the options are listed under in ``minivllm serve --help``, in this order.
MODEL = "model"
KV_CACHE = "KV cache"
SCHEDULING = "scheduling and execution"
PARALLEL = "tensor parallelism"
LORA = "LoRA adapters"
OPTION_GROUPS = (MODEL, KV_CACHE, SCHEDULING, PARALLEL, LORA)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


def option(default: Any, help: str, *, group: str, flag: str | None = None, aliases: Sequence[str] = (),
           choices: Sequence[str] | None = None) -> Any:
    """A field that is also a command-line option: ``help`` documents it, ``group`` (one of ``OPTION_GROUPS``) is
    where ``--help`` lists it, ``flag`` names it where ``--`` and the field's name in kebab case do not (a field's
    unit suffix that vLLM's flag leaves out), ``aliases`` are its other names and ``choices`` the values it takes."""
    if group not in OPTION_GROUPS:
        raise ValueError(f"option group must be one of {OPTION_GROUPS}, got {group!r}")
    return field(default=default, metadata={"help": help, "group": group, "flag": flag, "aliases": tuple(aliases),
                                            "choices": tuple(choices) if choices is not None else None})


@dataclass
class EngineConfig:
    """Every knob of the engine. ``model=None`` serves the embedded default model."""

    # Model.
    model: str | None = option(
        None, "Hugging Face model directory; default: the embedded SmolLM2-135M-Instruct (converted into "
        "~/.cache/minivllm on first use)", group=MODEL)
    tokenizer: str | None = option(None, "tokenizer directory; default: the model directory", group=MODEL)
    trust_remote_code: bool = option(
        False, "run the Python code a model directory ships for its config, tokenizer or processor (transformers' "
        "auto_map); the model itself always runs on this engine's own code", group=MODEL)
    served_model_name: str | None = option(
        None, "the model name clients send; default: the model directory's name (SmolLM2-135M-Instruct for the "
        "default model)", group=MODEL)
    dtype: str = option("auto", "weights and activations; auto: bfloat16 on CUDA, float32 on CPU", group=MODEL,
                        choices=("auto", *_DTYPES))
    device: str = option("auto", "auto, cpu, cuda or cuda:N", group=MODEL)  # auto: cuda if available, else cpu
    load_format: str = option("auto", "dummy: random weights (for benchmarks and tests)", group=MODEL,
                              choices=_LOAD_FORMATS)
    quantization: str | None = option(
        None, "default: what the checkpoint says: a GGUF model (the default model is one) keeps its Q4_0, Q4_1 and "
        "Q8_0 linear weights quantized (int4 and int8 with a scale per 32 values; the rest dequantized), an FP8 "
        "checkpoint stays in FP8, other checkpoints are unquantized. none: dequantize a GGUF model's weights to "
        "--dtype. gguf: the GGUF blocks, asked for explicitly (a GGUF model only). fp8: quantize the linear layers' "
        "weights to float8_e4m3 at load time (a scale per output channel, activations per token at run time). "
        "--dtype is the compute dtype either way (activations and unquantized weights)", group=MODEL,
        aliases=("-q",), choices=QUANTIZATIONS[1:])
    generation_config: str = option(
        "auto", "request defaults for temperature, top_p, top_k, min_p, repetition_penalty and max_tokens: 'auto' "
        "reads the model's generation_config.json, 'vllm' ignores it, or a folder holding one", group=MODEL)
    seed: int = option(0, "random seed of the engine", group=MODEL)
    max_model_len: int | None = option(
        None, "context length (prompt + output) in tokens; default: the model's maximum", group=MODEL)
    # KV cache (the seed's names).
    kvcache_block_size: int = option(16, "tokens per KV cache block (a multiple of 8)", group=KV_CACHE)
    kv_cache_dtype: str = option(
        "auto", "auto: K/V in the model's dtype; fp8 (= fp8_e4m3): float8_e4m3 with a float32 scale per token and KV "
        "head, about twice the tokens in the same memory", group=KV_CACHE, choices=KV_CACHE_DTYPES)
    num_kvcache_blocks: int = option(
        -1, "KV cache blocks in the pool; -1: size the pool from the memory budget", group=KV_CACHE,
        aliases=("--num-gpu-blocks-override",))
    gpu_memory_utilization: float = option(
        0.9, "fraction of GPU memory the engine may use (weights, activations and KV cache)", group=KV_CACHE)
    cpu_kvcache_space_gib: float = option(2.0, "KV cache size in GiB when running on the CPU", group=KV_CACHE)
    enable_prefix_caching: bool = option(
        True, "share the KV cache blocks of common prompt prefixes between requests", group=KV_CACHE)
    kv_offloading_size_gib: float = option(
        0.0, "GiB of host memory (pinned on CUDA) for a second KV tier, shared by the tensor-parallel ranks: cached "
        "blocks evicted from the device pool are copied there and come back by a copy on a prefix hit; 0: off",
        group=KV_CACHE, flag="--kv-offloading-size")
    kv_offloading_backend: str = option(
        "native", "how the host tier is kept (vLLM's flag): native, this engine's own", group=KV_CACHE,
        choices=KV_OFFLOADING_BACKENDS)
    preemption_mode: str | None = option(
        None, "what a request preempted for KV blocks loses: recompute (its KV, prefilled again later), swap (its KV "
        "kept in the host tier and copied back) or auto (swap when its KV holds more tokens than "
        "max-num-batched-tokens); default: auto with a host tier, else recompute", group=KV_CACHE,
        choices=PREEMPTION_MODES)
    # Scheduler.
    max_num_seqs: int = option(256, "most requests in one running batch", group=SCHEDULING)
    max_num_batched_tokens: int = option(8192, "token budget of one engine step", group=SCHEDULING)
    enable_chunked_prefill: bool = option(
        True, "split long prompts across steps so they share steps with decodes", group=SCHEDULING)
    max_logprobs: int = option(  # 20: vLLM's default
        20, "the most logprobs a request may ask for per token (logprobs, top_logprobs, prompt_logprobs); -1: the "
        "whole vocabulary, which -1 in a request asks for", group=SCHEDULING)
    # Execution.
    attention_backend: str = option("auto", "auto: triton on CUDA, torch elsewhere", group=SCHEDULING,
                                    choices=_BACKENDS)
    enforce_eager: bool = option(False, "never capture CUDA graphs", group=SCHEDULING)
    compile: bool = option(
        False, "CPU: compile the decode step with torch.compile (inductor; needs torch >= 2.6 and a C++ compiler): "
        "fewer, fused small ops per decode step, for a minute or two of compiling at start-up the first time (~15 s "
        "once inductor's disk cache holds it)", group=SCHEDULING)
    runner: str = option(
        "generate", "what the model serves: generate (completions, chat) or pooling (embeddings: the last prompt "
        "token's hidden state; steps run without CUDA graphs)", group=SCHEDULING, choices=("generate", "pooling"))
    # Steps that mix decodes with prefill chunks (and decode batches past the largest decode graph) replay a CUDA
    # graph up to this many tokens (``graph_token_sizes``).
    cuda_graph_max_tokens: int = option(
        2048, "steps that mix decodes with prefill chunks replay a CUDA graph up to this many tokens (padded to the "
        "next captured size); larger steps run eagerly; 0: all of them do", group=SCHEDULING)
    overlap_steps: bool | None = option(
        None, "queue the next step on the device before handing out this step's tokens; default: on with CUDA, off "
        "on the CPU", group=SCHEDULING)
    # Penalties and min_tokens turn async scheduling off for the steps they run in.
    async_scheduling: bool | None = option(
        None, "also plan each step before the previous step's tokens are known, so the device does not wait for "
        "the host between decode steps (with speculative decoding: while no step verifies or takes proposals); "
        "default: on with CUDA", group=SCHEDULING)
    # Structured outputs. The API server refuses a spec over structured_outputs_max_bytes before anything starts.
    structured_outputs_max_bytes: int = option(
        256 * 1024, "largest structured-output spec a request may give (its JSON schema, regex, EBNF grammar, "
        "structural tag or choices, in UTF-8 bytes; 400 beyond)", group=SCHEDULING)
    structured_outputs_compile_timeout_s: float = option(
        60.0, "seconds a grammar may take to compile; past it its request fails with a 400 (or its stream's error "
        "event) and the server goes on", group=SCHEDULING, flag="--structured-outputs-compile-timeout")
    xgrammar_cache_mb: int = option(
        512, "memory xgrammar's cache of compiled grammars may hold, least recently used out first (vLLM's "
        "VLLM_XGRAMMAR_CACHE_MB); 0: no cache", group=SCHEDULING)
    speculative_config: dict[str, Any] | None = option(
        None, "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
        "\"prompt_lookup_min\": m, \"prompt_lookup_max\": M, \"disable_by_batch_size\": B} proposes k tokens a step "
        "from the last time the sequence's tail appeared; the target verifies them in one pass", group=SCHEDULING)
    cuda_graph_batch_sizes: list[int] = field(default_factory=list)  # empty: 1, 2, 4, 8, 16, 24, ... max_num_seqs
    # Check the KV manager's invariants when idle: after LLM.generate, and in the server once no request
    # has run for a second (the check takes ~1 us per block, so never while requests wait).
    check_invariants_when_idle: bool = True
    # Tensor parallelism (engine/distributed.py, engine/worker/ranks.py): one process per rank, this one rank 0.
    # Several machines: each runs tensor_parallel_size / nnodes ranks; node 0 runs the engine (rank 0), the
    # others `minivllm worker` (torch.distributed's rendezvous at master_addr:master_port).
    tensor_parallel_size: int = option(
        1, "split every layer over this many ranks (GPUs, or CPU processes), one process each", group=PARALLEL,
        aliases=("-tp",))
    nnodes: int = option(1, "machines the ranks are spread over (tensor-parallel-size / nnodes on each)",
                         group=PARALLEL)
    node_rank: int = option(
        0, "this machine's index: 0 runs the server and rank 0, the others `minivllm worker`", group=PARALLEL)
    master_addr: str = option(
        "127.0.0.1", "address of node 0, where the ranks meet (torch.distributed's rendezvous)", group=PARALLEL)
    master_port: int = option(
        0, "port on node 0 where the ranks meet; 0: a free one (one machine only)", group=PARALLEL)
    # LoRA adapters (engine/lora): requests name an adapter (LoRARequest); up to max_loras of them run in one step,
    # from as many slots on the device, fed from a host cache of max_cpu_loras adapters.
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT's format) on top of the model", group=LORA)
    max_loras: int = option(1, "most adapters in one step (their slots on the device)", group=LORA)
    max_lora_rank: int = option(16, "largest adapter rank served (the slots' size)", group=LORA)
    max_cpu_loras: int | None = option(
        None, "adapters kept in host memory, least recently used out first; default: max-loras", group=LORA)
    distributed_timeout_s: float = option(
        60.0, "seconds a collective may wait before the engine fails (a rank died or hangs)", group=PARALLEL,
        flag="--distributed-timeout")

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
             f"quantization must be None (what the checkpoint says) or one of {QUANTIZATIONS[1:]}, got "
             f"{self.quantization!r}")
        from engine.speculative.config import SpeculativeConfig, SpeculativeConfigError

        try:
            SpeculativeConfig.parse(self.speculative_config)
        except SpeculativeConfigError as exc:  # it names what is wrong
            raise ConfigError(str(exc)) from None
        if self.quantization == "gguf":
            from engine.loading.gguf import is_gguf_model

            need(self.model is None or is_gguf_model(self.model),
                 f"quantization='gguf' serves a GGUF file's quantized weights: {self.model!r} is not a GGUF model")
            need(self.load_format != "dummy", "quantization='gguf' reads a GGUF file's weights: not with "
                                              "load_format='dummy'")
        need(self.attention_backend in _BACKENDS,
             f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        need(self.kvcache_block_size > 0 and self.kvcache_block_size % 8 == 0,
             f"kvcache_block_size must be a positive multiple of 8, got {self.kvcache_block_size}")
        need(self.num_kvcache_blocks == -1 or self.num_kvcache_blocks >= 2,
             f"num_kvcache_blocks must be -1 (size from memory) or at least 2, got {self.num_kvcache_blocks}")
        need(0.0 < self.gpu_memory_utilization <= 1.0,
             f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        need(self.kv_offloading_size_gib >= 0, f"kv_offloading_size must be at least 0 GiB, got "
                                               f"{self.kv_offloading_size_gib}")
        need(self.kv_offloading_size_gib == 0 or self.enable_prefix_caching,
             "the host KV tier (kv_offloading_size) finds blocks by their prefix hashes: it needs prefix caching")
        need(self.kv_offloading_backend in KV_OFFLOADING_BACKENDS,
             f"kv_offloading_backend must be one of {KV_OFFLOADING_BACKENDS}, got {self.kv_offloading_backend!r}")
        need(self.preemption_mode is None or self.preemption_mode in PREEMPTION_MODES,
             f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        need(self.preemption_mode in (None, "recompute") or self.kv_offloading_size_gib > 0,
             f"preemption_mode={self.preemption_mode!r} keeps KV in the host tier: set kv_offloading_size (GiB)")
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
        need(self.max_loras >= 1, f"max_loras must be at least 1, got {self.max_loras}")
        need(1 <= self.max_lora_rank <= 512,
             f"max_lora_rank must be in 1..512, got {self.max_lora_rank}")
        need(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
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

    def resolve_quantization(self, model_path: str, stored: dict[str, Any] | None) -> str | None:
        """How the loader quantizes the model in ``model_path`` (the resolved directory), whose checkpoint's
        ``quantization_config`` is ``stored``: "gguf", "fp8" or None (the weights in the compute dtype, or a
        checkpoint stored quantized as it is stored). The default (None) is "gguf" for a GGUF file's conversion
        whose file is there to read (not with load_format='dummy': random weights have no blocks); "none" is None,
        refused for a checkpoint stored quantized, which has no dequantized weights to serve."""
        if self.quantization == "none":
            if stored is not None:
                raise ConfigError(f"quantization='none': {model_path} is stored quantized (quant_method "
                                  f"{stored.get('quant_method')!r}) and is served as stored; leave quantization unset")
            return None
        if self.quantization is not None or self.load_format == "dummy" or stored is not None:
            return self.quantization
        from engine.loading.gguf import is_gguf_conversion

        return "gguf" if is_gguf_conversion(model_path) else None

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
