"""The physical floor of a throughput workload on this device, from ceilings measured in the same run.

With every request resident from the start, a decode step must at least read the
weights once plus the KV of every active request (bandwidth-bound), and prefill must at
least do the matmul FLOPs of every prompt token (compute-bound). The sum of those times
over the workload is the fastest any engine could finish it.

Mixture-of-experts models read only the experts their tokens are routed to: a decode step of B tokens,
each sent to k of E experts, reads an expected 1 - (1 - k/E)^B of every sparse layer's experts (routing
taken as uniform, as it is with dummy weights), from a few experts at batch 1 to all of them at large
batches; prefill multiplies each token by its k experts only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Ceilings:
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written
    matmul_flops_per_s: float  # large bf16 matmul on random data
    fp8_matmul_flops_per_s: float | None = None  # large FP8 matmul, where measured


def cuda_time(fn, reps: int = 50, warmup: int = 5) -> float:
    """Seconds per call of ``fn`` on the current CUDA stream: ``reps`` calls between two events, after ``warmup``.
    Calls launched faster than the GPU runs them measure the GPU; slower ones, the host's launches."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def graph_time(fn, calls: int = 20) -> float:
    """Seconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls: the GPU's time, not the host's."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time(graph.replay, reps=20) / calls


def measure_ceilings(device: torch.device, copy_gib: float = 4.0, n: int = 8192) -> Ceilings:
    def timed(fn, reps: int) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return float(np.median(times))

    src = torch.randn(int(copy_gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), 10)
    bandwidth = 2 * src.numel() * src.element_size() / copy_s
    del src, dst
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    mm_s = timed(lambda: a @ b, 10)
    return Ceilings(bandwidth, 2 * n**3 / mm_s)


@dataclass
class ModelCosts:
    weight_bytes: int  # every parameter, read once per decode step
    matmul_params: int  # parameters that multiply each prompt token: all but the embedding and the LM head
    kv_bytes_per_token: int
    attn_flops_per_pair: int  # FLOPs per (query, key) pair over all layers: QK^T and PV
    expert_bytes: int = 0  # of weight_bytes, the experts of the sparse layers (read as tokens are routed)
    num_experts: int = 0
    top_k: int = 0

    def step_weight_bytes(self, num_tokens: int) -> float:
        """Weight bytes a decode step of ``num_tokens`` reads: all dense weights, the experts it routes to."""
        if not self.expert_bytes:
            return self.weight_bytes
        hit = 1 - (1 - self.top_k / self.num_experts) ** num_tokens
        return self.weight_bytes - self.expert_bytes + self.expert_bytes * hit


def model_costs(model: torch.nn.Module, config, kv_bytes_per_token: int | None = None) -> ModelCosts:
    """Costs of the loaded model: its parameters as stored (FP8 weights at a byte each, int4 at half a byte, int8 at
    one, plus their scales and zeros), and ``kv_bytes_per_token`` (default: K and V in the embedding's dtype)."""
    params = list(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    embed = model.model.embed_tokens.weight.numel()
    tied = config.tie_word_embeddings
    named = list(model.named_parameters())
    scales = sum(p.numel() for name, p in named if name.endswith(("weight_scale_inv", ".scales", ".zeros")))
    packed = sum(p.numel() for name, p in named if name.endswith(".qweight") and p.dtype == torch.uint8)  # 2 a byte
    matmul_params = sum(p.numel() for p in params) - scales + packed - (0 if tied else embed)
    elem = model.model.embed_tokens.weight.element_size()
    kv = kv_bytes_per_token or 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem
    attn = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    experts = [p for name, p in model.named_parameters() if ".experts." in name]
    moe = getattr(config, "moe", None)
    if experts and moe is not None:  # a token multiplies k of the E experts
        expert_params = sum(p.numel() for p in experts)
        matmul_params -= expert_params - expert_params * moe.top_k // moe.num_experts
        return ModelCosts(weight_bytes, matmul_params - config.vocab_size * config.hidden_size, kv, attn,
                          sum(p.numel() * p.element_size() for p in experts), moe.num_experts, moe.top_k)
    return ModelCosts(weight_bytes, matmul_params - config.vocab_size * config.hidden_size, kv, attn)


def full_model_costs(config, elem: int = 2) -> ModelCosts:
    """``model_costs`` from the config alone: the whole model, whatever share of it one rank holds."""
    h, layers, hd = config.hidden_size, config.num_hidden_layers, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size + 2 * h
    body = layers * per_layer + h  # what multiplies every prompt token (the LM head is counted per prompt)
    params = body + config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return ModelCosts(params * elem, body, 2 * layers * kv * elem, 4 * layers * config.num_attention_heads * hd)


def roofline(prompt_lens: list[int], output_lens: list[int], costs: ModelCosts, ceil: Ceilings,
             vocab: int, hidden: int, num_gpus: int = 1, kv_share: float | None = None,
             all_reduce_s=None, num_all_reduces: int = 0, matmul_flops_per_s: float | None = None) -> dict:
    """Lower bound on the time of the workload, and the output tokens/s it allows.

    On ``num_gpus`` (tensor parallelism) each GPU reads its share of the weights and of the KV
    (``kv_share``: the fraction of KV heads one GPU holds, more than 1/num_gpus when they are
    replicated) and does its share of the FLOPs, at the ceilings measured on one; each decode step also
    pays ``num_all_reduces`` all-reduces of [batch, hidden] (``all_reduce_s(batch)``, measured).
    ``matmul_flops_per_s`` replaces the bf16 rate for prefill (FP8 weights: the FP8 rate).
    """
    p = np.asarray(prompt_lens, dtype=np.float64)
    o = np.asarray(output_lens, dtype=np.float64)
    kv_share = 1.0 / num_gpus if kv_share is None else kv_share
    # Prefill: every prompt token through the matmuls, causal attention, logits of the last token.
    prefill_flops = (2 * costs.matmul_params * p.sum() + costs.attn_flops_per_pair * (p * (p + 1) / 2).sum()
                     + 2 * vocab * hidden * len(p))
    prefill_s = prefill_flops / num_gpus / (matmul_flops_per_s or ceil.matmul_flops_per_s)
    # Decode step s (1-based) serves the requests with more than s output tokens; each reads its whole KV.
    decode_s = comm_s = 0.0
    for step in range(1, int(o.max())):
        active = o > step
        kv_tokens = (p[active] + step).sum()
        decode_s += (costs.step_weight_bytes(int(active.sum())) / num_gpus
                     + kv_tokens * costs.kv_bytes_per_token * kv_share) / ceil.copy_bytes_per_s
        if all_reduce_s is not None:
            comm_s += num_all_reduces * all_reduce_s(int(active.sum()))
    total_s = prefill_s + decode_s + comm_s
    return {"prefill_s": prefill_s, "decode_s": decode_s, "all_reduce_s": comm_s, "total_s": total_s,
            "tok_s": o.sum() / total_s, "num_gpus": num_gpus}
