"""A vision-language model (LLaVA: a CLIP tower, the projector, a Llama) through the paged KV path, against
transformers in float32: prefill logits with one and two images, greedy tokens with chunked prefill cutting
through images, prefix caching and preemption; the prefix cache keyed by image content, the encoder cache
freeing what it holds, the requests the engine refuses, and images crossing the process boundary.

The checkpoint is a tiny random LLaVA (CLIP: 32x32 images in 8x8 patches, 16 image tokens each) with a
LLaVA processor around the default model's tokenizer plus an ``<image>`` token.
"""

from __future__ import annotations

import base64
import dataclasses
import io

import msgspec
import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from engine import LLM, SamplingParams
from engine.core.process import AddRequests, CoreRequest, input_decoder, make_encoder
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from engine.loading.model_info import RequestError
from engine.loading.multimodal import MultiModalProcessor, image_content_hash, image_spans
from kvcache.block_pool import hash_block_tokens
from kvcache.manager import KVCacheManager
from tests.helpers import SMALL_CONFIG, PagedRunner, record_image_cuts, spread_weights
from tests.helpers import random_image as image

IMAGE_TOKENS = 16  # (32 / 8)^2 patches; the CLS position is dropped ("default" strategy)
TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: {% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this module: the model is tiny, and with other work on the machine a second thread
    makes each step several times slower (threads waiting for each other), not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, default_model_path):
    path = tmp_path_factory.mktemp("tiny-llava")
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    text = transformers.LlamaConfig(**{**SMALL_CONFIG, "vocab_size": -(-len(tokenizer) // 64) * 64,
                                       "max_position_embeddings": 512})
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    spread_weights(model)
    model.save_pretrained(path)
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                chat_template=TEMPLATE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_model(llava_dir):
    return transformers.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(llava_dir):
    return transformers.AutoProcessor.from_pretrained(llava_dir)


@pytest.fixture(scope="module")
def llm(llava_dir):
    """Chunks of 64 tokens (images cut through now and then), prefix caching, room for a few requests at once."""
    return LLM(str(llava_dir), max_model_len=128, num_kvcache_blocks=48, kvcache_block_size=8,
               max_num_batched_tokens=64)


def hf_greedy(hf_model, processor, prompt: str, images: list, max_new_tokens: int) -> list[int]:
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    out = hf_model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


# ----------------------------------------------------------------------------------------------- the model


@pytest.mark.parametrize("images", [[(40, 60)], [(70, 50), (24, 90)]], ids=["one-image", "two-image-sizes"])
def test_prefill_logits_match_transformers(llava_dir, hf_model, processor, images):
    """The prompt in two chunks, the first ending inside an image: the rest of its embeddings come later."""
    pictures = [image(i, h, w) for i, (h, w) in enumerate(images)]
    prompt = "USER: " + " and ".join("<image>" for _ in pictures) + "\nWhat do you see? ASSISTANT:"
    inputs = processor(text=prompt, images=pictures, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        expected = hf_model(**inputs).logits[0].float()
    model = load_model(ModelConfig.from_pretrained(llava_dir), torch.float32, "cpu")
    assert model.num_image_tokens((3, 32, 32)) == IMAGE_TOKENS
    with torch.no_grad():
        embeds = model.encode_images(inputs["pixel_values"])  # [images, 16, hidden]
        image_positions = torch.tensor([i for i, t in enumerate(ids) if t == model.mm.image_token_id])
        full = model.embed_input_ids(torch.tensor(ids), image_positions, embeds.flatten(0, 1))
    cut = ids.index(model.mm.image_token_id) + IMAGE_TOKENS // 2
    runner = PagedRunner(model, block_size=8, max_blocks_per_req=32)
    first = runner.step([(0, ids[:cut])], inputs_embeds=full[:cut])
    second = runner.step([(0, ids[cut:])], inputs_embeds=full[cut:])
    torch.testing.assert_close(torch.cat([first[0], second[0]]), expected, atol=1e-5, rtol=1e-5)


def test_config_and_model_info(llava_dir, llm):
    config = ModelConfig.from_pretrained(llava_dir)
    assert config.architecture == "LlavaForConditionalGeneration" and config.model_type == "llama"
    assert config.hidden_size == SMALL_CONFIG["hidden_size"] and config.multimodal.patch_size == 8
    info = llm.engine.model_info
    assert info.accepts_images and info.input_modalities == ("text", "image") and llm.accepts_images
    assert info.image_token_id == config.multimodal.image_token_id


# --------------------------------------------------------------------------------------------- the engine


def test_greedy_tokens_equal_generate(llava_dir, hf_model, processor):
    """4 prompts at once: chunks of 24 tokens cut through images, the encoder encodes at most 24 image tokens a
    step, a prompt repeats another's image (prefix hits), a pool of 21 blocks preempts."""
    a = image(0, 40, 60)
    prompts = [
        ("USER: <image>\nDescribe the picture in a lot of detail please. ASSISTANT:", [a]),
        ("USER: <image>\nDescribe the picture in a lot of detail please. ASSISTANT:", [a]),
        ("USER: <image>\nWhat is here? <image> Compare the two of them. ASSISTANT:",
         [image(1, 70, 50), image(2, 32, 32)]),
        ("USER: <image>\nDescribe the picture in a lot of detail please. ASSISTANT:", [image(3, 50, 50)]),
    ]
    llm = LLM(str(llava_dir), max_model_len=160, num_kvcache_blocks=22, kvcache_block_size=8,
              max_num_batched_tokens=24)
    scheduler = llm.engine.scheduler
    cuts = record_image_cuts(scheduler)
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts],
                        GREEDY, use_tqdm=False)
    assert cuts, "no chunk ended inside an image"
    assert scheduler.num_preemptions_total > 0 and llm.engine.kv_manager.prefix_cache_hits > 0
    for (text, images), out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, processor, text, images, GREEDY.max_tokens)
    assert scheduler.encoder_cache.num_entries == 0 and not llm.engine.runner.encoder_cache


def test_image_blocks_travel_through_the_host_tier(llava_dir, hf_model, processor):
    """The same four prompts with a host tier under the 22-block pool, requests swapped out when preempted: a block
    holding image tokens goes to the host and comes back under a hash that takes its image, so two prompts with the
    same placeholder tokens and other images never share one, and the tokens stay transformers'."""
    a = image(0, 40, 60)
    text = "USER: <image>\nDescribe the picture in a lot of detail please. ASSISTANT:"
    prompts = [(text, [a]), (text, [image(3, 50, 50)]), (text, [a]),
               ("USER: <image>\nWhat is here? <image> Compare the two of them. ASSISTANT:",
                [image(1, 70, 50), image(2, 32, 32)])]
    llm = LLM(str(llava_dir), max_model_len=160, num_kvcache_blocks=22, kvcache_block_size=8,
              max_num_batched_tokens=24, kv_offloading_size_gib=0.01, preemption_mode="swap")
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": images}} for t, images in prompts],
                        GREEDY, use_tqdm=False)
    host = llm.engine.kv_manager.get_stats().host
    assert llm.engine.scheduler.num_preemptions_total > 0 and host.num_blocks_saved > 0
    assert host.num_swapped_in_blocks > 0 and host.num_blocks_loaded > 0
    for (t, images), out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, processor, t, images, GREEDY.max_tokens)
    llm.shutdown()


def test_prefix_cache_is_keyed_by_image_content(llm):
    """Same text, another image: only the blocks before the image are shared. The same image again: every full
    block is, and the image is not encoded again."""
    text = ("USER: here is a picture that I took on my walk yesterday <image>\n"
            "what is in this picture, tell me? ASSISTANT:")
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": image(10, 30, 30)}}, GREEDY, use_tqdm=False)[0]
    ids = first.prompt_token_ids
    offset = ids.index(llm.engine.model_info.image_token_id)
    assert offset >= 8 and first.num_cached_tokens == 0
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": image(11, 30, 30)}}, GREEDY, use_tqdm=False)[0]
    assert other.prompt_token_ids == ids and other.num_cached_tokens == offset // 8 * 8
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    encoded = llm.engine.scheduler.encoder_cache.num_encoded
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": image(10, 30, 30)}}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(ids) - 1) // 8 * 8 > offset + IMAGE_TOKENS
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.scheduler.encoder_cache.num_encoded == encoded  # the KV of its tokens was all there


def test_block_hashes_take_the_images():
    """The KV manager's chained hashes: a block with any of an image's tokens hashes its content key."""
    tokens = [1, 2, 3, 4] + [7] * 8 + [5, 6, 8, 9, 10, 11]  # an image at 4..11: blocks 1 and 2 of 4 tokens
    spans_a, spans_b = ((4, 8, b"a" * 16),), ((4, 8, b"b" * 16),)
    kv = KVCacheManager(32, block_size=4)
    for rid, spans in (("a", spans_a), ("b", spans_b), ("a2", spans_a)):
        assert kv.allocate_slots(rid, tokens, 0, len(tokens), mm_spans=spans) is not None
    hashes = kv._block_hashes
    assert hashes["a"][0] == hashes["b"][0] == hash_block_tokens(None, tokens[:4])  # before the image
    assert hashes["a"][1] == hash_block_tokens(hashes["a"][0], tokens[4:8], [b"a" * 16])
    assert hashes["a"] == hashes["a2"] and len(hashes["a"]) == 4
    assert all(x != y for x, y in zip(hashes["a"][1:], hashes["b"][1:]))  # the image's blocks and all after
    assert kv.get_computed_blocks("c", tokens, mm_spans=spans_b)[1] == 16
    assert kv.get_computed_blocks("d", tokens, mm_spans=((4, 8, b"c" * 16),))[1] == 4
    assert kv.get_computed_blocks("e", tokens)[1] == 4  # no image key: the same tokens are another prefix


def test_encoder_cache_frees_what_it_holds(llm):
    """100 requests over 12 images (some shared, some twice in a prompt), chunks cutting through them: at the end
    the encoder cache is empty on both sides and every KV block is free."""
    pictures = [image(100 + i, 20 + 3 * i, 50 - 2 * i) for i in range(12)]
    prompts = []
    for i in range(100):
        words = " ".join(["word"] * (i % 7))
        if i % 5 == 0:
            images = [pictures[i % 12], pictures[(i + 1) % 12], pictures[i % 12]]
            text = f"USER: <image> {words} <image> and <image> ASSISTANT:"
        else:
            images = [pictures[i % 12]]
            text = f"USER: {words} <image>\nrequest {i} ASSISTANT:"
        prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == 2 for out in outs)
    engine = llm.engine
    cache = engine.scheduler.encoder_cache
    assert cache.num_entries == 0 and cache.num_used == 0 and cache.num_reused > 0
    assert not engine.runner.encoder_cache and not engine.runner.batch.mm_inputs
    assert engine.kv_manager.get_stats().num_used_blocks == 0 and engine.kv_manager.num_requests == 0
    engine.check_invariants()
    # A request aborted in the middle of an image lets go of it; the next step frees it.
    ids, mm = llm._images().process_text("USER: <image> <image> <image> <image> the end", pictures[:4])
    engine.add_request("aborted", ids, GREEDY, mm_inputs=mm)
    engine.step()  # 64 tokens: three images passed (let go of), the fourth cut
    assert mm[3].offset < engine.scheduler.get_request("aborted").num_computed_tokens < mm[3].end
    assert cache.num_entries == 1 and mm[3].content_hash in cache and mm[3].content_hash in engine.runner.encoder_cache
    engine.abort_requests(["aborted"])
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert cache.num_entries == 0 and not engine.runner.encoder_cache and not engine.runner.batch.mm_inputs


def test_prefix_hit_ending_inside_an_image(llm, hf_model, processor):
    """An image at the end of the prompt: the same prompt again hits up to a block boundary inside the image,
    whose embeddings are made again for the rest of its tokens."""
    text, picture = "USER: look at this one <image>", image(50, 40, 60)
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)[0]
    encoded = llm.engine.scheduler.encoder_cache.num_encoded
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)[0]
    image_start = first.prompt_token_ids.index(llm.engine.model_info.image_token_id)
    assert image_start < again.num_cached_tokens < len(first.prompt_token_ids)
    assert llm.engine.scheduler.encoder_cache.num_encoded == encoded + 1
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy(hf_model, processor, text, [picture],
                                                                                GREEDY.max_tokens)


def test_requests_the_engine_refuses(llm):
    info = llm.engine.model_info
    many = {"prompt": "USER: " + "<image>" * 8 + " ASSISTANT:", "multi_modal_data": {"image": [image(5, 32, 32)] * 8}}
    with pytest.raises(RequestError, match=r"128 of them for 8 images") as refused:
        llm.generate(many, GREEDY, use_tqdm=False)
    assert refused.value.code == "context_length_exceeded"
    with pytest.raises(RequestError, match="images"):  # two placeholders, one image
        llm.generate({"prompt": "USER: <image> <image>", "multi_modal_data": {"image": image(5, 32, 32)}}, GREEDY)
    ids, mm = llm._images().process_text("USER: <image> hi", [image(5, 32, 32)])
    with pytest.raises(RequestError, match="more than the engine encodes in one step"):
        dataclasses.replace(info, max_tokens_per_image=8).check_request(ids, GREEDY, mm)
    with pytest.raises(RequestError, match="does not take images"):
        dataclasses.replace(info, input_modalities=("text",), image_token_id=None).check_request(ids, GREEDY, mm)
    with pytest.raises(RequestError, match="not all the image token"):
        info.check_request(ids[:mm[0].offset] + [5] + ids[mm[0].offset + 1:], GREEDY, mm)
    wrong_size = msgspec.structs.replace(mm[0], pixel_values=msgspec.structs.replace(mm[0].pixel_values,
                                                                                     shape=(3, 16, 64)))
    with pytest.raises(RequestError, match="vision tower takes"):
        llm.engine.add_request("bad-size", ids, GREEDY, checked=True, mm_inputs=[wrong_size])
    assert not llm.engine.has_unfinished_requests()


# ---------------------------------------------------------------------------------------- the front ends


def test_chat_and_token_id_prompts(llm, llava_dir, processor):
    """LLM.chat with an image part (a PIL image, or a data URL of it) renders with the processor's template;
    token ids with one <image> per image are expanded as the processor does."""
    picture = image(20, 45, 35)
    png = io.BytesIO()
    picture.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    question = {"type": "text", "text": "What is this?"}
    by_pil, by_url = llm.chat([
        [{"role": "user", "content": [{"type": "image", "image": picture}, question]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, question]}],
    ], GREEDY, use_tqdm=False)
    rendered = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, question]}],
                                             add_generation_prompt=True, tokenize=False)
    by_text = llm.generate({"prompt": rendered, "multi_modal_data": {"image": picture}}, GREEDY, use_tqdm=False)[0]
    assert by_pil.prompt_token_ids == by_url.prompt_token_ids == by_text.prompt_token_ids
    assert by_pil.outputs[0].token_ids == by_url.outputs[0].token_ids == by_text.outputs[0].token_ids
    image_id = llm.engine.model_info.image_token_id
    ids = by_text.prompt_token_ids
    short = [t for i, t in enumerate(ids) if t != image_id or ids[i - 1] != image_id]  # one <image> per image
    by_ids = llm.generate({"prompt_token_ids": short, "multi_modal_data": {"image": [picture]}}, GREEDY,
                          use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == ids and by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_content_hash():
    picture = image(30, 20, 30)
    rgba = picture.convert("RGBA")
    assert image_content_hash(picture) == image_content_hash(rgba) == image_content_hash(np.asarray(picture))
    assert image_content_hash(picture) != image_content_hash(image(31, 20, 30))
    assert image_content_hash(picture) != image_content_hash(picture.resize((20, 30)))  # same bytes count, other shape
    # Transparency is composited over white, as the HF image processors do: the hash is of what the model sees.
    hidden = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert image_content_hash(hidden) == image_content_hash(Image.new("RGB", (4, 4), (255, 255, 255)))


def test_images_cross_the_process_boundary(llm):
    """A CoreRequest with images through the engine core's msgspec encoding (pixel values as bytes, shape, dtype),
    then into the engine: the same tokens as the offline API gives."""
    proc = MultiModalProcessor.from_pretrained(llm.engine.model_info.model_path, llm.engine.model_info.image_token_id)
    ids, mm = proc.process_text("USER: <image>\nand <image> ASSISTANT:", [image(40, 32, 40), image(41, 50, 32)])
    params = llm.engine.validate_request(ids, GREEDY, mm)
    frame = make_encoder().encode(AddRequests([CoreRequest("core-0", ids, params, 0.0, mm)]))
    received = input_decoder().decode(frame).requests[0]
    assert received.mm_inputs == mm and image_spans(received.mm_inputs) == image_spans(mm)
    assert np.array_equal(received.mm_inputs[1].pixel_values.to_numpy(), mm[1].pixel_values.to_numpy())
    llm.engine.add_request(received.request_id, received.prompt_token_ids, received.params, checked=True,
                           mm_inputs=received.mm_inputs)
    tokens = []
    while llm.engine.has_unfinished_requests():
        tokens += [t for out in llm.engine.step() for t in out.new_token_ids]
    images = [image(40, 32, 40), image(41, 50, 32)]
    offline = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert tokens == offline.outputs[0].token_ids


def test_async_engine_sends_each_prompt_its_images(llm):
    """AsyncEngine.generate (the API server's side) gives each engine request the images of its own prompt."""
    from engine.frontend.async_engine import AsyncEngine

    engine = AsyncEngine(llm.engine.config, llm.engine.model_info, llm.engine.stats(), llm.tokenizer, process=None,
                         control=None, sockets=None)
    from engine.core.process import AddRequests

    sent, encoder = [], engine._encoder

    class RecordingEncoder:  # what generate encodes for the core, kept; nothing is sent (no core here)
        def encode(self, message):
            sent.append(message)
            return encoder.encode(message)

    engine._encoder = RecordingEncoder()
    engine._send_frame = lambda frame: None
    proc = llm._images()
    first = proc.process_text("USER: <image> one", [image(60, 32, 32)])
    second = proc.process_text("USER: <image> two <image>", [image(61, 32, 32), image(62, 40, 32)])
    engine.generate("r", [first[0], second[0], [5, 6, 7]], dataclasses.replace(GREEDY, n=2),
                    mm_inputs=[first[1], second[1], None])
    (added,) = [message for message in sent if isinstance(message, AddRequests)]
    requests = added.requests
    assert [r.mm_inputs for r in requests] == [first[1], first[1], second[1], second[1], None, None]
    assert [r.prompt_token_ids for r in requests[::2]] == [first[0], second[0], [5, 6, 7]]


# ----------------------------------------------------------------------------------------------- the server


class _ImageSite:
    """A local HTTP server with one PNG at /cat.png, counting its hits."""

    def __init__(self, png: bytes):
        import http.server
        import threading

        site = self
        self.hits = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                site.hits += 1
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/cat.png"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_the_server_answers_images_as_the_offline_engine(llava_dir, llm, tmp_path):
    """The `openai` SDK's base64 image and a remote image (its host allowed) give the offline engine's greedy
    tokens for the same picture; a corrupt image, a 50 MB image (the body limit raised past it, the image limit
    is 20 MB) and an unsupported type are 400s naming the part, and no KV block is left in use; /v1/models says
    the model takes images; /metrics counts the encoded images and shows the encoder cache empty at the end."""
    import openai

    from tests.server_helpers import assert_error_shape, start_server, wait_until_idle

    picture = image(30, 50, 40)
    png = io.BytesIO()
    picture.save(png, format="PNG")
    site = _ImageSite(png.getvalue())
    question = {"type": "text", "text": "Describe it."}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = llm.chat([{"role": "user", "content": [{"type": "image", "image": picture}, question]}], params,
                        use_tqdm=False)[0].outputs[0].text
    server = start_server(tmp_path, "llava", ["--model", str(llava_dir), "--max-model-len", "128",
                                              "--num-kvcache-blocks", "48", "--kvcache-block-size", "8",
                                              "--allowed-media-domains", "127.0.0.1",
                                              "--allow-private-media-addresses", "--max-request-body-mb", "80"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        data_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        for url in (data_url, site.url):
            reply = client.chat.completions.create(
                model=str(llava_dir.name), temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, question]}])
            assert reply.choices[0].message.content == expected
        assert site.hits == 1
        models = client.models.list().data
        assert [m.model_extra.get("input_modalities") for m in models] == [["text", "image"]]
        bad = {"corrupt": "data:image/png;base64," + base64.b64encode(png.getvalue()[:200]).decode(),
               "too large": "data:image/png;base64," + "A" * (50 * 2**20),
               "unsupported": "data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode()}
        with server.client(timeout=60.0) as http:
            for name, url in bad.items():
                response = http.post("/v1/chat/completions", json={
                    "model": llava_dir.name, "max_tokens": 4,
                    "messages": [{"role": "user", "content": [question, {"type": "image_url",
                                                                         "image_url": {"url": url}}]}]})
                error = assert_error_shape(response, 400)
                assert error["param"] == "messages.0.content.1.image_url", name
        metrics = wait_until_idle(server.url)
        assert metrics["minivllm:kv_cache_blocks_used"] == 0
        # The encoder cache: the picture was encoded (the second request may find its KV blocks cached instead),
        # and nothing is held once every request is done.
        assert metrics["minivllm:encoder_images_encoded_total"] >= 1
        assert metrics["minivllm:encoder_cache_tokens_total"] > 0
        assert metrics["minivllm:encoder_cache_tokens_used"] == metrics["minivllm:encoder_cache_images"] == 0
    finally:
        server.stop()
        site.httpd.shutdown()


def test_the_dashboard_marks_the_blocks_holding_image_tokens(llm):
    """The pool marks every block that holds one of an image's tokens (in use, or cached after), the dashboard's
    snapshot carries that mask and counts the marked blocks that are not free; a block handed out again is no
    longer marked."""
    from kvcache.block_pool import STATE_CACHED_FREE, STATE_FREE, BlockPool
    from server.dashboard import snapshot_from_stats

    engine = llm.engine
    ids, mm = llm._images().process_text("USER: two pictures <image> and <image> thanks", [image(60, 30, 30),
                                                                                          image(61, 33, 20)])
    engine.add_request("marked", ids, GREEDY, mm_inputs=mm)
    while engine.scheduler.get_request("marked").num_computed_tokens < len(ids):
        engine.step()
    bs = engine.kv_manager.block_size
    table = engine.kv_manager.get_block_ids("marked")
    with_images = {table[i] for m in mm for i in range(m.offset // bs, (m.end - 1) // bs + 1)}
    marked = set(np.flatnonzero(engine.kv_manager.pool.visual_blocks()).tolist())
    assert with_images <= marked and not (set(table) - with_images) & marked
    states = engine.kv_manager.pool.block_states()
    assert all(states[b] in (STATE_CACHED_FREE, STATE_FREE) for b in marked - with_images)  # earlier requests'
    snap = snapshot_from_stats(engine.stats(), "ok", 0, 0)
    assert set(np.flatnonzero(np.frombuffer(base64.b64decode(snap.visual), np.int8)).tolist()) == marked
    assert snap.counts.visual == sum(1 for b in marked if states[b] != STATE_FREE)
    full = {table[i] for i in range(len(ids) // bs)}  # blocks the prompt fills: cached once the request ends
    engine.abort_requests(["marked"])
    engine.step()
    states, marked = engine.kv_manager.pool.block_states(), engine.kv_manager.pool.visual_blocks()
    assert all(states[b] == STATE_CACHED_FREE and marked[b] for b in with_images & full)  # still coloured
    assert snapshot_from_stats(engine.stats(), "ok", 0, 0).counts.visual >= len(with_images & full) > 0

    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    pool.mark_visual(b.block_id for b in blocks[:2])
    assert pool.visual_blocks().tolist() == [0, 1, 1, 0, 0]
    pool.free_blocks(blocks)
    pool.get_new_blocks(4)  # every block handed out again: no mark is left
    assert not pool.visual_blocks().any()
