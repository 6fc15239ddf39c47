"""Paged attention on the GPU with the Triton kernels: same interface and results as the torch backend."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.models.fp8 import ACTIVATION_GROUP
from engine.ops.attention import PagedAttention, compile_variants, compile_write_variants
from engine.ops.fp8 import empty_quantized


class TritonAttentionBackend:
    """Decode rows go to the flash-decoding kernel, the rest of the batch to the varlen prefill kernel.

    Each attention layer binds its cache once (``bind``: a ``PagedAttention``, which checks the cache and the
    layer's configuration then); a step's launches check nothing more. No host syncs: launch choices come from the
    metadata's host ints and from tensor shapes only, so a decode-only step can be captured in a CUDA graph and
    replayed with new sequence lengths.
    """

    name = "triton"

    def bind(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, scale: float,
             kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, window: int = 0, softcap: float = 0.0,
             rope=None) -> PagedAttention:
        """The kernels bound to one layer's cache: its heads, ``scale``, sliding ``window`` (0: none), ``softcap``
        (0: none) and ``rope`` (``engine.models.rotary.PendingRope``, whose tables are checked here), all checked
        once; raises ValueError on what the kernels cannot take."""
        return PagedAttention(k_cache, v_cache, num_heads, scale, kv_scales, window, softcap, rope)

    def forward(
        self,
        attention: PagedAttention,  # ``bind``'s
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        meta: AttentionMetadata,
        fp8_out: bool = False,  # the next projection takes its input quantized (see below)
        rope=None,  # the rope q and k still need (``engine.models.rotary.PendingRope``), or None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, num_heads, head_dim]
        """The attention output. With a ``rope``, q and k are roped (and q|k|v's column scales applied) as K and V are
        written to the cache (``write_paged_kv``: one launch on a 16-bit cache, the rope kernel and the write on an
        FP8 one); the attention kernels read the q it returns. With ``fp8_out``, on a decode-only step whose
        contexts are split (a few dozen rows or fewer) and whose heads are as wide as an FP8 projection's activation
        group (128), the output quantized by the decode kernels' merge as that projection takes it: (float8 values
        [rows padded to 4, num_heads * head_dim], float32 scales, one per token and head, token-major;
        ``fp8_kernels.empty_quantized``'s cuBLAS layout). Other steps return the plain output: unsplit, quantizing
        in the decode kernel was slower than the projection's own pass (bench/RESULTS.md)."""
        num_tokens = meta.slot_mapping.shape[0]
        if meta.decode_seq_lens is not None:
            return self._mixed_graph_step(attention, q, k, v, meta, rope)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # K (roped) and V into the cache, and the queries to attend with: roped and, as an FP8 cache holds K
        # rotated, rotated alike (kvcache.paged_cache).
        q = attention.write(k, v, meta.slot_mapping, q, rope)
        d = meta.num_decodes
        quantized = None
        if d > 0:
            num_splits = attention.num_splits(d, meta.block_tables.shape[1])
            if fp8_out and num_splits > 1 and _quantizes_output(q, meta, num_tokens):
                quantized = empty_quantized(num_tokens, q.shape[1] * q.shape[2], q.shape[2], q.device,
                                            cublas_layout=True)
            attention.decode(q[:d], meta.block_tables[:d], meta.seq_lens[:d], out[:d], num_splits, quantized)
        if meta.num_reqs > d:
            # Decode rows come first, one token each, so the prefill tokens start at row d.
            n = meta.num_reqs
            attention.prefill(q[d:num_tokens], meta.block_tables[d:n], meta.query_start_loc[d:n + 1],
                              meta.seq_lens[d:n], meta.max_query_len, out[d:num_tokens])
        if num_tokens < q.shape[0]:
            out[num_tokens:].zero_()  # padding rows beyond the batch: finite, like a seq_len 0 row
        return out if quantized is None else quantized  # ``out`` then only gave the rounding dtype

    @staticmethod
    def _mixed_graph_step(attention: PagedAttention, q, k, v, meta: AttentionMetadata, rope) -> torch.Tensor:
        """A step whose rows are only known on the device (``meta.decode_seq_lens``, a mixed step's CUDA graph):
        the decode kernel over every row, a row that is not a decode having length 0 there (so its output row, which
        is then some prefill token's, gets zeros); then the prefill kernel over every request but the decodes,
        which writes those rows. Rows of padding tokens stay zero."""
        n = meta.num_reqs
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        q = attention.write(k, v, meta.slot_mapping, q, rope)
        num_splits = attention.num_splits(n, meta.block_tables.shape[1])
        attention.decode(q[:n], meta.block_tables, meta.decode_seq_lens, out[:n], num_splits)
        attention.prefill(q, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len, out,
                          skip_single=True)
        return out

    def warm_up(self, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, max_query_len: int, windows: tuple[int, ...] = (0,),
                kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, dtype: torch.dtype | None = None,
                softcap: float = 0.0, fp8_out: bool = False, rope=None, column_scales: bool = False) -> int:
        """Compile the kernels' variants before the first step (see ``compile_variants``), for each of the
        model's attention windows (0: none); ``dtype`` is the compute dtype (an FP8 cache's is not);
        ``fp8_out``: the decode kernels' quantized outputs too (``forward``'s ``fp8_out``). The KV-cache write's
        too (``compile_write_variants``): with the layers' ``rope`` (``Attention.rope``), and with ``column_scales``
        (FP8 q|k|v products that may leave their column scales to it) also with those. These run through the
        checked one-shot functions: the block-table buffer and the dtype of the steps to come are checked here."""
        fp8_out = fp8_out and k_cache.shape[3] == ACTIVATION_GROUP
        variants = sum(compile_variants(num_heads, k_cache, v_cache, block_tables, max_query_len, w, kv_scales,
                                        dtype, softcap, fp8_out) for w in windows)
        return variants + compile_write_variants(num_heads, k_cache, v_cache, max_query_len, kv_scales, dtype, rope,
                                                 column_scales)


def _quantizes_output(q: torch.Tensor, meta: AttentionMetadata, num_tokens: int) -> bool:
    """Whether the decode kernels can write this step's output quantized: decode rows only (no padding beyond
    them), each head one of the projection's activation groups."""
    return q.shape[2] == ACTIVATION_GROUP and meta.num_decodes == meta.num_reqs == num_tokens == q.shape[0]
