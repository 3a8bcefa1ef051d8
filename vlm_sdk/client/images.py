"""Local images as data URLs in OpenAI `image_url` parts (blocking: the client calls it off the loop)."""
from __future__ import annotations

import base64
import io
import mimetypes
import os
import sys
from pathlib import Path
from typing import Any

from vlm_sdk.errors import InvalidImageError


_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
               (b"GIF89a", "image/gif"), (b"BM", "image/bmp"), (b"II*\x00", "image/tiff"),
               (b"MM\x00*", "image/tiff"))


def _is_pil(obj: Any) -> bool:
    pil = sys.modules.get("PIL.Image")  # a PIL image can only exist if PIL is imported already
    return pil is not None and isinstance(obj, pil.Image)


def _is_local(src: Any) -> bool:
    if isinstance(src, str):
        return not src[:8].lower().startswith(("data:", "http://", "https://"))
    return True


def encode_messages(messages: list[dict]) -> list[dict]:
    """A copy of `messages` with every image part as an OpenAI `image_url` part whose URL is a data
    URL (local images) or the URL given (http(s), data). The part's other keys (per-image options of
    the model family, e.g. a size bound) end up inside `image_url`. Blocking: call it off the event loop."""
    out = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, (list, tuple)):
            out.append(msg)
            continue
        out.append({**msg, "content": [_encode_part(p) for p in content]})
    return out


def _encode_part(part: Any) -> Any:
    if not isinstance(part, dict) or part.get("type") not in ("image", "image_url"):
        return part
    if part["type"] == "image":
        inner, src = {}, part.get("image")
    else:
        url = part.get("image_url")
        inner = dict(url) if isinstance(url, dict) else {}
        src = inner.get("url") if isinstance(url, dict) else url
    inner.update({k: v for k, v in part.items() if k not in ("type", "image", "image_url") and v is not None})
    inner["url"] = to_data_url(src) if _is_local(src) else src
    return {"type": "image_url", "image_url": inner}


def to_data_url(src: Any) -> str:
    """A base64 data URL for a PIL image (encoded as PNG), a path or `file://` URL (the file's bytes
    as they are), or raw bytes; the MIME type is sniffed from the bytes, else guessed from the name."""
    if _is_pil(src):
        buf = io.BytesIO()
        try:
            src.save(buf, format="PNG")
        except (OSError, KeyError, ValueError):  # a mode PNG cannot hold (CMYK, YCbCr, ...)
            buf = io.BytesIO()
            src.convert("RGB").save(buf, format="PNG")
        data, name = buf.getvalue(), "x.png"
    elif isinstance(src, (bytes, bytearray, memoryview)):
        data, name = bytes(src), ""
    elif isinstance(src, (str, os.PathLike)):
        path = Path(os.fspath(src))
        if isinstance(src, str) and src[:7].lower() == "file://":
            from urllib.parse import unquote, urlparse
            from urllib.request import url2pathname
            path = Path(url2pathname(unquote(urlparse(src).path)))
        try:
            data, name = path.read_bytes(), path.name
        except OSError as e:
            raise InvalidImageError(f"cannot read image file {str(path)!r}: {e}") from e
    else:
        raise InvalidImageError(f"cannot send a {type(src).__name__} as an image; accepted: a PIL.Image, a path, "
                                f"bytes, a data: URL or an http(s) URL")
    if not data:
        raise InvalidImageError(f"empty image data from {name or 'bytes'}")
    mime = next((m for sig, m in _SIGNATURES if data.startswith(sig)), None)
    if mime is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        mime = "image/webp"
    mime = mime or mimetypes.guess_type(name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
