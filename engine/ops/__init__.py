"""The GPU kernels (Triton) that attention and the models call, with their launch helpers.

* ``attention``: paged attention (decode, prefill) and the KV-cache write; ``PagedAttention`` binds them to a
  layer's cache for the attention backend (``engine.attention.triton_backend``).
* ``fused``: the small ops of a decoder layer (RMSNorm, rope, SwiGLU), each one kernel.
* ``fp8``: activation quantization and the scaled FP8 matmul; ``moe``: fused mixture-of-experts GEMMs;
  ``greedy``: the two-pass greedy argmax.
* ``triton_helpers``: the device functions several of them share; ``intmath``: host integer helpers.
"""
