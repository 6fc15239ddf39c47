"""A tiny hand-built paged KV cache that drives a model step by step, without the engine."""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
import transformers
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend

LICENSE_TEXT = Path(__file__).parent / "data" / "apache-2.0.txt"  # the Apache License 2.0: 2,224 tokens


def prompt_perplexity(llm, text: str) -> float:
    """The perplexity of ``text`` as one prompt, from the engine's prompt logprobs (every token after the first)."""
    from engine import SamplingParams

    scored = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = [entry.logprob for entry in scored.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


class PagedRunner:
    """Runs steps of one flat batch through ``model`` with per-request block tables.

    Blocks are handed out in a shuffled order so block tables are not contiguous ranges,
    which is what a real pool looks like after some traffic.
    """

    def __init__(self, model: nn.Module, num_blocks: int = 64, block_size: int = 16, max_blocks_per_req: int = 16):
        self.model = model
        self.block_size = block_size
        self.max_blocks_per_req = max_blocks_per_req
        param = next(model.parameters())
        for attn in model.attention_layers():
            shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
            attn.bind_kv_cache(
                torch.zeros(shape, dtype=param.dtype, device=param.device),
                torch.zeros(shape, dtype=param.dtype, device=param.device),
            )
            attn.set_backend(TorchAttentionBackend())
        self.device = param.device
        self.free_blocks = list(range(num_blocks))
        random.Random(0).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.num_computed: dict[int, int] = {}

    def step(self, chunks: list[tuple[int, list[int]]], inputs_embeds: torch.Tensor | None = None,
             positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Run one step: ``chunks`` is [(request id, new token ids)], decodes (one token) first.

        ``inputs_embeds`` [num new tokens, hidden], in the chunks' order, replaces the tokens' embeddings (a
        vision model's images in them); ``positions`` (e.g. [3, num new tokens] M-RoPE positions) replaces the
        tokens' indices as their positions. Returns the float32 logits of every new token, one [query_len, vocab]
        tensor per chunk.
        """
        given, positions = positions, []
        input_ids, slots, query_lens, seq_lens = [], [], [], []
        for req_id, tokens in chunks:
            start = self.num_computed.get(req_id, 0)
            seq_len = start + len(tokens)
            table = self._grow_table(req_id, seq_len)
            for pos in range(start, seq_len):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            positions += range(start, seq_len)
            query_lens.append(len(tokens))
            seq_lens.append(seq_len)
            self.num_computed[req_id] = seq_len
        meta = self._metadata([req for req, _ in chunks], slots, query_lens, seq_lens)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device) if given is None else given.to(self.device)
        with torch.no_grad():
            hidden = self.model(ids, pos, meta) if inputs_embeds is None else self.model(ids, pos, meta, inputs_embeds)
            logits = self.model.compute_logits(hidden).float()  # [num_tokens, vocab]
        return list(logits.split(query_lens))

    def _grow_table(self, req_id: int, seq_len: int) -> list[int]:
        table = self.block_tables.setdefault(req_id, [])
        while len(table) * self.block_size < seq_len:
            table.append(self.free_blocks.pop())
        return table

    def _metadata(self, req_ids: list[int], slots: list[int], query_lens: list[int], seq_lens: list[int]):
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        tables = torch.zeros(len(req_ids), self.max_blocks_per_req, dtype=torch.int32)
        for i, req_id in enumerate(req_ids):
            table = self.block_tables[req_id]
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        query_start = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            query_start_loc=query_start.to(self.device),
            seq_lens=seq_lens_cpu.to(self.device),
            block_tables=tables.to(self.device),
            num_reqs=len(req_ids),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens_cpu,
        )


# Tiny random-weight configs of every supported architecture, for tests against transformers.
VOCAB = 320

SMALL_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

TINY_CONFIGS = {
    "llama-llama3-rope": lambda: transformers.LlamaConfig(
        **SMALL_CONFIG,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-tied-linear-rope": lambda: transformers.LlamaConfig(
        **{**SMALL_CONFIG, "num_key_value_heads": 4},
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "mistral": lambda: transformers.MistralConfig(**SMALL_CONFIG, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL_CONFIG, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL_CONFIG, head_dim=32, tie_word_embeddings=False),
}


def set_use_triton(model: nn.Module, enabled: bool | None) -> None:
    """Force the torch reference (False) or the Triton kernels (True) on every norm, activation and rotary module
    of ``model``; None: by device (``engine.models.fused_path``)."""
    from engine.models.activation import SiluAndMul
    from engine.models.norm import RMSNorm
    from engine.models.rotary import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
            module.use_triton = enabled


def spread_weights(model: torch.nn.Module) -> None:
    """Replace HF's tiny init with weights that make every block matter in the logits."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.empty_like(param).uniform_(0.5, 1.5, generator=gen))
            elif param.dim() == 1:  # biases
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[-1]))


def save_tiny_model(name: str, path: Path) -> Path:
    """Save a tiny HF checkpoint (safetensors, no tokenizer) for ``name`` in TINY_CONFIGS or an alias."""
    aliases = {"llama": "llama-llama3-rope"}
    return save_checkpoint(TINY_CONFIGS[aliases.get(name, name)](), path)


def save_checkpoint(config: transformers.PretrainedConfig, path: Path) -> Path:
    """Save a random-weight HF checkpoint of ``config`` (seeded, weights spread) to ``path``."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    spread_weights(model)
    model.save_pretrained(path)
    return path


def random_image(seed: int, height: int, width: int):
    """A PIL RGB image of uniform random pixels, the same for the same seed."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def record_image_cuts(scheduler) -> list:
    """Wrap ``scheduler.schedule`` (for the scheduler's life) so that every image a step's chunk ends inside of is
    appended to the returned list: proof that chunked prefill cut through an image."""
    cuts, schedule = [], scheduler.schedule

    def recording_schedule():
        out = schedule()
        for rid in out.num_scheduled_tokens:
            request = scheduler.get_request(rid)
            end = request.num_computed_tokens  # after this step
            cuts.extend(mm for mm in request.mm_inputs if mm.offset < end < mm.end)
        return out

    scheduler.schedule = recording_schedule
    return cuts
