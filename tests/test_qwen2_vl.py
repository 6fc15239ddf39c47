"""Qwen2.5-VL (transformers' vision tower with window attention and the patch merger, the project's Qwen2 with
M-RoPE) through the image path, against transformers in float32: the M-RoPE positions against ``get_rope_index``,
prefill logits with one image and with two of different sizes, greedy tokens of concurrent prompts with chunked
prefill cutting through images and a prefix hit ending inside one, the M-RoPE Triton kernel, and images with
their patch grids crossing the process boundary.

The checkpoint is a tiny random Qwen2.5-VL (vision: 2 blocks, the second one full attention, the first in
windows of 2 x 2 merged tokens; 14 x 14 patches merged 2 x 2, so a 56 x 56 image is 4 tokens and 112 x 140 is
20) with the Qwen2-VL image processor and the default model's tokenizer plus the vision tokens.
"""

from __future__ import annotations

import json
import os

import msgspec
import numpy as np
import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.core.llm_engine import check_tensor_parallel
from engine.core.process import AddRequests, CoreRequest, input_decoder, make_encoder
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from engine.loading.model_info import RequestError
from engine.loading.mrope import mrope_positions
from engine.loading.multimodal import MultiModalProcessor
from engine.models.norm import RMSNorm
from engine.models.rotary import get_rope
from tests.helpers import PagedRunner, record_image_cuts, spread_weights
from tests.helpers import random_image as image

VISION = "<|vision_start|><|image_pad|><|vision_end|>"
MROPE_SECTION = [2, 3, 3]  # head_dim 16: 8 rotary frequencies
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # four of these overfill the pool


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the model is tiny, and a second thread only waits for the first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_tiny_qwen2_vl(path, tokenizer_path, **text_overrides):
    """A tiny random Qwen2.5-VL checkpoint in ``path`` with its processor's parts (the image processor, the
    tokenizer at ``tokenizer_path`` plus the vision tokens, a chat template that knows image parts);
    ``text_overrides`` change the language model's config (head_dim 16 unless they say otherwise)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    vision_tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision_tokens})
    start, end, pad, video = tokenizer.convert_tokens_to_ids(vision_tokens)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=56, out_hidden_size=64, fullatt_block_indexes=[1])
    text = dict(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                rope_parameters={"rope_type": "default", "mrope_section": MROPE_SECTION, "rope_theta": 10000.0})
    text.update(text_overrides)
    vision["out_hidden_size"] = text["hidden_size"]  # the merger writes the language model's embeddings
    config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=pad,
                                           video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    spread_weights(model)
    model.save_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    # transformers 5.2x has a PIL image processor beside the torchvision one; older releases only the one.
    image_processor = getattr(transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor)
    image_processor(min_pixels=28 * 28, max_pixels=28 * 28 * 64).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, default_model_path):
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), default_model_path)


@pytest.fixture(scope="module")
def hf_model(qwen_dir):
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(qwen_dir):
    """Chunks of 24 tokens (images cut through now and then), prefix caching, and a pool of 20 blocks of 8 tokens,
    too small for four requests of ~60 tokens at once: some are preempted and recomputed (images re-encoded,
    their M-RoPE tables back in the batch)."""
    return LLM(str(qwen_dir), max_model_len=96, num_kvcache_blocks=20, kvcache_block_size=8, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def processor(qwen_dir):
    config = ModelConfig.from_pretrained(qwen_dir)
    return MultiModalProcessor.from_pretrained(qwen_dir, config.multimodal.image_token_id)


def hf_inputs(processor: MultiModalProcessor, text: str, images: list) -> dict:
    """The HF processor's tensors (ids, patches, grids, token types), as transformers' model takes them."""
    return processor.hf(text=text, images=images, return_tensors="pt")


def hf_greedy(hf_model, processor, text: str, images: list, max_new_tokens: int) -> list[int]:
    inputs = hf_inputs(processor, text, images)
    out = hf_model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


# ----------------------------------------------------------------------------------------------- the model


@pytest.mark.parametrize("sizes", [[(84, 112)], [(84, 112), (56, 56)]], ids=["one-image", "two-image-sizes"])
def test_prefill_logits_match_transformers(qwen_dir, hf_model, processor, sizes):
    """The M-RoPE positions are transformers' ``get_rope_index``; the prompt in two chunks, the first ending inside
    the first image, gives transformers' logits."""
    pictures = [image(i, h, w) for i, (h, w) in enumerate(sizes)]
    text = "look at " + " and ".join(VISION for _ in pictures) + " what do you see?"
    ids, mm = processor.process_text(text, pictures)
    assert [m.grid_thw for m in mm] == [(1, h // 14, w // 14) for h, w in sizes]
    inputs = hf_inputs(processor, text, pictures)
    assert inputs["input_ids"][0].tolist() == ids
    expected_positions, expected_delta = hf_model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                                       inputs["image_grid_thw"])
    positions = mrope_positions(mm, spatial_merge_size=2)
    assert positions.end == mm[-1].end and positions.delta == int(expected_delta) < 0
    np.testing.assert_array_equal(positions.positions(len(ids)), expected_positions[:, 0].numpy())
    with torch.no_grad():
        expected = hf_model(**inputs).logits[0]

    model = load_model(ModelConfig.from_pretrained(qwen_dir), torch.float32, "cpu")
    assert [model.num_image_tokens(m.pixel_values.shape, m.grid_thw) for m in mm] == [m.length for m in mm]
    with torch.no_grad():
        pixels = torch.from_numpy(np.concatenate([m.pixel_values.to_numpy() for m in mm]))
        embeds = model.encode_images(pixels, torch.tensor([m.grid_thw for m in mm]))
        image_rows = torch.tensor([i for i, t in enumerate(ids) if t == model.mm.image_token_id])
        full = model.embed_input_ids(torch.tensor(ids), image_rows, torch.cat(embeds))
    rope = torch.from_numpy(positions.positions(len(ids)))
    cut = mm[0].offset + mm[0].length // 2
    runner = PagedRunner(model, block_size=8, max_blocks_per_req=32)
    first = runner.step([(0, ids[:cut])], inputs_embeds=full[:cut], positions=rope[:, :cut])
    second = runner.step([(0, ids[cut:])], inputs_embeds=full[cut:], positions=rope[:, cut:])
    torch.testing.assert_close(torch.cat([first[0], second[0]]), expected, atol=1e-5, rtol=1e-5)


def test_config(qwen_dir):
    config = ModelConfig.from_pretrained(qwen_dir)
    assert config.architecture == "Qwen2_5_VLForConditionalGeneration" and config.model_type == "qwen2_5_vl_text"
    assert config.mrope_section == tuple(MROPE_SECTION) and config.attention_bias and config.rope_scaling is None
    assert config.multimodal.model_type == "qwen2_5_vl" and config.multimodal.spatial_merge_size == 2
    with pytest.raises(ConfigError, match="tensor parallelism does not split its vision encoder"):
        check_tensor_parallel(config, 2)


@pytest.mark.parametrize("with_norm", [False, True], ids=["rope", "qk_norm_rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_mrope_kernel_matches_torch_and_transformers(dtype, with_norm):
    """The Triton rope kernel with three position rows (strided, as the step buffers hold them) against the torch
    path, and the torch path against transformers' Qwen2.5-VL rotary embedding; three equal rows (text) rotate
    as the one-position rope does."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding, apply_rotary_pos_emb

    from engine.ops import fused as fused_ops

    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    section, head_dim = (4, 6, 6), 32
    rope = get_rope(head_dim, 256, 1e4, None, section).to(device)
    rope.use_triton = False
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 256, (3, 24), generator=gen)[:, ::3].to(device)  # rows 24 apart, tokens 3 apart
    q = (torch.randn(8, 4, head_dim + 8, generator=gen)[..., 8:]).to(device, dtype)  # strided heads
    k = torch.randn(8, 2, head_dim, generator=gen).to(device, dtype)
    if with_norm:
        norms = [RMSNorm(head_dim, 1e-6).to(device, dtype) for _ in range(2)]
        for norm in norms:
            norm.weight.data.copy_(torch.rand(head_dim, generator=gen) + 0.5)
            norm.use_triton = False
        got = fused_ops.qk_norm_rotary(positions, q, k, norms[0].weight, norms[1].weight, 1e-6, rope.cos_sin_cache,
                                       section)
        ref = rope(positions, q, k, *norms)
    else:
        got = fused_ops.rotary(positions, q, k, rope.cos_sin_cache, section)
        ref = rope(positions, q, k)
        text = fused_ops.rotary(positions[1].expand(3, -1), q, k, rope.cos_sin_cache, section)
        for g, r in zip(text, fused_ops.rotary(positions[1], q, k, rope.cos_sin_cache)):
            torch.testing.assert_close(g, r, atol=0, rtol=0)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **tol)
    text_config = transformers.Qwen2_5_VLTextConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "mrope_section": list(section), "rope_theta": 1e4})
    q32, k32 = q.float(), k.float()
    cos, sin = Qwen2_5_VLRotaryEmbedding(text_config).to(device)(q32, positions[:, None, :])  # [1, tokens, head_dim]
    hf_q, hf_k = apply_rotary_pos_emb(q32.transpose(0, 1)[None], k32.transpose(0, 1)[None], cos, sin)
    for g, r in zip(rope(positions, q32, k32), (hf_q[0].transpose(0, 1), hf_k[0].transpose(0, 1))):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="mrope_section"):
        fused_ops.rotary(positions, q, k, rope.cos_sin_cache, (4, 6, 5))
    with pytest.raises(ValueError, match="M-RoPE positions"):
        fused_ops.rotary(positions[0], q, k, rope.cos_sin_cache, section)


# --------------------------------------------------------------------------------------------- the engine


def test_greedy_tokens_equal_generate(llm, hf_model, processor, monkeypatch):
    """4 prompts at once, with decodes long enough that the tokens after the images (index + delta) matter: chunks
    of 24 tokens cut through images, the second prompt repeats the first (a prefix hit ending inside its image),
    the third has two images of different sizes, and the pool is too small for all four (preempted requests are
    recomputed: their images re-encoded, their M-RoPE tables back); nothing is left in the KV pool or the encoder
    cache."""
    prompts = [
        (f"see {VISION}", [image(0, 112, 140)]),
        (f"see {VISION}", [image(0, 112, 140)]),
        (f"compare {VISION} with {VISION} now, which one is brighter?", [image(1, 56, 56), image(2, 112, 84)]),
        (f"what is in {VISION}? tell me in many words", [image(3, 56, 84)]),
    ]
    scheduler = llm.engine.scheduler
    monkeypatch.setattr(scheduler, "schedule", scheduler.schedule)  # restored after the test
    cuts = record_image_cuts(scheduler)
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts],
                        LONG, use_tqdm=False)
    assert cuts, "no chunk ended inside an image"
    assert scheduler.num_preemptions_total > 0, "the pool should have been too small for all four at once"
    repeat_image = llm._images().process_text(*prompts[1])[1][0]
    assert repeat_image.offset < outs[1].num_cached_tokens < repeat_image.end
    for (text, images), out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, processor, text, images, LONG.max_tokens)
    engine = llm.engine
    assert engine.kv_manager.get_stats().num_used_blocks == 0 and engine.kv_manager.num_requests == 0
    assert scheduler.encoder_cache.num_entries == 0 and scheduler.encoder_cache.num_used == 0
    assert not engine.runner.encoder_cache and not engine.runner.batch.mm_inputs
    assert not engine.runner.batch.mrope_tables
    engine.check_invariants()
    chat = llm.chat([{"role": "user", "content": [{"type": "image", "image": prompts[3][1][0]},
                                                  {"type": "text", "text": "what is it?"}]}], GREEDY, use_tqdm=False)[0]
    rendered = processor.hf.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": "what is it?"}]}], add_generation_prompt=True, tokenize=False)
    assert chat.outputs[0].token_ids == hf_greedy(hf_model, processor, rendered, prompts[3][1], GREEDY.max_tokens)


# ----------------------------------------------------------------------------------------------- the inputs


def test_images_with_grids_cross_the_process_boundary(llm, processor):
    """Token ids with one image token per image are expanded as the processor expands text; each image keeps its
    patch grid through the engine core's msgspec encoding; the engine refuses pixels that are not their grid's."""
    pictures = [image(40, 56, 84), image(41, 84, 56)]
    ids, mm = processor.process_text(f"one {VISION} two {VISION}", pictures)
    pad = processor.image_token_id
    short = [t for i, t in enumerate(ids) if t != pad or ids[i - 1] != pad]
    assert processor.process_token_ids(short, pictures) == (ids, mm)
    assert [(m.length, m.grid_thw, m.pixel_values.shape) for m in mm] == [(6, (1, 4, 6), (24, 1176)),
                                                                          (6, (1, 6, 4), (24, 1176))]
    frame = make_encoder().encode(AddRequests([CoreRequest("core-0", ids, GREEDY, 0.0, mm)]))
    received = input_decoder().decode(frame).requests[0].mm_inputs
    assert received == mm and received[1].grid_thw == (1, 6, 4)
    for bad, match in ((msgspec.structs.replace(mm[0], grid_thw=None), "patch grid"),
                       (msgspec.structs.replace(mm[0], grid_thw=(1, 4, 4)), "grid of patches is"),
                       (msgspec.structs.replace(mm[0], grid_thw=(1, 3, 8)), "multiples of 2")):
        with pytest.raises(RequestError, match=match):
            llm.engine.add_request("bad", ids, GREEDY, mm_inputs=[bad, mm[1]])
    assert not llm.engine.has_unfinished_requests()


def test_the_server_renders_a_chat_with_the_processors_template(llm, qwen_dir, processor):
    """The server's chat path (its renderer, then the processor on the text) gives the token ids and images that
    ``LLM.chat`` gives, from the processor's chat template, even with a tokenizer that has none."""
    import asyncio
    import base64
    import io

    from server.chat import render_chat_request
    from server.media import MediaLimits
    from server.protocol import ChatMessageParam
    from server.serving import ServedModel, ServingContext
    from server.tokenization import ChatTemplateOptions

    picture = image(50, 84, 56)
    png = io.BytesIO()
    picture.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    question = {"type": "text", "text": "What is this?"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    tokenizer.chat_template = None
    model = ServedModel("qwen", llm.engine.model_info, tokenizer, input_modalities=("text", "image"),
                        image_processor=processor)
    assert model.chat_template == TEMPLATE

    ctx = ServingContext(None, model, None, media=MediaLimits())
    messages = [ChatMessageParam.model_validate({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, question]})]
    rendered = asyncio.run(render_chat_request(ctx, messages, ChatTemplateOptions(), None))
    ids, mm = processor.process_text(rendered.prompt, [i.image for i in rendered.images], False)
    assert (ids, mm) == processor.process_chat([{"role": "user", "content": [{"type": "image", "image": picture},
                                                                             question]}])
    assert mm[0].grid_thw == (1, 6, 4)


def test_vision_attention_stacks_runs_of_one_length():
    """The tower's attention within runs (windows, images): runs of equal length stacked into one call give what
    attending to each run alone gives, in the tokens' order; the cached gather indices serve the next call."""
    from engine.models.qwen2_5_vl import attend_within_runs

    gen = torch.Generator().manual_seed(0)
    lengths = [16, 5, 16, 16, 0, 3, 5, 16]
    bounds = torch.tensor([0] + np.cumsum(lengths).tolist())
    q, k, v = (torch.randn(int(bounds[-1]), 2, 8, generator=gen) for _ in range(3))
    expected = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=0.3).transpose(0, 1)
        for a, b in zip(bounds.tolist(), bounds[1:].tolist())])
    runs = {}
    for _ in range(2):
        torch.testing.assert_close(attend_within_runs(q, k, v, bounds, 0.3, runs), expected, atol=1e-6, rtol=1e-6)
    assert list(runs) == [tuple(bounds.tolist())] and [count for _, count in runs[tuple(bounds.tolist())]] == [4, 2, 1]
