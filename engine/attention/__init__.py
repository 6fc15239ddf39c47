"""Attention: the layer (``layer.py``), its per-step metadata, and the backends that read K/V through the block
table: the torch reference (everywhere) and the Triton kernels (CUDA)."""


def make_attention_backend(name: str):
    """The backend ``name`` names: "torch" or "triton" (imported only when asked for)."""
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from engine.config import ConfigError

    raise ConfigError(f"unknown attention backend {name!r}")
