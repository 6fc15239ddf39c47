"""The peer in every throughput benchmark: transformers' own continuous batching."""

from __future__ import annotations

import time


def run_transformers_cb(model, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """transformers continuous batching (the ``generate_batch`` machinery) with per-request
    ``max_new_tokens`` and EOS off, timed from the first request to the last result."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(output_lens), eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        num_out, done = 0, 0
        while done < len(prompts):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers' continuous batching stopped before finishing")
            if result.is_finished():
                done += 1
                num_out += len(result.generated_tokens)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return {"name": "transformers-cb", "requests": len(prompts), "elapsed_s": elapsed, "output_tokens": num_out,
            "tok_s": num_out / elapsed}
