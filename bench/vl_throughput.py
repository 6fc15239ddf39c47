"""Images and text on a GPU: Qwen2.5-VL-7B's shape with dummy weights, against the same requests as text only.

    python bench/vl_throughput.py --tokenizer PATH [--requests 64] [--output-len 128]

Each request is a short text, one image, and a question; images cycle through 448x448, 336x504 and 672x672
pixels (256, 216 and 576 tokens after the 2x2 merger). The same engine then serves the same requests with each
image's tokens replaced by as many text tokens, so the difference is what the images cost: the processor on the
host, the vision tower on the GPU, the encoder cache and the mixed steps. Also reported: the vision tower's time
per image (CUDA events around ``encode_images``, one image at a time and eight at once) and the HF processor's
host time per image. The tokenizer is any Hugging Face tokenizer folder (the default model's will do); the
vision tokens are added to it, and its ids all fall inside Qwen2.5-VL's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_throughput import step_summary  # noqa: E402
from offline_throughput import git_commit  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

IMAGE_SIZES = ((448, 448), (336, 504), (672, 672))
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def write_shape(path: Path, tokenizer_path: str) -> dict[str, int]:
    """Qwen2.5-VL-7B-Instruct's config (no weights), an image processor and the tokenizer; returns the vision ids."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    start, end, pad, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31],
                  hidden_act="silu", in_chans=3)
    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6})
    config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=pad,
                                           video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
                                           architectures=["Qwen2_5_VLForConditionalGeneration"], dtype="bfloat16")
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image_processor = getattr(transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor)
    image_processor().save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    return {"start": start, "end": end, "pad": pad}


def make_requests(n: int, ids: dict[str, int], text_vocab: int, seed: int = 0):
    """(token ids with one image placeholder, the image, the same prompt with the image as plain text tokens)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        height, width = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        before = rng.integers(0, text_vocab, int(rng.integers(20, 60))).tolist()
        after = rng.integers(0, text_vocab, int(rng.integers(10, 40))).tolist()
        image_tokens = (height // 28) * (width // 28)
        text_only = before + rng.integers(0, text_vocab, image_tokens + 2).tolist() + after
        out.append((before + [ids["start"], ids["pad"], ids["end"]] + after, image, text_only))
    return out


def time_encoder(llm: LLM, requests) -> dict:
    """The vision tower's time per image, by size: one image at a time, and eight of one size at once."""
    model, processor = llm.engine.runner.model, llm._images()
    device, dtype = llm.engine.runner.device, llm.engine.runner.dtype
    out = {}
    for height, width in IMAGE_SIZES:
        image = next(img for _, img, _ in requests if img.size == (width, height))
        _, mm = processor.process_token_ids([processor.image_token_id], [image])
        pixels = torch.from_numpy(mm[0].pixel_values.to_numpy()).to(device, dtype)
        grid = torch.tensor([mm[0].grid_thw], device=device)
        result = {"tokens": mm[0].length, "patches": int(pixels.shape[0])}
        for batch in (1, 8):
            many, grids = pixels.repeat(batch, 1), grid.repeat(batch, 1)
            with torch.inference_mode():
                for _ in range(3):
                    model.encode_images(many, grids)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    model.encode_images(many, grids)
                end.record()
                end.synchronize()
            result[f"ms_per_image_batch{batch}"] = start.elapsed_time(end) / 10 / batch
        out[f"{height}x{width}"] = result
    return out


def time_processor(llm: LLM, requests) -> float:
    """The HF processor's host time per image (resize, normalize, patchify), in ms."""
    processor = llm._images()
    start = time.perf_counter()
    for ids, image, _ in requests:
        processor.process_token_ids(ids, [image])
    return (time.perf_counter() - start) / len(requests) * 1e3


def run(llm: LLM, prompts, output_len: int, label: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.engine.measure_steps(True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    before = llm.engine.stats().num_preemptions
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.stats()
    return {"name": label, "elapsed_s": elapsed, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tok_s": (prompt_tokens + output_tokens) / elapsed, "output_tok_s": output_tokens / elapsed,
            "requests_s": len(outputs) / elapsed, "preemptions": stats.num_preemptions - before, "steps": step_summary(llm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--out", default=str(Path(__file__).parent / "out" / "gpu_vl_throughput.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="minivllm-qwen2.5-vl-7b-") as tmp:
        ids = write_shape(Path(tmp), args.tokenizer)
        llm = LLM(tmp, load_format="dummy", max_model_len=4096, max_num_batched_tokens=args.max_num_batched_tokens)
        text_vocab = min(ids.values())  # the tokenizer's own ids, below the added vision tokens
        requests = make_requests(args.requests, ids, text_vocab)
        warm = make_requests(4, ids, text_vocab, seed=1)
        llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": [img]}} for p, img, _ in warm],
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        encoder = time_encoder(llm, requests)
        for size, e in encoder.items():
            print(f"vision tower {size}: {e['ms_per_image_batch1']:.2f} ms/image alone, "
                  f"{e['ms_per_image_batch8']:.2f} ms/image in 8s", flush=True)
        processor_ms = time_processor(llm, requests)
        with_images = run(llm, [{"prompt_token_ids": p, "multi_modal_data": {"image": [img]}} for p, img, _ in requests],
                          args.output_len, "images + text")
        text_only = run(llm, [{"prompt_token_ids": t} for _, _, t in requests], args.output_len, "text only")

    result = {"commit": git_commit(), "device": torch.cuda.get_device_name(), "shape": "qwen2.5-vl-7b",
              "requests": args.requests, "output_len": args.output_len, "image_sizes": IMAGE_SIZES,
              "encoder": encoder, "processor_ms_per_image": processor_ms, "runs": [with_images, text_only]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nqwen2.5-vl-7b shape, {args.requests} requests x 1 image + text, {args.output_len} output tokens each, "
          f"on {result['device']}, commit {result['commit']}")
    for size, e in encoder.items():
        print(f"  vision tower {size} ({e['tokens']} tokens, {e['patches']} patches): "
              f"{e['ms_per_image_batch1']:.2f} ms/image alone, {e['ms_per_image_batch8']:.2f} ms/image in 8s")
    print(f"  HF processor on the host: {processor_ms:.1f} ms/image")
    for r in (with_images, text_only):
        print(f"  {r['name']}: {r['total_tok_s']:,.0f} tok/s in+out ({r['output_tok_s']:,.0f} out), "
              f"{r['requests_s']:.1f} req/s, {r['elapsed_s']:.2f} s, prompt tokens {r['prompt_tokens']}, "
              f"preemptions {r['preemptions']}")
        for kind, s in r["steps"].items():
            print(f"    {kind}: {s['steps']} steps, median device {s['device_ms_median']:.2f} ms, "
                  f"wall {s['wall_ms_median']:.2f} ms, mean batch {s['mean_batch']:.0f}")
    print(f"  images + text vs text only: {with_images['total_tok_s'] / text_only['total_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
