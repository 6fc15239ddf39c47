"""An EAGLE-3 head's checkpoint: its config read and checked, its weights loaded (``engine.models.llama_eagle3``).

Two layouts are read, as vLLM reads them:

* EAGLE's own (``yuhuili/EAGLE3-*``, SpecForge): a Llama ``config.json`` whose ``architectures`` is
  ``LlamaForCausalLMEagle3`` (or ``Eagle3LlamaForCausalLM``), one hidden layer, ``draft_vocab_size``, optionally
  ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``; tensors ``midlayer.*``, ``fc``,
  ``norm``, ``lm_head``, ``d2t`` and ``t2d``, and ``embed_tokens`` where the head has its own embeddings;
* speculators' (``RedHatAI/*speculator.eagle3``): ``speculators_model_type: "eagle3"`` with the layer's Llama
  config under ``transformer_layer_config``, the same EAGLE-3 keys at the top level (the aux layer ids too), and
  the layer's tensors named ``layers.0.*``. Its ``norm_before_residual`` defaults to true, EAGLE's to false.

``d2t`` [draft_vocab] gives each draft id's offset to its target id; ``t2d`` (which target ids the draft vocabulary
holds) says nothing more and is not read. A head whose draft vocabulary is the target's may leave both out.

Aux layer ids name the target layers whose input (the residual stream entering them, vLLM's reading of the ids)
the head reads; without them, vLLM's default (2, L // 2, L - 3) of the target's L layers. SGLang reads an id i in
``eagle_config`` as the output of layer i (the input of i + 1): a checkpoint trained that way is read here one layer
early, as vLLM reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.loading.loader import (
    _default_dtype,
    _without_default_init,
    iter_safetensors,
    safetensors_files,
)
from engine.loading.model_config import ModelConfig
from engine.models.linear import process_weights_after_loading
from engine.models.llama_eagle3 import LlamaEagle3Head

HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Checkpoint:
    path: str
    layer: ModelConfig  # the decoder layer's shape, rope and vocabulary (the target's, which it embeds)
    draft_vocab_size: int  # the rows of its LM head
    target_hidden_size: int  # the width of each target state it reads
    fc_inputs: int  # fc's input width: the target states it reads side by side
    norm_before_residual: bool  # the residual is the normed hidden input (else the hidden input itself)
    aux_layer_ids: tuple[int, ...] | None  # the target layers whose input it reads; None: the default
    own_embeddings: bool  # it has its own embed_tokens (else it embeds with the target's)
    has_d2t: bool

    @classmethod
    def read(cls, path: str | Path) -> Eagle3Checkpoint:
        """The head's config and tensor names from its directory; ValueError naming what does not fit."""
        given = json.loads((Path(path) / "config.json").read_text())
        if "speculators_model_type" in given:
            if given["speculators_model_type"] != "eagle3":
                raise ValueError(f"a speculators checkpoint of type {given['speculators_model_type']!r}, not eagle3")
            layer_dict, nbr_default = dict(given.get("transformer_layer_config") or {}), True
            ids = given.get("eagle_aux_hidden_state_layer_ids")
        else:
            architecture = (given.get("architectures") or ["?"])[0]
            if architecture not in HEAD_ARCHITECTURES:
                raise ValueError(f"its architecture is {architecture}, not an EAGLE-3 head's "
                                 f"({' or '.join(HEAD_ARCHITECTURES)})")
            layer_dict, nbr_default = given, False
            eagle = given.get("eagle_config") or {}
            ids = given.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
            if not eagle.get("use_aux_hidden_state", True):
                raise ValueError("eagle_config.use_aux_hidden_state is false: heads without the target's aux "
                                 "states are not served")
        if given.get("norm_before_fc"):
            raise ValueError("norm_before_fc heads are not served")
        layer = _layer_config(layer_dict, path)
        names = _tensor_shapes(path)
        if "fc.weight" not in names or "lm_head.weight" not in names:
            raise ValueError("it has no fc.weight or lm_head.weight: not an EAGLE-3 head's layout")
        return cls(str(path), layer, int(given.get("draft_vocab_size") or layer.vocab_size),
                   int(given.get("target_hidden_size") or layer.hidden_size), names["fc.weight"][1],
                   bool(given.get("norm_before_residual", nbr_default)),
                   tuple(int(i) for i in ids) if ids else None, "embed_tokens.weight" in names, "d2t" in names)

    def load(self, num_aux_layers: int, target_vocab_size: int, dtype: torch.dtype, device: torch.device,
             max_position: int) -> LlamaEagle3Head:
        """The head on ``device`` in ``dtype``, its rope table ``max_position`` long; ValueError for a tensor that
        does not fit, or a draft id that maps outside the target's vocabulary."""
        with torch.device(device), _default_dtype(dtype), _without_default_init():
            head = LlamaEagle3Head(self.layer, self.target_hidden_size, num_aux_layers, self.draft_vocab_size,
                                   self.norm_before_residual, self.own_embeddings, max_position)
        found = {}  # d2t, read as the tensors stream by (each is read while its file is open)

        def weights():
            for name, tensor in iter_safetensors(safetensors_files(self.path)):
                name = _head_name(name)
                if name == "d2t":
                    found[name] = tensor.load()
                elif name != "t2d":
                    yield name, tensor

        head.load_weights(weights())
        process_weights_after_loading(head)
        d2t = found.get("d2t")
        if d2t is not None:
            if d2t.shape != (self.draft_vocab_size,):
                raise ValueError(f"d2t has shape {tuple(d2t.shape)}, not [draft_vocab_size={self.draft_vocab_size}]")
            targets = torch.arange(self.draft_vocab_size) + d2t.long()
            if targets.min() < 0 or targets.max() >= target_vocab_size:
                raise ValueError(f"d2t maps draft ids outside the target's vocabulary of {target_vocab_size}")
            head.d2t.copy_(d2t)
        return head.eval()


def _layer_config(layer_dict: dict[str, Any], path) -> ModelConfig:
    import transformers

    if layer_dict.get("model_type", "llama") != "llama":
        raise ValueError(f"its layer is a {layer_dict['model_type']} layer; Llama layers are served")
    layer = ModelConfig.from_hf_config(transformers.LlamaConfig(**{**layer_dict, "architectures": [
        "LlamaForCausalLMEagle3"]}), path)
    if layer.num_hidden_layers != 1:
        raise ValueError(f"it has {layer.num_hidden_layers} layers; EAGLE-3 heads of one layer are served")
    return layer


def _tensor_shapes(path) -> dict[str, list[int]]:
    """The head's tensor names (as ``_head_name`` gives them) and shapes, from the safetensors headers."""
    from safetensors import safe_open

    shapes = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                shapes[_head_name(name)] = f.get_slice(name).get_shape()
    return shapes


def _head_name(name: str) -> str:
    """A checkpoint tensor's name as the head's module names it: speculators' ``layers.0.`` is EAGLE's
    ``midlayer.``; a ``model.`` prefix goes."""
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
