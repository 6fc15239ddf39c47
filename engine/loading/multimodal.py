"""Images in prompts: what a request carries per image, its content hash, and the model's HF processor.

Shared by both sides of the engine: the front end (``LLM``, the API server) turns images into
``ImageInput``s with ``MultiModalProcessor``; the engine (scheduler, KV manager, model runner) reads
them. An image is a run of placeholder tokens in the prompt, written once at prefill::

    prompt ids:  ... 9814 <img> <img> ... <img> 665 ...      the processor expands each <image>
                         ^offset     length tokens ^          into the model's count (LLaVA-1.5: 576)
    ImageInput:  offset, length, content_hash, pixel_values (bytes + shape + dtype), grid_thw

LLaVA's images are all one size ([3, 336, 336] pixel values). Qwen2.5-VL's keep their aspect
ratio: an image is a grid of ``t x h x w`` patches (``grid_thw``; t = 1 for a still image),
flattened into [t*h*w, channels*temporal*patch*patch] pixel values, and takes t*h*w / merge^2
tokens, between ``<|vision_start|>`` and ``<|vision_end|>``.

``content_hash`` names the image's pixels (``image_content_hash``): the encoder cache is keyed by it,
and a KV block holding any of the image's tokens has it in its prefix-cache hash, so two prompts with
the same placeholder tokens and different images never share a block.

The module imports no torch or transformers at import time: the API server reads it before the
engine core has started.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from engine.errors import RequestError

logger = logging.getLogger("minivllm")

_HASH_BYTES = 32


class TensorData(msgspec.Struct, array_like=True, gc=False):
    """A tensor as raw bytes, its shape and its dtype name (numpy's): how pixel values cross processes."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def from_array(cls, array: Any) -> TensorData:
        """From a numpy array or a CPU torch tensor (float32 and other numpy-representable dtypes)."""
        if not isinstance(array, np.ndarray):
            array = array.detach().cpu().numpy()
        array = np.ascontiguousarray(array)
        return cls(array.tobytes(), tuple(int(n) for n in array.shape), array.dtype.str)

    def to_numpy(self) -> np.ndarray:
        """A read-only view of the bytes, in its shape."""
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class ImageInput(msgspec.Struct, array_like=True, gc=False):
    """One image of a prompt: where its placeholder tokens are, what it is, and its processed pixels."""

    offset: int  # the prompt position of its first placeholder token
    length: int  # how many placeholder tokens it has: the number of embeddings the model makes of it
    content_hash: str  # image_content_hash() of the source image (hex)
    pixel_values: TensorData  # the processor's output for this image, e.g. [3, 336, 336] float32
    # The image's patch grid (temporal, height, width) when the model takes images of any size (Qwen2.5-VL:
    # pixel_values [t*h*w, patch values]); None for a model of one image size (LLaVA).
    grid_thw: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


def to_rgb(image: Any):
    """An RGB PIL image, any transparency composited over white: what the HF image processors make of it
    (``convert_to_rgb``), so that the pixels hashed are the pixels the model sees."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def upright(image: Any):
    """``image`` turned as its EXIF orientation tag says (a phone's portrait photo is stored sideways, with a
    tag that viewers apply): the pixels the model sees are the picture the sender saw. Unchanged without one."""
    from PIL import ImageOps

    return ImageOps.exif_transpose(image)


def image_content_hash(image: Any) -> str:
    """blake2b-256 (hex) of an image's RGB pixels (``to_rgb``), with their mode and size: ``RGB:WxH:`` then
    the bytes.

    The same picture gives the same hash whatever file format or mode it came in (a PNG and a
    lossless WebP of it, an RGBA version of it with an opaque alpha channel); another picture, or
    the same bytes in another shape, gives another. Takes a PIL image or an ``[height, width, 3]``
    uint8 array.
    """
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"an image array must be [height, width, 3] uint8, got {image.shape} {image.dtype}")
        height, width = image.shape[:2]
        pixels = np.ascontiguousarray(image).tobytes()
    else:
        rgb = to_rgb(image)
        width, height = rgb.size
        pixels = rgb.tobytes()
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(f"RGB:{width}x{height}:".encode())
    h.update(pixels)
    return h.hexdigest()


def block_hash_key(content_hash: str) -> bytes:
    """The bytes a KV block's hash takes for an image (``kvcache.block_pool.hash_block_tokens``)."""
    return bytes.fromhex(content_hash)


def image_spans(images: Sequence[ImageInput] | None) -> tuple[tuple[int, int, bytes], ...] | None:
    """(offset, length, block-hash key) of each image, for the KV manager; None without images."""
    if not images:
        return None
    return tuple((mm.offset, mm.length, block_hash_key(mm.content_hash)) for mm in images)


def check_image_inputs(prompt_token_ids: Sequence[int], images: Sequence[ImageInput], image_token_id: int | None,
                       max_tokens_per_image: int | None = None) -> None:
    """RequestError unless the images are ordered, apart, inside the prompt and on placeholder tokens only."""
    if image_token_id is None:
        raise RequestError("this model does not take images", param="multi_modal_data")
    n = len(prompt_token_ids)
    previous_end = 0
    for i, mm in enumerate(images):
        if mm.length < 1 or mm.offset < previous_end or mm.end > n:
            raise RequestError(f"image {i}: its {mm.length} tokens at position {mm.offset} are not inside the "
                               f"{n}-token prompt after the previous image", param="multi_modal_data")
        if max_tokens_per_image is not None and mm.length > max_tokens_per_image:
            raise RequestError(f"image {i} takes {mm.length} tokens, more than the engine encodes in one step "
                               f"(max_num_batched_tokens={max_tokens_per_image})", param="multi_modal_data")
        if any(t != image_token_id for t in prompt_token_ids[mm.offset:mm.end]):
            raise RequestError(f"image {i}: the prompt's tokens at positions {mm.offset}..{mm.end - 1} are not all "
                               f"the image token ({image_token_id})", param="multi_modal_data")
        previous_end = mm.end


def load_image(source: Any):
    """An RGB PIL image (``to_rgb``) from a PIL image, a ``data:image/...;base64,`` URL, raw encoded bytes or
    an ``[height, width, 3]`` uint8 array. Encoded images are turned upright (``upright``); a PIL image is
    taken as it is."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return to_rgb(source)
    if isinstance(source, np.ndarray):
        return Image.fromarray(source).convert("RGB")
    if isinstance(source, str):
        if not source.startswith("data:"):
            raise RequestError("only data: URLs are read here (data:image/png;base64,...); fetching URLs is the "
                               "API server's part", param="image_url")
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise RequestError("an image data URL must be base64 (data:image/...;base64,...)", param="image_url")
        try:
            source = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError("the image data URL is not valid base64", param="image_url") from None
    if isinstance(source, (bytes, bytearray)):
        try:
            image = Image.open(io.BytesIO(source))
            image.load()
            image = upright(image)
        except Exception as exc:  # noqa: BLE001 - PIL raises several kinds for undecodable data
            raise RequestError(f"the image cannot be decoded: {exc}", param="image_url") from None
        return to_rgb(image)
    raise RequestError(f"an image must be a PIL image, a data URL or bytes, got {type(source).__name__}",
                       param="multi_modal_data")


class MultiModalProcessor:
    """A model's Hugging Face processor (``AutoProcessor``), giving prompts with images the engine's inputs.

    The HF processor resizes and normalizes each image into pixel values and expands each image
    placeholder of the text (LLaVA's ``<image>``, Qwen2.5-VL's ``<|image_pad|>``) into the model's
    number of image tokens; this class finds those tokens (one run per image, in order) and returns
    the ``ImageInput``s that go with the token ids. A processor that gives ``image_grid_thw``
    (Qwen2.5-VL) concatenates the images' patches: each image's are its grid's t*h*w rows.
    """

    def __init__(self, hf_processor: Any, image_token_id: int):
        self.hf = hf_processor
        self.image_token_id = image_token_id

    @classmethod
    def from_pretrained(cls, path: str, image_token_id: int, trust_remote_code: bool = False) -> MultiModalProcessor:
        return cls(load_hf_processor(path, trust_remote_code), image_token_id)

    def process_text(self, text: str, images: Sequence[Any], add_special_tokens: bool = True
                     ) -> tuple[list[int], list[ImageInput]]:
        """Tokenize ``text`` (one image placeholder per image, in order) with its images."""
        images = [load_image(image) for image in images]
        with _refused_by_processor():
            out = self.hf(text=text, images=images or None, return_tensors="np", add_special_tokens=add_special_tokens)
        ids = [int(t) for t in out["input_ids"][0]]
        return ids, self._image_inputs(ids, images, *_per_image(out))

    def process_token_ids(self, token_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], list[ImageInput]]:
        """Token ids with one image token per image (expanded here), or already expanded as the processor does."""
        images = [load_image(image) for image in images]
        ids = [int(t) for t in token_ids]
        if not images:
            return ids, []
        with _refused_by_processor():
            pixels, grids = _per_image(self.hf.image_processor(images, return_tensors="np"))
        counts = self._token_counts(ids, pixels, grids)
        num_placeholders = sum(1 for t in ids if t == self.image_token_id)
        if num_placeholders == len(images) and sum(counts) != len(images):
            expanded, k = [], 0
            for t in ids:
                if t == self.image_token_id:
                    expanded += [t] * counts[k]
                    k += 1
                else:
                    expanded.append(t)
            ids = expanded
        return ids, self._image_inputs(ids, images, pixels, grids, counts)

    def process_chat(self, messages: list[dict], chat_template: str | None = None, **template_kwargs
                     ) -> tuple[list[int], list[ImageInput]]:
        """Render a conversation whose messages may have image parts with the processor's chat template.

        Content parts: ``{"type": "text", "text": ...}``, ``{"type": "image", "image": PIL image}`` and
        OpenAI's ``{"type": "image_url", "image_url": {"url": "data:..."}}``.
        """
        conversation, images = [], []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    kind = part.get("type")
                    if kind in ("image", "image_url", "image_pil"):
                        source = part.get("image", part.get("image_pil"))
                        if kind == "image_url":
                            url = part.get("image_url")
                            source = url.get("url") if isinstance(url, dict) else url
                        image = load_image(source)
                        images.append(image)
                        parts.append({"type": "image", "image": image})
                    else:
                        parts.append(part)
                message = {**message, "content": parts}
            conversation.append(message)
        with _refused_by_processor():
            out = self.hf.apply_chat_template(conversation, chat_template=chat_template, add_generation_prompt=True,
                                              tokenize=True, return_dict=True, return_tensors="np", **template_kwargs)
        ids = [int(t) for t in out["input_ids"][0]]
        return ids, self._image_inputs(ids, images, *_per_image(out))

    @property
    def chat_template(self) -> str | None:
        """The processor's chat template (the one that knows image parts), if it has one."""
        return getattr(self.hf, "chat_template", None)

    # ------------------------------------------------------------------ internals

    def _token_counts(self, ids: list[int], pixels: list | None, grids: list | None) -> list[int]:
        """Each image's number of tokens: from its grid with Qwen2.5-VL's processor (t*h*w / merge^2), from its
        pixel size with LLaVA's (patches, plus CLS, less the one that the "default" strategy drops), else from
        the runs of image tokens in ``ids``."""
        if pixels is None:
            return []
        hf = self.hf
        if grids is not None:
            merge = int(hf.image_processor.merge_size)
            return [t * h * w // merge**2 for t, h, w in grids]
        patch = getattr(hf, "patch_size", None)
        if patch:
            extra = int(getattr(hf, "num_additional_image_tokens", 0) or 0)
            drop = 1 if getattr(hf, "vision_feature_select_strategy", None) == "default" else 0
            return [(int(p.shape[-2]) // patch) * (int(p.shape[-1]) // patch) + extra - drop for p in pixels]
        runs = _runs(ids, self.image_token_id)
        if len(runs) != len(pixels):
            raise RequestError(f"the prompt has {len(runs)} runs of image tokens for {len(pixels)} images",
                               param="multi_modal_data")
        return [length for _, length in runs]

    def _image_inputs(self, ids: list[int], images: list, pixels: list | None, grids: list | None,
                      counts: list[int] | None = None) -> list[ImageInput]:
        if not images:
            if any(t == self.image_token_id for t in ids):
                raise RequestError("the prompt has image tokens but no image was given", param="multi_modal_data")
            return []
        if pixels is None or len(pixels) != len(images):
            raise RequestError(f"the processor made {0 if pixels is None else len(pixels)} pixel tensors of "
                               f"{len(images)} images (one placeholder per image in the prompt?)",
                               param="multi_modal_data")
        counts = counts if counts is not None else self._token_counts(ids, pixels, grids)
        inputs, cursor = [], 0
        for k, (image, count) in enumerate(zip(images, counts)):
            try:
                offset = ids.index(self.image_token_id, cursor)
            except ValueError:
                raise RequestError(f"the prompt has placeholders for {k} of its {len(images)} images",
                                   param="multi_modal_data") from None
            if ids[offset:offset + count] != [self.image_token_id] * count:
                raise RequestError(f"image {k} needs {count} image tokens in a row at position {offset}",
                                   param="multi_modal_data")
            inputs.append(ImageInput(offset, count, image_content_hash(image), TensorData.from_array(pixels[k]),
                                     grids[k] if grids is not None else None))
            cursor = offset + count
        if self.image_token_id in ids[cursor:]:
            raise RequestError(f"the prompt has more image tokens than its {len(images)} images take",
                               param="multi_modal_data")
        return inputs


def _per_image(out: Any) -> tuple[list[np.ndarray] | None, list[tuple[int, int, int]] | None]:
    """An HF processor's output split by image: (each image's pixel values, each image's patch grid or None).

    With ``image_grid_thw`` the pixel values of all images come as one [patches, values] array, an image's
    patches the next t*h*w rows; without, the first dim is the image.
    """
    pixels, grids = out.get("pixel_values"), out.get("image_grid_thw")
    if pixels is None:
        return None, None
    if grids is None:
        return list(pixels), None
    grids = [(int(t), int(h), int(w)) for t, h, w in grids]
    ends = np.cumsum([t * h * w for t, h, w in grids])
    if len(grids) and ends[-1] != len(pixels):
        raise RequestError(f"the processor made {len(pixels)} patches for image grids of {ends[-1]}",
                           param="multi_modal_data")
    return np.split(pixels, ends[:-1]), grids


def load_hf_processor(path: str, trust_remote_code: bool = False) -> Any:
    """``AutoProcessor.from_pretrained(path)``; for a processor whose video processor cannot be built here
    (transformers' Qwen2-VL family builds it with torchvision, which serving images does not need), the same
    processor class without its video processor: the text, chat template and image processing are the class's
    own. ``trust_remote_code``: see ``engine.loading.tokenizer.from_pretrained``."""
    import inspect

    from transformers import AutoConfig, AutoProcessor

    from engine.loading.tokenizer import from_pretrained

    try:
        return from_pretrained(AutoProcessor, path, trust_remote_code, "processor")
    except ImportError:
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

        config = from_pretrained(AutoConfig, path, trust_remote_code, "config")
        processor_class = PROCESSOR_MAPPING.get(type(config), None)
        if processor_class is None or "video_processor" not in inspect.signature(processor_class.__init__).parameters:
            raise
    logger.info("%s without its video processor (it needs torchvision): images and text only", processor_class.__name__)

    class ImagesOnlyProcessor(processor_class):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=chat_template, **kwargs)

    return ImagesOnlyProcessor.from_pretrained(str(path))


@contextlib.contextmanager
def _refused_by_processor():
    """The HF processor's ValueErrors (e.g. placeholders and images that do not pair up) as RequestErrors."""
    try:
        yield
    except RequestError:
        raise
    except ValueError as exc:
        raise RequestError(f"the model's processor refused the prompt: {exc}", param="multi_modal_data") from None


def _runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of ``token_id`` in ``ids``."""
    runs, start = [], None
    for i, t in enumerate(ids):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(ids) - start))
    return runs
