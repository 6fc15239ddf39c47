"""Benchmark workloads: random token-id prompts with per-request output lengths, seeded."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: tuple[int, int]  # uniform, inclusive
    output_len: tuple[int, int]  # uniform, inclusive
    seed: int = 0

    def sample(self, vocab_size: int) -> tuple[list[list[int]], list[int]]:
        """Prompts (random token ids) and output lengths; EOS is ignored by the runs."""
        rng = np.random.default_rng(self.seed)
        prompt_lens = rng.integers(self.prompt_len[0], self.prompt_len[1] + 1, self.num_requests)
        output_lens = rng.integers(self.output_len[0], self.output_len[1] + 1, self.num_requests)
        prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in prompt_lens]
        return prompts, [int(n) for n in output_lens]


WORKLOADS = {
    # CPU, default model, float32.
    "C1": Workload("C1", 32, (32, 256), (32, 128)),
    # GPU, the workload nano-vllm publishes.
    "W1": Workload("W1", 256, (100, 1024), (100, 1024)),
}

# Real model shapes for dummy-weight runs on machines without the weights.
MODEL_SHAPES = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    # A draft for Llama-3.1-8B (the same tokenizer).
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    # Mixture of experts: 30.5B parameters (61 GB in bf16), 3.3B active per token (8 of 128 experts a layer).
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # 141 GB of bf16 weights: for tensor parallelism over several GPUs.
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
}


def shape_dir(name: str) -> Path:
    """A model directory holding only config.json for a known shape (weights: load_format='dummy')."""
    path = Path(tempfile.mkdtemp(prefix=f"minivllm-{name}-"))
    (path / "config.json").write_text(json.dumps(MODEL_SHAPES[name], indent=2))
    return path


def model_and_workload(shape: str | None, tokenizer: str | None, num_requests: int | None,
                       on_cuda: bool) -> tuple[str, dict, Workload]:
    """What an offline benchmark runs: a real shape with dummy weights (and a tokenizer for its text) or the
    default model; W1 on CUDA, C1 on the CPU, cut to ``num_requests``. Returns (model, LLM kwargs, workload)."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import resolve_model_path

    if shape:
        kwargs = dict(load_format="dummy", tokenizer=tokenizer or resolve_model_path(EngineConfig()))
        model = str(shape_dir(shape))
    else:
        kwargs, model = {}, resolve_model_path(EngineConfig())
    workload = WORKLOADS["W1" if on_cuda else "C1"]
    if num_requests:
        workload = Workload(workload.name, num_requests, workload.prompt_len, workload.output_len, workload.seed)
    return model, kwargs, workload
