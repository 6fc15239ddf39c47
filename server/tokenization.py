"""Text to token ids and back: completion prompts, chat templates, and per-token strings.

A model directory without a tokenizer still serves token-id prompts; everything that
needs text answers a 400 there. A chat's images are found here (``chat_image_parts``,
before anything is fetched) and rendered as the template's ``{"type": "image"}`` parts;
fetching and decoding them is server/media.py's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from server.chat_templates import render_conversation
from server.errors import bad_request
from server.media import DecodedImage, ImageRef
from server.protocol import ChatMessageParam, ContentPart
from server.template_sandbox import TemplateLimitError, TemplateLimits, TemplateOutputTooLong
from server.text_bound import TextBound


@dataclass
class TokenizedPrompt:
    token_ids: list[int]
    text: str | None = None  # the prompt as text, when it came as text (used by echo)


def require_tokenizer(tokenizer, param: str, what: str):
    if tokenizer is None:
        raise bad_request(f"this model has no tokenizer, so {what}; send prompts as token ids", param=param)
    return tokenizer


def encode(tokenizer, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
    check_unicode(text, param)
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def check_unicode(text: str, param: str) -> None:
    """JSON can carry a lone UTF-16 surrogate (``"\\ud800"``); it is no character and cannot be tokenized."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} is not valid Unicode: {exc.reason} at position {exc.start}", param=param) from None


def has_text(prompt: str | list) -> bool:
    """Whether a completion prompt needs the tokenizer (else it is token ids only)."""
    return isinstance(prompt, str) or any(isinstance(p, str) for p in prompt)


def num_prompts(prompt: str | list) -> int:
    """How many prompts a completion's ``prompt`` holds (counted before anything is tokenized)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return 1
    return len(prompt)


def admit_prompt_text(prompt: str | list, bound: TextBound, keep_tokens: int | None,
                      side: str | None = None) -> str | list:
    """A completion's prompt with each text checked against what the context can hold, before tokenizing: a 400
    for a text too long, or with ``keep_tokens`` (``truncate_prompt_tokens``) only the part of it that can survive
    (its end, or its start with ``side`` "right")."""
    if isinstance(prompt, str):
        return bound.admit(prompt, "prompt", keep_tokens, side)
    return [bound.admit(p, "prompt", keep_tokens, side) if isinstance(p, str) else p for p in prompt]


def encode_completion_prompts(tokenizer, prompt: str | list) -> list[TokenizedPrompt]:
    """One entry per prompt: a string, a list of strings, a list of ids, or a list of lists of ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("the prompt is empty: it must contain at least one token", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [TokenizedPrompt(list(prompt))]
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            require_tokenizer(tokenizer, "prompt", "text prompts cannot be tokenized")
            prompts.append(TokenizedPrompt(encode(tokenizer, item, param="prompt"), item))
        else:
            prompts.append(TokenizedPrompt(list(item)))
    return prompts


_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                             "return_dict", "chat_template", "documents", "continue_final_message"}


@dataclass(frozen=True)
class ChatTemplateOptions:
    """How a request asks its conversation to be rendered (vLLM's names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is left open, to be continued
    chat_template: str | None = None  # a Jinja template of the request's own instead of the tokenizer's
    template_kwargs: dict | None = None  # extra template variables (chat_template_kwargs)


@dataclass
class RenderedChat:
    """A conversation as the engine takes it: the template's text, its token ids, and the images its
    ``image_url`` parts gave, in message order (each with its content hash and ``detail``)."""

    prompt_token_ids: list[int]
    prompt: str = ""  # the template's text
    images: list[DecodedImage] = field(default_factory=list)


def check_chat(tokenizer, messages: list[ChatMessageParam], options: ChatTemplateOptions) -> None:
    """What makes a conversation unrenderable whatever it holds (no tokenizer or template, no
    messages, options that exclude each other): checked before any image is fetched."""
    require_tokenizer(tokenizer, "messages", "it has no chat template")
    if not messages:
        raise bad_request("messages must contain at least one message", param="messages")
    if not getattr(tokenizer, "chat_template", None) and options.chat_template is None:
        raise bad_request("this model's tokenizer has no chat template", param="messages")
    if options.continue_final_message:
        if options.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt exclude each other: set "
                              "add_generation_prompt to false", param="continue_final_message")
        if messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", param="messages")
    reserved = sorted(set(options.template_kwargs or ()) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")


def chat_image_parts(messages: list[ChatMessageParam], model_name: str, accepts_images: bool,
                     max_images: int) -> list[ImageRef]:
    """The conversation's ``image_url`` parts, in order. Every message is checked first as rendering
    checks it (roles, parts, tool calls), and a model that does not take images refuses them here, as
    does a request with more images than the server allows: such requests fetch nothing."""
    refs = []
    for i, message in enumerate(messages):
        _plain_message(i, message, multimodal=True)
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type != "image_url":
                continue
            if not accepts_images:
                raise bad_request(f"messages.{i}.content.{j}: the model {model_name!r} does not accept images (it "
                                  "takes text only); send text content parts", param=f"messages.{i}.content")
            refs.append(ImageRef(part.image_url.url, part.image_url.detail or "auto",
                                 f"messages.{i}.content.{j}.image_url"))
    if len(refs) > max_images:
        raise bad_request(f"this request has {len(refs)} images; the server accepts at most {max_images} per request "
                          "(--max-images-per-request)", param="messages")
    return refs


def render_chat(tokenizer, messages: list[ChatMessageParam], options: ChatTemplateOptions = ChatTemplateOptions(),
                tools: list[dict] | None = None, images: Sequence[DecodedImage] = (),
                multimodal: bool = False, limits: TemplateLimits = TemplateLimits()) -> RenderedChat:
    """The conversation rendered by the chat template (with the tools, and any extra template
    variables the request gave), as text and token ids.

    ``multimodal``: the model takes images. A message whose content is a list of parts then reaches
    the template as that list, in Hugging Face's multimodal shape (``{"type": "text", "text": ...}``
    and ``{"type": "image"}``), and ``images`` are the decoded images of its ``image_url`` parts, in
    order (server/media.py). For a text-only model, parts are joined into one string (text parts
    only: an image part is a 400)."""
    image_parts = [p for m in messages if isinstance(m.content, list) for p in m.content if p.type == "image_url"]
    if multimodal and len(image_parts) != len(images):
        raise ValueError(f"{len(image_parts)} image parts but {len(images)} images were given")
    text = render_chat_text(tokenizer, messages, options, tools, multimodal, limits)
    token_ids = encode(tokenizer, text, add_special_tokens=False, param="messages")
    return RenderedChat(token_ids, text, list(images) if multimodal else [])


def render_chat_text(tokenizer, messages: list[ChatMessageParam], options: ChatTemplateOptions,
                     tools: list[dict] | None = None, multimodal: bool = False,
                     limits: TemplateLimits = TemplateLimits()) -> str:
    """The chat template's text for the conversation, as transformers' ``apply_chat_template`` renders it,
    within ``limits`` (server/chat_templates.py): a template that fails or goes past a bound is a 400."""
    check_chat(tokenizer, messages, options)
    conversation = [_plain_message(i, m, multimodal) for i, m in enumerate(messages)]
    template = tokenizer.get_chat_template(options.chat_template, tools or None)
    variables = {**tokenizer.special_tokens_map, **(options.template_kwargs or {})}
    try:
        text = render_conversation(template, conversation, tools or None, options.add_generation_prompt,
                                   options.continue_final_message, variables, limits)
    except TemplateOutputTooLong:
        raise bad_request(f"the conversation rendered by the chat template has more than {limits.max_chars:,} "
                          "characters: more than this model's maximum context length can hold", param="messages",
                          code="context_length_exceeded") from None
    except TemplateLimitError as exc:
        raise bad_request(f"the chat template could not render these messages within its bounds: {exc}",
                          param="messages", code="chat_template_limit") from None
    except Exception as exc:  # noqa: BLE001 - a template may raise anything on input it rejects
        raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") from exc
    return text


def message_chars(messages: list[ChatMessageParam]) -> int:
    """The characters of a conversation's text (its messages' contents and text parts)."""
    total = 0
    for message in messages:
        if isinstance(message.content, str):
            total += len(message.content)
        elif message.content:
            total += sum(len(part.text or "") for part in message.content)
    return total


CONTENT_PART_TYPES = ("text", "image_url")


def _check_part(index: int, position: int, part: ContentPart) -> None:
    """A content part of a known type, carrying its own field and not the other's."""
    param = f"messages.{index}.content"
    if part.type not in CONTENT_PART_TYPES:
        raise bad_request(f"messages.{index}.content.{position}: content parts of type {part.type!r} are not "
                          f"supported; only 'text' and 'image_url' are", param=param)
    if part.type == "text" and part.text is None:
        raise bad_request("a content part of type 'text' needs a 'text' string", param=param)
    if part.type == "image_url" and part.image_url is None:
        raise bad_request("a content part of type 'image_url' needs an 'image_url' object with a 'url'",
                          param=param)
    other = "image_url" if part.type == "text" else "text"
    if getattr(part, other) is not None:
        raise bad_request(f"a content part of type {part.type!r} cannot carry {other!r}", param=param)


def _plain_message(index: int, message: ChatMessageParam, multimodal: bool = False) -> dict:
    # Any role reaches the template as given (OpenAI's, or a custom one, as vLLM passes them); a template that
    # does not know a role says so (a 400 naming messages).
    if not message.role:
        raise bad_request(f"messages.{index}.role must not be empty", param=f"messages.{index}.role")
    content = message.content
    if isinstance(content, list):
        for position, part in enumerate(content):
            _check_part(index, position, part)
            if part.type == "image_url" and not multimodal:
                raise bad_request(f"messages.{index}.content.{position}: this model does not accept images (it takes "
                                  "text only)", param=f"messages.{index}.content")
        if multimodal:  # Hugging Face's multimodal templates read the parts themselves
            content = [{"type": "text", "text": p.text} if p.type == "text" else {"type": "image"} for p in content]
        else:
            content = "\n".join(part.text for part in content)
    # OpenAI's "developer" messages are system messages for models whose templates predate the name.
    role = "system" if message.role == "developer" else message.role
    plain = {"role": role, "content": content if isinstance(content, list) else content or ""}
    if message.name is not None:
        plain["name"] = message.name
    if message.tool_calls:
        if message.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", param=f"messages.{index}.tool_calls")
        # Templates read the arguments as a mapping (Qwen's, Llama's, Mistral's alike), not as JSON text.
        plain["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments,
                                                                                             index)}}
                               for c in message.tool_calls]
    if message.tool_call_id is not None:
        if message.role != "tool":
            raise bad_request("only tool messages carry tool_call_id", param=f"messages.{index}.tool_call_id")
        plain["tool_call_id"] = message.tool_call_id
    return plain


def _arguments(text: str, index: int):
    try:
        return json.loads(text)
    except ValueError:
        raise bad_request(f"messages.{index}.tool_calls: arguments must be JSON text", param=f"messages.{index}."
                          "tool_calls") from None


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is out of vocabulary (out of range: the vocabulary has {vocab_size} "
                          f"tokens, 0..{vocab_size - 1})", param=param)


def decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def token_text(tokenizer, token_id: int, as_id: bool = False) -> str:
    """One token as text, for logprobs; ``token_id:N`` when there is no tokenizer or ``as_id``
    (vLLM's ``return_tokens_as_token_ids``)."""
    if tokenizer is None or as_id:
        return f"token_id:{token_id}"
    return decode(tokenizer, [token_id])


def keep_tokens(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's tokens ``truncate_prompt_tokens`` keeps (-1: the context's worth); None: all."""
    if truncate_prompt_tokens is None:
        return None
    return max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def truncate_prompt(prompt: TokenizedPrompt, keep: int | None, max_model_len: int,
                    side: str | None = None) -> TokenizedPrompt:
    """vLLM's ``truncate_prompt_tokens``: ``keep`` of the prompt's tokens (-1: the context's worth), the last
    ones, or the first ones with ``side`` "right" (vLLM's ``truncation_side``)."""
    if keep is None:
        return prompt
    keep = max_model_len if keep == -1 else keep
    if keep == 0:
        raise bad_request("truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
    if len(prompt.token_ids) <= keep:
        return prompt
    kept = prompt.token_ids[:keep] if side == "right" else prompt.token_ids[-keep:]
    return TokenizedPrompt(kept)  # its text is no longer the prompt's (echo decodes)
