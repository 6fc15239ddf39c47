"""The engine's checks of the adapters requests name, before a request is queued: a bad adapter is the request's
error (a 400), never a failed step.

An adapter is checked once per id (its configuration, its modules' names and shapes against the model's layers);
an id names one path for the engine's life.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.errors import RequestError
from engine.loading.model_config import ModelConfig
from engine.lora.adapter import LoRAAdapterError, read_adapter_config
from engine.lora.request import LoRARequest
from engine.outputs import LoRAStats


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection an adapter may adapt, by its name's last part."""
    hidden, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, config.intermediate_size), "up_proj": (hidden, config.intermediate_size),
            "down_proj": (config.intermediate_size, hidden)}


class AdapterChecks:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, worker):
        self.config = config
        self.shapes = module_shapes(model_config)
        self.modules: set[str] = worker.module_names() if worker is not None else set()
        self.paths: dict[int, str] = {}  # adapter id -> the path it was checked at

    def check(self, lora: LoRARequest, params) -> None:
        """RequestError unless the engine can run this request under ``lora``."""
        if not self.config.enable_lora:
            raise RequestError(f"LoRA adapter {lora.lora_name!r}: this engine serves no adapters (enable_lora, "
                               f"--enable-lora)", param="model")
        if params.pooling is not None or self.config.runner == "pooling":
            raise RequestError("LoRA adapters serve generation, not pooling", param="model")
        known = self.paths.get(lora.lora_int_id)
        if known == lora.lora_path:
            return
        if known is not None:
            raise RequestError(f"LoRA adapter id {lora.lora_int_id} already names the adapter at {known}; "
                               f"another adapter needs another id", param="model")
        try:
            adapter = read_adapter_config(lora.lora_path, self.config.max_lora_rank)
        except LoRAAdapterError as e:
            raise RequestError(str(e), param="model") from None
        for module, (in_features, out_features) in adapter.shapes.items():
            if module not in self.modules:
                raise RequestError(f"LoRA adapter {lora.lora_name!r}: the model has no linear layer {module!r} "
                                   f"to adapt", param="model")
            expected = self.shapes[module.rsplit(".", 1)[-1]]
            if (in_features, out_features) != expected:
                raise RequestError(f"LoRA adapter {lora.lora_name!r}: {module} maps {in_features} to {out_features} "
                                   f"features; the model's maps {expected[0]} to {expected[1]} (an adapter of "
                                   f"another model?)", param="model")
        self.paths[lora.lora_int_id] = lora.lora_path

    def stats(self, scheduler, worker) -> LoRAStats | None:
        """Requests by adapter name, and the slots' loads and evictions; None without LoRA."""
        if worker is None:
            return None
        stats = LoRAStats(self.config.max_loras, num_loads=worker.num_loads, num_evictions=worker.num_evictions)
        for requests, counts in ((scheduler.running, stats.running), (scheduler.waiting, stats.waiting)):
            for request in requests:
                lora = request.sampling_params.lora_request
                if lora is not None:
                    counts[lora.lora_name] = counts.get(lora.lora_name, 0) + 1
        return stats
