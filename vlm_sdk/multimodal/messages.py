"""OpenAI-style chat messages: validate them and separate the images from the text.

Content is a string or a list of parts: `{"type": "text", "text"}`, `{"type": "image", "image": src}`
or `{"type": "image_url", "image_url": {"url": src}}` (`image_url` may also be a bare string). An image
part may carry sizing for that image alone, on the part or inside `image_url`: `min_pixels` /
`max_pixels` (Qwen2.5-VL) or `max_num`, the most tiles (InternVL).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlm_sdk.errors import InvalidRequestError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ImageRef:
    source: Any  # PIL.Image | path | bytes | data: URL
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_num: int | None = None  # InternVL: most tiles for this image (the thumbnail not counted)


def parse_messages(messages: Any) -> tuple[list[dict], list[ImageRef]]:
    """Return (messages for the chat template, with image parts reduced to `{"type": "image"}`,
    the images in prompt order)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, "
                                  f"got {_short(messages)}")
    out, images = [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise InvalidRequestError(f"message {i} must be a dict with 'role' and 'content', got {_short(msg)}")
        role = msg["role"]
        if role not in ROLES:
            raise InvalidRequestError(f"message {i} has role {role!r}; supported roles are {list(ROLES)}")
        content = msg["content"]
        if isinstance(content, str):
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


def _parse_part(part: Any, where: str, images: list[ImageRef]) -> dict:
    if not isinstance(part, dict) or "type" not in part:
        raise InvalidRequestError(f"{where} must be a dict with a 'type', got {_short(part)}")
    kind = part["type"]
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}: a text part needs a string 'text', got {_short(text)}")
        return {"type": "text", "text": text}
    if kind in ("image", "image_url"):
        if kind == "image":
            source = part.get("image")
        else:
            url = part.get("image_url")
            source = url.get("url") if isinstance(url, dict) else url
        if source is None:
            raise InvalidRequestError(f"{where}: an {kind} part needs "
                                      f"{'an image' if kind == 'image' else 'image_url.url'}")
        images.append(ImageRef(source, _positive(part, "min_pixels", where), _positive(part, "max_pixels", where),
                               _positive(part, "max_num", where)))
        return {"type": "image"}
    raise InvalidRequestError(f"{where} has type {kind!r}; supported: 'text', 'image', 'image_url'")


def _positive(part: dict, key: str, where: str) -> int | None:
    value = part.get(key)
    if value is None and isinstance(part.get("image_url"), dict):
        value = part["image_url"].get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidRequestError(f"{where}: {key} must be a positive integer, got {value!r}", param=key)
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
