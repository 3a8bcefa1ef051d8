"""Local images and videos as data URLs in OpenAI `image_url` / vLLM `video_url` parts (blocking: the
client calls it off the loop)."""
from __future__ import annotations

import base64
import io
import mimetypes
import os
import sys
from pathlib import Path
from typing import Any

from vlm_sdk.errors import InvalidImageError, InvalidVideoError


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
    URL (local images) or the URL given (http(s), data), and every video part as a `video_url` part
    alike (a video given as a list of frames stays a `video` part, each frame a data URL). The part's
    other keys (per-item options of the model family, e.g. a size bound, a video's fps) end up inside
    the url object. Blocking: call it off the event loop."""
    out = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, (list, tuple)):
            out.append(msg)
            continue
        out.append({**msg, "content": [_encode_part(p) for p in content]})
    return out


def _encode_part(part: Any) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in ("image", "image_url", "video", "video_url"):
        return part
    base = kind.removesuffix("_url")
    if kind == base:
        inner, src = {}, part.get(base)
    else:
        url = part.get(kind)
        inner = dict(url) if isinstance(url, dict) else {}
        src = inner.get("url") if isinstance(url, dict) else url
    options = {k: v for k, v in part.items() if k not in ("type", base, kind) and v is not None}
    if base == "video" and isinstance(src, (list, tuple)):  # frames: each an image
        return {**options, "type": "video", "video": [to_data_url(f) if _is_local(f) else f for f in src]}
    inner.update(options)
    inner["url"] = (to_video_data_url(src) if base == "video" else to_data_url(src)) if _is_local(src) else src
    return {"type": f"{base}_url", f"{base}_url": inner}


# (offset, bytes, MIME type) of the containers a video usually comes in
_VIDEO_SIGNATURES = ((4, b"ftypqt", "video/quicktime"), (4, b"ftyp", "video/mp4"), (0, b"\x1aE\xdf\xa3", "video/webm"),
                     (8, b"AVI ", "video/x-msvideo"))


def to_video_data_url(src: Any) -> str:
    """A base64 data URL for a video file (a path or `file://` URL) or its bytes."""
    data, name = _file_or_bytes(src, InvalidVideoError, "video", "a path, bytes, a list of frames, a data: URL or "
                                                                 "an http(s) URL")
    mime = next((m for at, sig, m in _VIDEO_SIGNATURES if data[at:at + len(sig)] == sig), None)
    mime = mime or mimetypes.guess_type(name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _file_or_bytes(src: Any, error: type, what: str, accepted: str) -> tuple[bytes, str]:
    """(the bytes, the file's name or "") of a path, `file://` URL or bytes; `error` names what failed."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        data, name = bytes(src), ""
    elif isinstance(src, (str, os.PathLike)):
        path = _local_path(src)
        try:
            data, name = path.read_bytes(), path.name
        except OSError as e:
            raise error(f"cannot read {what} file {str(path)!r}: {e}") from e
    else:
        raise error(f"cannot send a {type(src).__name__} as {'an' if what[0] in 'aeiou' else 'a'} {what}; "
                    f"accepted: {accepted}")
    if not data:
        raise error(f"empty {what} data from {name or 'bytes'}")
    return data, name


def _local_path(src: str | os.PathLike) -> Path:
    if isinstance(src, str) and src[:7].lower() == "file://":
        from urllib.parse import unquote, urlparse
        from urllib.request import url2pathname
        return Path(url2pathname(unquote(urlparse(src).path)))
    return Path(os.fspath(src))


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
    else:
        data, name = _file_or_bytes(src, InvalidImageError, "image", "a PIL.Image, a path, bytes, a data: URL or an "
                                                                     "http(s) URL")
    mime = next((m for sig, m in _SIGNATURES if data.startswith(sig)), None)
    if mime is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        mime = "image/webp"
    mime = mime or mimetypes.guess_type(name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
