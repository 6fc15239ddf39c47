"""Portable paged attention in plain torch: the reference every other backend is tested against.

It runs anywhere torch runs (CPU float32, CUDA bfloat16). K/V are read through the
block tables by gathering each request's blocks; faster backends read them in place.
An FP8 cache (``kv_scales`` given) is quantized here when written and dequantized when gathered:
the exact arithmetic the Triton kernels are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from kvcache.paged_cache import FP8_DTYPE, fp8_to_float32, quantize_fp8, rotate_heads

KVScales = tuple[torch.Tensor, torch.Tensor]  # an FP8 cache's (k_scales, v_scales), [num_blocks, block_size, kvh]

# ``AttentionMetadata.derive`` key of a decode-only step whose K/V writes its caller makes after the forward pass:
# a list, to which each layer appends its new (k, v) instead of writing them (``TorchAttentionBackend.forward``).
# A compiled step (``engine.worker.cpu_compile``) sets it: its graph then mutates no cache.
DEFERRED_KV_WRITES = "torch:deferred_kv_writes"


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    kv_scales: KVScales | None = None,
) -> None:
    """Store the new tokens' K/V in their slots: one indexed copy per tensor (for FP8, K rotated, then both
    quantized: see ``kvcache.paged_cache``)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for cache, x, scales in ((k_cache, k, kv_scales and kv_scales[0]), (v_cache, v, kv_scales and kv_scales[1])):
        rows = cache.view(-1, num_kv_heads, head_dim)
        if scales is None:
            rows.index_copy_(0, slot_mapping, x)
            continue
        values, row_scales = quantize_fp8(rotate_heads(x) if cache is k_cache else x)  # a scale per (token, head)
        # Byte views: CPU indexed copies of float8 tensors are not implemented.
        rows.view(torch.uint8).index_copy_(0, slot_mapping, values.view(torch.uint8))
        scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, row_scales)


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [n, num_blocks_needed] int32
    scales: torch.Tensor | None = None,  # an FP8 cache's [num_blocks, block_size, num_kv_heads]
    dtype: torch.dtype | None = None,  # the compute dtype the FP8 values are dequantized to
) -> torch.Tensor:
    """Contiguous copy of the first blocks of n requests: [n, num_kv_heads, num_blocks_needed * block_size, head_dim]."""
    n, nb = block_tables.shape
    ids = block_tables.reshape(-1)
    if ids.dtype != torch.int64:
        ids = ids.long()
    if scales is None:
        blocks = cache.index_select(0, ids)  # [n * nb, bs, kvh, hd]
    else:
        raw = cache.view(torch.uint8).index_select(0, ids).view(FP8_DTYPE)
        blocks = (fp8_to_float32(raw) * scales.index_select(0, ids)[..., None]).to(dtype)
    return blocks.view(n, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


@dataclass(frozen=True)
class LayerCache:
    """One attention layer's view of the paged KV cache and its configuration, as this backend reads them."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    kv_scales: KVScales | None  # an FP8 cache's scales
    scale: float
    window: int = 0  # a sliding window: a query sees only the last ``window`` positions; 0: all
    softcap: float = 0.0  # scores capped as softcap * tanh(scores / softcap) (Gemma 2); 0: off


class TorchAttentionBackend:
    """Decode requests run as one padded batch; prefill requests run one by one."""

    name = "torch"

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float,
             kv_scales: KVScales | None = None, window: int = 0, softcap: float = 0.0, rope=None) -> LayerCache:
        """One layer's cache and configuration, as ``forward`` takes them (torch's ops check their inputs)."""
        return LayerCache(k_cache, v_cache, kv_scales, scale, window, softcap)

    def warm_up(self, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, max_query_len: int, windows: tuple[int, ...] = (0,),
                kv_scales: KVScales | None = None, dtype: torch.dtype | None = None, softcap: float = 0.0,
                fp8_out: bool = False, rope=None, column_scales: bool = False) -> int:
        """Nothing to compile: plain torch ops."""
        return 0

    def forward(
        self,
        layer: LayerCache,  # ``bind``'s
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        meta: AttentionMetadata,
        fp8_out: bool = False,  # the Triton backend may return the output quantized; this one never does
        rope=None,  # the rope q and k still need (``engine.models.rotary.PendingRope``), or None
    ) -> torch.Tensor:
        """The attention output; a ``rope`` is applied op by op first (``PendingRope.apply``), as the Triton
        backend's KV-cache write applies it in its kernel."""
        k_cache, v_cache, kv_scales = layer.k_cache, layer.v_cache, layer.kv_scales
        scale, window, softcap = layer.scale, layer.window, layer.softcap
        if rope is not None:
            q, k, v = rope.apply(q, k, v, meta)
        deferred = meta.derive(DEFERRED_KV_WRITES, _none)
        if deferred is not None:  # a decode-only step, one token per request, a 16-bit cache
            deferred.append((k, v))
            return self._decode(q, k_cache, v_cache, meta, scale, window, None, softcap, new_kv=(k, v))
        num_tokens = meta.slot_mapping.shape[0]
        write_kv(k_cache, v_cache, k[:num_tokens], v[:num_tokens], meta.slot_mapping, kv_scales)
        out = torch.empty_like(q)
        if kv_scales is not None:  # an FP8 cache holds K rotated: the queries turn the same way
            q = rotate_heads(q).to(q.dtype)
        if meta.num_decodes > 0:
            d = meta.num_decodes
            out[:d] = self._decode(q[:d], k_cache, v_cache, meta, scale, window, kv_scales, softcap)
        starts, seq_lens = meta.derive("torch:host_lists", lambda: (meta.query_start_loc_cpu.tolist(),
                                                                     meta.seq_lens_cpu.tolist()))
        # Every other request, one at a time; in a mixed step's CUDA graph (``meta.decode_seq_lens``) that is every
        # request, decodes included, as this path serves them alike. Padding requests have no tokens.
        for i in range(meta.num_decodes, meta.num_reqs):
            lo, hi = starts[i], starts[i + 1]
            if hi == lo:
                continue
            out[lo:hi] = self._prefill(q[lo:hi], k_cache, v_cache, meta.block_tables[i], seq_lens[i], scale, window,
                                       kv_scales, softcap)
        if starts[meta.num_reqs] < out.shape[0]:
            out[starts[meta.num_reqs]:].zero_()  # padding tokens past the last request's
        return out

    def plan_decode_step(self, layer: LayerCache, meta: AttentionMetadata,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Derive on the host what the layer's decode-only step reads from ``meta``, which a compiled step could not
        trace (the step's longest context is read from a host tensor): its block ids [d, nb], additive mask
        [d, 1, 1, nb * block_size] and newest positions [d, 1, nb * block_size, 1], returned."""
        d, block_size = meta.num_decodes, layer.k_cache.shape[1]
        return _derive_decode_plan(meta, d, block_size, layer.window, dtype)

    @staticmethod
    def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0,
                kv_scales: KVScales | None = None, softcap: float = 0.0,
                new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``new_kv``: the step's own K and V [d, kvh, hd], not written to the cache yet (``DEFERRED_KV_WRITES``):
        they take the place of the cache's rows at each request's last position."""
        d = q.shape[0]
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        group = num_heads // num_kv_heads
        block_ids, mask, newest = _derive_decode_plan(meta, d, block_size, window, q.dtype)
        k_scales, v_scales = kv_scales or (None, None)
        keys = _gather_context(k_cache, block_ids, k_scales, q.dtype)  # [d, kvh, L, hd]
        values = _gather_context(v_cache, block_ids, v_scales, q.dtype)
        if new_kv is not None:  # newest: [d, 1, L, 1], True at each request's last position
            keys = torch.where(newest, new_kv[0][:, :, None, :], keys)
            values = torch.where(newest, new_kv[1][:, :, None, :], values)
        # Fold the query heads of one KV head into the query axis: GQA without repeating K/V.
        qg = q.view(d, num_kv_heads, group, head_dim)  # [d, kvh, group, hd]
        o = _attend(qg, keys, values, mask, scale, softcap)
        return o.reshape(d, num_heads, head_dim)

    @staticmethod
    def _prefill(q, k_cache, v_cache, block_table, seq_len: int, scale: float, window: int = 0,
                 kv_scales: KVScales | None = None, softcap: float = 0.0) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        group = num_heads // num_kv_heads
        nb = (seq_len + block_size - 1) // block_size
        k_scales, v_scales = kv_scales or (None, None)
        keys = _gather_context(k_cache, block_table[None, :nb], k_scales, q.dtype)[0, :, :seq_len]  # [kvh, L, hd]
        values = _gather_context(v_cache, block_table[None, :nb], v_scales, q.dtype)[0, :, :seq_len]
        if seq_len == n and not window and not softcap:
            # No cached context: plain causal attention, with no mask to build.
            qh = q.transpose(0, 1)  # [H, n, hd]
            keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=scale)
            return o.transpose(0, 1)
        # New token t sits at position seq_len - n + t and sees keys up to that position.
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [n, L]
        if window:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        qg = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
        o = _attend(qg, keys, values, mask.repeat(group, 1), scale, softcap)
        return o.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


def _none() -> None:
    return None


def _derive_decode_plan(meta: AttentionMetadata, d: int, block_size: int, window: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_decode_plan``, made by the step's first layer that needs it (``d`` is the step's ``num_decodes``)."""
    return meta.derive(("torch:decode", block_size, window, dtype),
                       lambda: _decode_plan(meta, d, block_size, window, dtype))


def _decode_plan(meta: AttentionMetadata, d: int, block_size: int, window: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``d`` (decode) requests' block ids [d, nb] (int64), additive mask [d, 1, 1, nb * block_size] over
    their padded contexts, and where each one's newest token sits, [d, 1, nb * block_size, 1] boolean: the same for
    every layer of a step with the same window."""
    max_len = int(meta.seq_lens_cpu[:d].max())
    nb = (max_len + block_size - 1) // block_size
    block_ids = meta.block_tables[:d, :nb].long()
    positions = torch.arange(nb * block_size, device=block_ids.device)
    beyond = positions[None, :] >= meta.seq_lens[:d, None]  # [d, L]: padding past each context
    if window:  # and keys that slid out of the window of the query (at seq_len - 1)
        beyond |= positions[None, :] < meta.seq_lens[:d, None] - window
    # An additive mask: SDPA's CPU kernel takes it without converting a boolean one per call.
    mask = torch.zeros(beyond.shape, dtype=dtype, device=block_ids.device).masked_fill_(beyond, float("-inf"))
    newest = positions[None, :] == meta.seq_lens[:d, None] - 1
    return block_ids, mask[:, None, None, :], newest[:, None, :, None]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v (``mask``: additive, or boolean with True where a key is seen), with the
    scores soft-capped first when ``softcap`` (which SDPA cannot do), as transformers' eager attention caps them."""
    if not softcap:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap + mask
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(weights, values)
