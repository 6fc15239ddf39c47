"""The model's shape and numerics, read once from a Hugging Face config and validated.

Everything downstream (model classes, loader, KV cache sizing) reads this dataclass,
never the raw Hugging Face config, so the differences between transformers 4.x
(``rope_theta`` + ``rope_scaling``) and 5.x (``rope_parameters``) are handled here only.

A vision-language model (LLaVA, Qwen2.5-VL) nests its language model's config (``text_config``)
and its vision tower's (``vision_config``): the text part fills the ordinary fields, as a Llama's
or a Qwen2's would, and ``multimodal`` carries the rest. Qwen2.5-VL's text model rotates by three
positions per token (M-RoPE): ``mrope_section`` says which rotary frequencies take which.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigError, EngineConfig

# Rope scaling types the rotary embedding implements; anything else is refused up front.
SUPPORTED_ROPE_TYPES = ("linear", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a mixture-of-experts model: each token goes to its router's top-k experts."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    sparse_layers: tuple[int, ...]  # the layers with experts; the others keep a dense MLP
    weights_in_hidden_dtype: bool  # routing weights cast back to the activations' dtype (Qwen3-MoE)


@dataclass(frozen=True)
class GemmaConfig:
    """What Gemma 2 and Gemma 3 (text) add to the Llama layout."""

    query_pre_attn_scalar: float  # attention scores are scaled by its inverse square root, not head_dim's
    attn_logit_softcapping: float | None  # Gemma 2: scores capped as c * tanh(s / c)
    final_logit_softcapping: float | None  # Gemma 2: the logits likewise
    # Gemma 3: the sliding-window layers' own RoPE (theta, normalised scaling); None: every layer uses rope_theta.
    local_rope: tuple[float, dict[str, Any] | None] | None


GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")

# Vision-language model types, the vision towers (transformers' own modules) each may use, and the
# model types of the language models they may have.
MULTIMODAL_MODEL_TYPES = ("llava", "qwen2_5_vl")
VISION_TOWER_TYPES = {"llava": ("clip_vision_model", "siglip_vision_model"),
                      "qwen2_5_vl": ("qwen2_5_vl_vision", "qwen2_5_vl")}  # transformers 4.x names it as the model
_LANGUAGE_MODEL_TYPES = {"llava": ("llama", "mistral", "qwen2"), "qwen2_5_vl": ("qwen2_5_vl_text",)}


@dataclass(frozen=True)
class MultiModalConfig:
    """What a vision-language model adds to its language model: the vision tower, the projector and the
    image placeholder token."""

    model_type: str  # "llava" or "qwen2_5_vl"
    image_token_id: int  # the placeholder token; the processor expands each image into a run of them
    vision_model_type: str  # one of VISION_TOWER_TYPES[model_type]
    patch_size: int
    hf_config: Any  # the whole transformers config: the vision tower and projector are built from it
    # LLaVA: a fixed-size input, [3, image_size, image_size] pixel values, and the tower layer(s) whose
    # hidden states feed the projector ("default" strategy: drop the CLS position; "full": keep every one).
    image_size: int = 0
    vision_feature_layer: int | tuple[int, ...] = -2
    vision_feature_select_strategy: str = "default"
    # Qwen2.5-VL: each image is a grid of patches (any size); the merger makes one embedding of each
    # spatial_merge_size x spatial_merge_size square of them.
    spatial_merge_size: int = 1


@dataclass
class ModelConfig:
    model_path: str
    architecture: str  # config.json architectures[0], e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama", "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # normalised: {"rope_type": "linear" | "llama3", ...} or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections (always true for Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: torch.dtype | None  # the checkpoint's dtype, if the config names one
    sliding_window: int | None  # None when every layer attends to the full context
    # Per layer: the sliding window its attention sees (the last this-many positions), 0 for the full context.
    layer_windows: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # mixture-of-experts layers (Qwen3-MoE, Mixtral); None for a dense model
    # How the checkpoint's weights are quantized (its ``quantization_config``); None for plain weights.
    quantization_config: dict[str, Any] | None = None
    gemma: GemmaConfig | None = None  # Gemma 2 / Gemma 3's extras; None for other families
    multimodal: MultiModalConfig | None = None  # a vision-language model's vision side; None for text models
    # M-RoPE (Qwen2.5-VL): positions are [3, num_tokens] (temporal, height, width), and the head_dim // 2 rotary
    # frequencies split into runs of these lengths, one per position row. None: one position per token.
    mrope_section: tuple[int, int, int] | None = None
    # A sequence classifier (``*ForSequenceClassification``: a cross-encoder reranker): its labels, which its
    # ``score`` head gives a logit each in place of the LM head's vocabulary; 0 for a causal LM.
    num_labels: int = 0

    @classmethod
    def from_pretrained(cls, model_path: str | Path, trust_remote_code: bool = False) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` if present) from a model directory; a config class
        of the directory's own code loads only with ``trust_remote_code`` (``engine.loading.tokenizer.from_pretrained``)."""
        from transformers import AutoConfig  # heavy import, kept out of module import time

        from engine.loading.tokenizer import from_pretrained

        hf_config = from_pretrained(AutoConfig, model_path, trust_remote_code, "config")
        return cls.from_hf_config(hf_config, model_path)

    @classmethod
    def from_hf_config(cls, hf_config: Any, model_path: str | Path) -> ModelConfig:
        """Build and validate from a transformers ``PretrainedConfig``."""
        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError(f"config of {model_path} has no 'architectures' entry; cannot pick a model class")
        outer, multimodal = hf_config, _read_multimodal(hf_config)
        if multimodal is not None:
            hf_config = hf_config.get_text_config()  # the language model's fields, as a text model has them
        hidden_size = _require(hf_config, "hidden_size")
        num_heads = _require(hf_config, "num_attention_heads")
        head_dim = getattr(hf_config, "head_dim", None) or hidden_size // num_heads
        model_type = getattr(hf_config, "model_type", "")
        rope_theta, rope_scaling, local_rope = _read_rope(hf_config)
        mrope_section = _read_mrope_section(hf_config)
        config = cls(
            model_path=str(model_path),
            architecture=architectures[0],
            model_type=model_type,
            vocab_size=_require(hf_config, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_require(hf_config, "intermediate_size"),
            num_hidden_layers=_require(hf_config, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_require(hf_config, "max_position_embeddings"),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)
                                     or getattr(outer, "tie_word_embeddings", False)),
            # Qwen2's config (and Qwen2.5-VL's text config) has no attention_bias field: its q/k/v projections
            # always carry a bias.
            attention_bias=(model_type in ("qwen2", "qwen2_5_vl_text")
                            or bool(getattr(hf_config, "attention_bias", False))),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            eos_token_ids=_read_eos_token_ids(hf_config, model_path),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            dtype=_read_dtype(outer) or _read_dtype(hf_config),
            sliding_window=_read_sliding_window(hf_config),
            moe=_read_moe(hf_config, model_type),
            quantization_config=_read_quantization(outer),
            gemma=_read_gemma(hf_config, model_type, local_rope),
            multimodal=multimodal,
            mrope_section=mrope_section,
            num_labels=int(hf_config.num_labels) if architectures[0].endswith("ForSequenceClassification") else 0,
        )
        config.layer_windows = _layer_windows(hf_config, config)
        _check_unsupported_features(hf_config)
        config.validate()
        return config

    def validate(self) -> None:
        """Raise ValueError for configurations the models cannot run correctly."""
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.mrope_section is not None and (len(self.mrope_section) != 3 or min(self.mrope_section) < 0
                                               or sum(self.mrope_section) != self.head_dim // 2):
            raise ValueError(f"mrope_section must be three lengths adding up to head_dim // 2 = {self.head_dim // 2}, "
                             f"got {list(self.mrope_section)}")
        if (self.mrope_section is None) != (self.multimodal is None or self.multimodal.model_type != "qwen2_5_vl"):
            raise ValueError(f"{self.architecture}: M-RoPE (rope_parameters.mrope_section) goes with Qwen2.5-VL, "
                             f"and Qwen2.5-VL needs it")


def _read_multimodal(hf_config: Any) -> MultiModalConfig | None:
    """A vision-language config's vision side (None for a text model); ValueError for what is not supported."""
    model_type = getattr(hf_config, "model_type", "")
    vision = getattr(hf_config, "vision_config", None)
    if vision is None:
        return None
    if model_type not in MULTIMODAL_MODEL_TYPES:
        raise ValueError(f"vision-language model type {model_type!r} is not supported; supported: "
                         f"{', '.join(MULTIMODAL_MODEL_TYPES)}")
    vision_type = getattr(vision, "model_type", "")
    if vision_type not in VISION_TOWER_TYPES[model_type]:
        raise ValueError(f"vision tower {vision_type!r} is not supported; supported: "
                         f"{', '.join(VISION_TOWER_TYPES[model_type])}")
    text_type = getattr(hf_config.get_text_config(), "model_type", "?")
    if text_type not in _LANGUAGE_MODEL_TYPES[model_type]:
        raise ValueError(f"{model_type} with a {text_type!r} language model is not supported "
                         f"({' and '.join(_LANGUAGE_MODEL_TYPES[model_type])} are)")
    image_token_id = getattr(hf_config, "image_token_id", None)
    if image_token_id is None:
        image_token_id = _require(hf_config, "image_token_index")
    common = dict(model_type=model_type, image_token_id=int(image_token_id), vision_model_type=vision_type,
                  patch_size=int(_require(vision, "patch_size")), hf_config=hf_config)
    if model_type == "qwen2_5_vl":
        return MultiModalConfig(**common, spatial_merge_size=int(_require(vision, "spatial_merge_size")))
    strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}")
    layer = getattr(hf_config, "vision_feature_layer", -2)
    return MultiModalConfig(
        **common,
        image_size=int(_require(vision, "image_size")),
        vision_feature_layer=layer if isinstance(layer, int) else tuple(int(i) for i in layer),
        vision_feature_select_strategy=strategy,
    )


def _read_mrope_section(hf_config: Any) -> tuple[int, int, int] | None:
    """``mrope_section`` of the rope parameters (transformers 5) or of rope_scaling (4.x); None without."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    section = params.get("mrope_section") if isinstance(params, dict) else None
    return tuple(int(n) for n in section) if section else None


def _check_unsupported_features(hf_config: Any) -> None:
    gemma = getattr(hf_config, "model_type", "") in GEMMA_MODEL_TYPES
    hidden_act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu")
    expected = "gelu_pytorch_tanh" if gemma else "silu"
    if hidden_act != expected:
        raise ValueError(f"this architecture's MLPs are supported with {expected}, the config has "
                         f"hidden_act={hidden_act!r}")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("MLP biases (mlp_bias=True) are not supported")


def _read_quantization(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization_config as a dict, checked against what the loader implements."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(quant)
    from engine.loading.int_weights import int_scheme
    from engine.models.fp8 import Fp8Scheme

    if quant.get("quant_method") == "fp8":  # either raises ValueError naming what is not supported
        Fp8Scheme.from_hf(quant)
    else:
        int_scheme(quant)
    return quant


def _require(hf_config: Any, name: str) -> Any:
    value = getattr(hf_config, name, None)
    if value is None:
        raise ValueError(f"model config is missing required field {name!r}")
    return value


def _read_rope(hf_config: Any) -> tuple[float, dict[str, Any] | None, tuple[float, dict | None] | None]:
    """Return (rope_theta, normalised rope_scaling, the sliding layers' own (theta, scaling) or None) from either
    config generation."""
    params = getattr(hf_config, "rope_parameters", None)  # transformers 5: theta and scaling in one dict
    if params and "full_attention" in params:  # per layer type (Gemma 3): global layers, then local ones
        full, local = params["full_attention"], params.get("sliding_attention") or params["full_attention"]
        return (float(full.get("rope_theta", 10000.0)), normalize_rope_scaling(full),
                (float(local.get("rope_theta", 10000.0)), normalize_rope_scaling(local)))
    local_base = getattr(hf_config, "rope_local_base_freq", None)  # Gemma 3 under transformers 4.x
    local = (float(local_base), None) if local_base is not None else None
    if params:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        scaling = params
    else:  # transformers 4.x
        theta = getattr(hf_config, "rope_theta", None)
        scaling = getattr(hf_config, "rope_scaling", None)
    return float(theta if theta is not None else 10000.0), normalize_rope_scaling(scaling), local


def _read_gemma(hf_config: Any, model_type: str, local_rope) -> GemmaConfig | None:
    if model_type not in GEMMA_MODEL_TYPES:
        return None
    def positive_or_none(name: str) -> float | None:
        value = getattr(hf_config, name, None)
        return float(value) if value else None
    return GemmaConfig(
        query_pre_attn_scalar=float(getattr(hf_config, "query_pre_attn_scalar", None) or _require(hf_config, "head_dim")),
        attn_logit_softcapping=positive_or_none("attn_logit_softcapping"),
        final_logit_softcapping=positive_or_none("final_logit_softcapping"),
        local_rope=local_rope if model_type == "gemma3_text" else None,
    )


def normalize_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Map the config's rope scaling dict to ``None``, linear or llama3 (see ``ModelConfig.rope_scaling``)."""
    if not scaling:
        return None
    if "full_attention" in scaling or "sliding_attention" in scaling:
        raise ValueError("per-layer-type rope parameters are not supported")
    # Older configs spell the key "type"; "default" (transformers 5 always writes a dict) means no scaling, as
    # does "mrope" (Qwen2-VL's older name: its sections are ModelConfig.mrope_section, the frequencies the default).
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "mrope":
        rope_type = "default"
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if "factor" not in scaling:
        raise ValueError(f"rope scaling {rope_type!r} needs a 'factor', got {scaling}")
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": float(scaling["factor"])}
    missing = [key for key in _LLAMA3_ROPE_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"llama3 rope scaling is missing {missing}, got {scaling}")
    return {
        "rope_type": "llama3",
        "factor": float(scaling["factor"]),
        "low_freq_factor": float(scaling["low_freq_factor"]),
        "high_freq_factor": float(scaling["high_freq_factor"]),
        "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
    }


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_eos_token_ids(hf_config: Any, model_path: str | Path) -> list[int]:
    """Union of config.json's and generation_config.json's eos ids, config.json's first, without repeats."""
    ids = _as_id_list(getattr(hf_config, "eos_token_id", None))
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        ids += _as_id_list(json.loads(generation_config.read_text()).get("eos_token_id"))
    return list(dict.fromkeys(ids))


def _read_dtype(hf_config: Any) -> torch.dtype | None:
    # transformers 5 calls it dtype, 4.x torch_dtype; either may be a string or a torch.dtype.
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {value!r} in model config")
    return dtype


def _read_moe(hf_config: Any, model_type: str) -> MoEConfig | None:
    """Mixtral: every layer sparse, top-k always renormalised; Qwen3-MoE: every ``decoder_sparse_step``-th
    layer outside ``mlp_only_layers``, renormalised when ``norm_topk_prob``."""
    layers = _require(hf_config, "num_hidden_layers")
    if model_type == "mixtral":
        return MoEConfig(_require(hf_config, "num_local_experts"), _require(hf_config, "num_experts_per_tok"),
                         _require(hf_config, "intermediate_size"), True, tuple(range(layers)), False)
    if model_type == "qwen3_moe":
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        num_experts = _require(hf_config, "num_experts")
        sparse = tuple(i for i in range(layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        return MoEConfig(num_experts, _require(hf_config, "num_experts_per_tok"),
                         _require(hf_config, "moe_intermediate_size"), bool(getattr(hf_config, "norm_topk_prob", False)),
                         sparse, True)
    return None


def _layer_windows(hf_config: Any, config: ModelConfig) -> tuple[int, ...]:
    """Each layer's window: Mistral's applies to every layer; ``layer_types`` (transformers 5: Qwen2 with
    ``use_sliding_window``, past ``max_window_layers``) names the sliding ones. A window as long as the
    context is no window."""
    window = config.sliding_window
    layers = config.num_hidden_layers
    if window is None or window >= config.max_position_embeddings:
        return (0,) * layers
    types = getattr(hf_config, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window,) * layers


def _read_sliding_window(hf_config: Any) -> int | None:
    # Qwen2/Qwen3 configs carry a sliding_window value that only applies when use_sliding_window is set.
    if not getattr(hf_config, "use_sliding_window", True):
        return None
    window = getattr(hf_config, "sliding_window", None)
    return int(window) if window is not None else None


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    wanted = config.max_model_len or limit
    if wanted > limit:
        raise ConfigError(f"max_model_len={wanted} exceeds the model's max_position_embeddings={limit}")
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < wanted:
        raise ConfigError(
            f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must be at "
            f"least max_model_len ({wanted})"
        )
    return wanted


def check_tensor_parallel(model_config: ModelConfig, tp: int) -> None:
    """A tensor-parallel size the model's shapes split evenly by, or a ConfigError saying which does not."""
    splits = {"attention heads": model_config.num_attention_heads, "vocabulary": model_config.vocab_size,
              "intermediate size": model_config.intermediate_size}
    if model_config.moe is not None:
        splits["experts' intermediate size"] = model_config.moe.expert_intermediate_size
    for what, size in splits.items():
        if size % tp:
            raise ConfigError(f"tensor_parallel_size={tp} does not divide the model's {what} ({size})")
    if model_config.multimodal is not None:
        raise ConfigError(f"{model_config.architecture} runs on one GPU for now: tensor parallelism does not "
                          f"split its vision encoder")
    kv = model_config.num_key_value_heads
    if kv % tp and tp % kv:
        raise ConfigError(f"tensor_parallel_size={tp} neither divides nor is a multiple of the model's "
                          f"{kv} KV heads")
