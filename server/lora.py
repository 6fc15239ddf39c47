"""The LoRA adapters a server serves, by the name requests give as ``model`` (vLLM's ``OpenAIServingModels``).

    --lora-modules name=path ────┐
    POST /v1/load_lora_adapter ──┴──> LoRARegistry: name -> LoRARequest (ids 1, 2, 3, ..., never given twice)
    a request's "model" ──> ServingContext.check_model ──> SamplingParams.lora_request (None: the base model)
    POST /v1/unload_lora_adapter ──> the name is gone: new requests for it are a 404; those running finish

An adapter's files are checked (``read_adapter_config``: its configuration and its tensors' shapes) before its
name is taken, so a bad adapter is refused with the reason instead of failing the requests that name it; the engine
reads its tensors when a request first needs them. Ids are never reused: the engine's slots, its host cache and
its prefix cache know an adapter by its id, so an adapter unloaded and loaded again from the same path (whose files
may have changed in between) gets a new one.

This module imports nothing of the HTTP side: ``minivllm serve`` fills the registry from ``--lora-modules`` before
the engine starts, so that a bad adapter fails the start-up at once, not after the model has loaded.
"""

from __future__ import annotations

import threading

from engine.lora.adapter import LoRAAdapterError, read_adapter_config
from engine.lora.request import LoRARequest


class LoRANameError(LoRAAdapterError):
    """A name an adapter cannot take: it is the served model's, or another adapter's."""


class UnknownAdapterError(LookupError):
    """No adapter of that name (or id) is loaded (a 404 at the API)."""


class LoRARegistry:
    """The adapters served on top of the model named ``base_model_name``, in the order they were added.

    ``enabled``: the engine runs with ``enable_lora``; without it nothing can be added. ``max_rank``: the engine's
    ``max_lora_rank``, the largest rank an adapter may have. Adding runs in a worker thread (it reads files) while
    the event loop looks names up: the lock makes a name's check and its entry one step, and lookups read the
    dictionary, which is replaced rather than changed in place."""

    def __init__(self, base_model_name: str, enabled: bool = False, max_rank: int | None = None):
        self.base_model_name = base_model_name
        self.enabled = enabled
        self.max_rank = max_rank
        self._adapters: dict[str, LoRARequest] = {}
        self._last_id = 0
        self._lock = threading.Lock()

    def __iter__(self):
        return iter(list(self._adapters.values()))

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the adapter at ``path`` as model ``name``; raises ``LoRAAdapterError`` (with the reason) when
        LoRA is off, the name is taken, or the adapter cannot be served."""
        if not self.enabled:
            raise LoRAAdapterError("LoRA adapters are not enabled on this server: start it with --enable-lora")
        if not name or not path:
            raise LoRANameError("both 'lora_name' and 'lora_path' must be given")
        if base_model_name not in (None, self.base_model_name):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: base_model_name {base_model_name!r} is not served here "
                                   f"(this server serves {self.base_model_name!r})")
        self._check_name_free(name)
        read_adapter_config(path, self.max_rank)  # raises LoRAAdapterError with the reason
        with self._lock:
            self._check_name_free(name)  # another load may have taken it while the files were read
            self._last_id += 1
            adapter = LoRARequest(name, self._last_id, path, self.base_model_name)
            self._adapters = {**self._adapters, name: adapter}
        return adapter

    def remove(self, name: str | None = None, lora_int_id: int | None = None) -> LoRARequest:
        """Stop serving the adapter named ``name`` (or, without a name, the one of id ``lora_int_id``); raises
        ``UnknownAdapterError`` when none is loaded."""
        if not name and lora_int_id is None:
            raise LoRAAdapterError("either 'lora_name' or 'lora_int_id' must be given")
        with self._lock:
            if name:
                adapter = self._adapters.get(name)
            else:
                adapter = next((a for a in self._adapters.values() if a.lora_int_id == lora_int_id), None)
            if adapter is None or (lora_int_id is not None and adapter.lora_int_id != lora_int_id):
                what = repr(name) if name else f"of lora_int_id {lora_int_id}"
                if adapter is not None:
                    what += f" with lora_int_id {lora_int_id} (its id is {adapter.lora_int_id})"
                raise UnknownAdapterError(f"The lora adapter {what} cannot be found.")
            self._adapters = {n: a for n, a in self._adapters.items() if n != adapter.lora_name}
        return adapter

    def _check_name_free(self, name: str) -> None:
        if name == self.base_model_name:
            raise LoRANameError(f"{name!r} is the served model's name; give the adapter another")
        if name in self._adapters:
            raise LoRANameError(f"The lora adapter '{name}' has already been loaded.")
