"""``LoRARequest``: which adapter a request runs under (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter in PEFT's format (``adapter_config.json`` and ``adapter_model.safetensors``) at ``lora_path``,
    served as model ``lora_name``. ``lora_int_id`` (at least 1) names it inside the engine: the slots, the host
    cache and the prefix cache know an adapter by it, so two adapters need two ids, and one id always means the same
    files. ``base_model_name``: the served model it was trained on (``/v1/models`` lists it as the parent)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
