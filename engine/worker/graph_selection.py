"""Which captured CUDA graph a step replays, and the sizes it is padded to (``StepShape``).

    decode-only step of n rows, n <= the largest captured batch  ->  decode graph of the next size up (rows padded)
    else t tokens, t <= the largest captured token count          ->  mixed-step graph of the next count up
                                                                      (tokens and rows padded)
    else, or with images or prompt logprobs                       ->  eager (no padding)

A speculative step's verification (each sampled row's 1 + k last tokens go through the LM head) is a mixed step
whose LM head takes more rows than it has requests: it replays a mixed-step graph when those rows fit the graph's
gathered rows (``MixedGraphs.rows``), and runs eagerly otherwise.

Padding rows and tokens are filled by ``StepInputPreparer`` so that they change nothing that is read.
"""

from __future__ import annotations

from engine.worker.cuda_graphs import DecodeGraphs, MixedGraphs
from engine.worker.step_channel import StepShape


def select_step_shape(decode_graphs: DecodeGraphs | None, mixed_graphs: MixedGraphs | None, eager: bool,
                      num_reqs: int, num_decodes: int, num_tokens: int, num_sampled: int, width: int,
                      max_query_len: int, max_seq_len: int, num_verified: int = 0) -> StepShape:
    """The step's shape: the graph it replays (none when ``eager``, or when none fits) and its padded sizes.
    ``num_verified``: a verification step's LM-head rows (its sampled rows' last 1 + k tokens); 0 in other steps."""
    graph_size = mixed_size = 0
    if not eager:
        if decode_graphs is not None and num_decodes == num_reqs:
            graph_size = decode_graphs.padded_size(num_reqs) or 0
        if not graph_size and mixed_graphs is not None:
            mixed_size = mixed_graphs.padded_size(num_tokens) or 0
            if mixed_size and num_verified > mixed_graphs.rows(mixed_size):
                mixed_size = 0
    if mixed_size:
        padded, padded_tokens = mixed_graphs.rows(mixed_size), mixed_size
    else:
        padded, padded_tokens = graph_size or num_reqs, graph_size or num_tokens
    # A mixed-step graph gathers its padded rows (its LM head takes the first num_sampled: the verified positions in
    # a verification step); otherwise the sampled rows (or the verified positions) are the logits read.
    num_logits = padded if mixed_size else num_verified or num_sampled
    return StepShape(num_reqs, num_decodes, padded, padded_tokens, width, graph_size, mixed_size, max_query_len,
                     max_seq_len, num_logits, num_verified if mixed_size and num_verified else num_sampled)
