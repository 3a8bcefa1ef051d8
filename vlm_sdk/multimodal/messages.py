"""OpenAI-style chat messages: validate them and separate the images from the text.

Content is a string or a list of parts: `{"type": "text", "text"}`, `{"type": "image", "image": src}`
or `{"type": "image_url", "image_url": {"url": src}}` (an object, as OpenAI's schema requires: a bare
string is refused, as vLLM refuses it). Any other key of an image part, on the part or inside
`image_url`, is an option for that image alone (`ImageRef.options`, e.g. a size bound): the model
family reads its image settings from them and ignores keys that no family declares. OpenAI's
`detail` is ignored.

Roles are OpenAI's: `developer` (OpenAI's name for system instructions since its o1 models) is given to
the chat template as `system`, the only instruction role the served families' templates know; an
assistant message's `content` may be null or left out (the openai types allow it beside tool calls),
which is an empty turn. Tool calls themselves are refused: the server takes no tools.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from vlm_sdk.errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "developer")
# what each role is called in the chat template (see the module docstring)
_TEMPLATE_ROLE = {"developer": "system"}


@dataclass(frozen=True)
class ImageRef:
    source: Any  # PIL.Image | path | bytes | data: URL
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # the family's image settings


def parse_messages(messages: Any) -> tuple[list[dict], list[ImageRef]]:
    """Return (messages for the chat template, with image parts reduced to `{"type": "image"}`,
    the images in prompt order)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, "
                                  f"got {_short(messages)}")
    out, images = [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise InvalidRequestError(f"message {i} must be a dict with 'role' and 'content', got {_short(msg)}")
        role = msg["role"]
        if role not in ROLES:
            raise InvalidRequestError(f"message {i} has role {_short(role)}; supported roles are {list(ROLES)}")
        content = _content(msg, i)
        role = _TEMPLATE_ROLE.get(role, role)
        if isinstance(content, str):
            check_text(content, f"message {i}")
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, (list, tuple)):
            raise InvalidRequestError(f"message {i} content must be a string or a list of parts, "
                                      f"got {type(content).__name__}")
        parts = []
        for j, part in enumerate(content):
            parts.append(_parse_part(part, f"message {i} part {j}", images))
        out.append({"role": role, "content": parts})
    return out, images


def _content(msg: dict, i: int) -> Any:
    """The message's content; an assistant's may be null or missing (an empty turn)."""
    if msg["role"] == "assistant":
        for key in ("tool_calls", "function_call"):
            if msg.get(key):
                raise InvalidRequestError(f"message {i} (assistant) has {key!r}: tool calls are not supported by "
                                          f"this server, which takes no tools; leave {key!r} out", param="messages")
        content = msg.get("content")
        return "" if content is None else content
    if "content" not in msg:
        raise InvalidRequestError(f"message {i} must be a dict with 'role' and 'content', got {_short(msg)}")
    return msg["content"]


def _parse_part(part: Any, where: str, images: list[ImageRef]) -> dict:
    if not isinstance(part, dict) or "type" not in part:
        raise InvalidRequestError(f"{where} must be a dict with a 'type', got {_short(part)}")
    kind = part["type"]
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}: a text part needs a string 'text', got {_short(text)}")
        check_text(text, where)
        return {"type": "text", "text": text}
    if kind in ("image", "image_url"):
        if kind == "image":
            source = part.get("image")
        else:
            url = part.get("image_url")
            if not isinstance(url, dict):
                raise InvalidRequestError(f"{where}: an image_url part's 'image_url' must be an object "
                                          f"{{\"url\": ...}} (OpenAI's schema), got {_short(url)}; write "
                                          f"{{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}")
            source = url.get("url")
        if source is None:
            raise InvalidRequestError(f"{where}: an {kind} part needs "
                                      f"{'an image' if kind == 'image' else 'image_url.url'}")
        images.append(ImageRef(source, MappingProxyType(_options(part))))
        return {"type": "image"}
    raise InvalidRequestError(f"{where} has type {kind!r}; supported: 'text', 'image', 'image_url'")


def check_text(text: str, where: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (half of a pair, e.g. from a JSON "\\ud800")
    would fail deep inside the template or the tokenizer."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{where}: the text holds a lone surrogate U+{ord(text[e.start]):04X} at character "
                                  f"{e.start}, which is not a character; send valid Unicode (the two halves of a "
                                  f"surrogate pair together, or the character itself)") from None


_PART_KEYS = frozenset({"type", "image", "image_url"})
_URL_KEYS = frozenset({"url", "detail"})  # OpenAI's detail: ignored


def _options(part: dict) -> dict[str, Any]:
    """The image part's other keys (the part's own win over those inside `image_url`)."""
    url = part.get("image_url")
    inner = {k: v for k, v in url.items() if k not in _URL_KEYS} if isinstance(url, dict) else {}
    return {**inner, **{k: v for k, v in part.items() if k not in _PART_KEYS and k != "detail"}}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def map_parts(messages: Any, text: Callable[[str], str] | None = None,
              image: Callable[[Any], Any] | None = None) -> Any:
    """A copy of `messages` with each text (string content or text part) replaced by `text(t)` and
    each image source by `image(source)`, in prompt order. Anything malformed is passed through as it
    is, for `parse_messages` to refuse with its own message."""
    if not isinstance(messages, (list, tuple)):
        return messages
    out = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            out.append({**msg, "content": text(content)} if text else msg)
        elif isinstance(content, (list, tuple)):
            out.append({**msg, "content": [_map_part(p, text, image) for p in content]})
        else:
            out.append(msg)
    return out


def _map_part(part: Any, text, image) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and text and isinstance(part.get("text"), str):
        return {**part, "text": text(part["text"])}
    if kind == "image" and image and part.get("image") is not None:
        return {**part, "image": image(part["image"])}
    if kind == "image_url" and image:
        url = part.get("image_url")
        if isinstance(url, dict) and url.get("url") is not None:
            return {**part, "image_url": {**url, "url": image(url["url"])}}
    return part


def measure(messages: Any) -> tuple[int, int]:
    """(characters of text, image parts) of `messages`, without copying anything."""
    chars = images = 0
    for msg in messages if isinstance(messages, (list, tuple)) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, (list, tuple)):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    chars += len(part["text"])
                elif kind in ("image", "image_url"):
                    images += 1
    return chars, images
