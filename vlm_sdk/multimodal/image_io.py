"""Turn whatever a user sends as an image into a decoded RGB `PIL.Image`.

Every failure is an `InvalidImageError` that says what was received and what is accepted, so that a
bad image is refused at the door instead of failing later inside the vision stage.
"""
from __future__ import annotations

import io
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

import numpy as np
from PIL import Image, ImageOps

from vlm_sdk.errors import InvalidImageError, without_reprs
from vlm_sdk.multimodal.data_url import Base64Error, decode_base64, split_data_url

ACCEPTED_SOURCES = ("a PIL.Image.Image, a filesystem path (str or pathlib.Path), raw image bytes, "
                    "a base64 data URL ('data:image/png;base64,...') or a 'file://' URL")

_EXIF_ORIENTATION = 0x0112
_TRANSPOSED = (5, 6, 7, 8)  # orientations that swap width and height (ImageOps.exif_transpose)
# Modes whose samples do not fit 8 bits; PIL's own convert("RGB") clips them at 255, which turns most
# 16-bit photos white, so they are rescaled here instead.
_HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
_STRIP_PIXELS = 1 << 20  # converted at a time: a few MB of temporaries whatever the image's size
# round(v / 257) for every 16-bit v (65535 -> 255 exactly; v / 257 is never a tie): one lookup per pixel
_SIXTEEN_BIT = ((np.arange(1 << 16, dtype=np.uint32) + 128) // 257).astype(np.uint8)
_SIXTEEN_BIT.flags.writeable = False


class DecodeCancelled(Exception):
    """The request an `OpenedImage` belongs to was abandoned before its pixels were decoded."""


@dataclass(frozen=True)
class OpenedImage:
    """An image whose header was read and checked (`open_image`) and whose pixels are decoded only
    when `load_image` takes it, so that a request's images are sized up before any is decoded.
    `data`: the encoded bytes (None for a PIL image given as one). `cancelled`: set when whoever
    asked for the request went away; `load_image` then raises `DecodeCancelled` instead of decoding."""
    image: Image.Image
    what: str
    data: bytes | None = None
    cancelled: threading.Event | None = None

    @property
    def pixels(self) -> int:
        return self.image.size[0] * self.image.size[1]


def open_image(source: object, *, max_image_pixels: int = 64_000_000,
               cancelled: threading.Event | None = None) -> OpenedImage:
    """Read `source` and its header, refuse it (`InvalidImageError`) if it is unreadable or over
    `max_image_pixels`; no pixel is decoded."""
    if isinstance(source, OpenedImage):
        _check_size(source.image.size, max_image_pixels, source.what)
        return source
    if isinstance(source, Image.Image):
        what, data, image = _describe(source), None, source
    else:
        data, what = _read_source(source)
        image = _open(data, what)
    _check_size(image.size, max_image_pixels, what)
    return OpenedImage(image, what, data, cancelled)


def reopen(data: bytes, what: str) -> OpenedImage:
    """The `OpenedImage` of encoded `data` described as `what` (an image's bytes in another process)."""
    return OpenedImage(_open(data, what), what, data)


def oriented_size(image: OpenedImage) -> tuple[int, int]:
    """(height, width) of `image` once decoded and turned upright by its EXIF orientation (read from the
    header: nothing decoded), as `load_image` returns it."""
    width, height = image.image.size
    try:
        orientation = image.image.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # unparsable EXIF: load_image keeps the image as it is
        orientation = 1
    return (width, height) if orientation in _TRANSPOSED else (height, width)


def load_image(source: object, *, max_image_pixels: int = 64_000_000) -> Image.Image:
    """Decode `source` into an RGB image, upright according to its EXIF orientation.

    The pixel count is checked against `max_image_pixels` from the header, before any pixel is
    decoded. The image is fully decoded here so that corrupt data fails in this call. A PIL image
    that is already RGB and upright may be returned as the same object. An `OpenedImage` whose
    request was cancelled raises `DecodeCancelled`.
    """
    if isinstance(source, OpenedImage):
        if source.cancelled is not None and source.cancelled.is_set():
            raise DecodeCancelled(source.what)
        # decoded from its bytes afresh: the header-only image stays small while the request's
        # messages (which hold it) live on, so one request holds one decoded image at a time
        image = source.image if source.data is None else _open(source.data, source.what)
        _check_size(image.size, max_image_pixels, source.what)
        _decode(image, source.what)
    elif isinstance(source, Image.Image):
        image = source
        _check_size(image.size, max_image_pixels, _describe(source))
        _decode(image, _describe(source))
    else:
        data, what = _read_source(source)
        image = _open(data, what)
        _check_size(image.size, max_image_pixels, what)
        _decode(image, what)
    image = _apply_exif_orientation(image)
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB; transparency is composited on white.

    The alpha rule and compositing are exactly those of transformers' `convert_to_rgb`, so pixel
    values match its image processors for RGBA, LA, PA and palette images with transparency.
    """
    if image.mode in _HIGH_DEPTH_MODES:
        return _high_depth_to_rgb(image)
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def _high_depth_to_rgb(image: Image.Image) -> Image.Image:
    """16/32-bit gray to 8-bit RGB, a strip of rows at a time: whole-image float64 copies of an
    8000x8000 16-bit image took ~1.5 GB each, so two such requests ran a server into gigabytes."""
    width, height = image.size
    rows = max(1, _STRIP_PIXELS // max(width, 1))
    strips = [(top, min(height, top + rows)) for top in range(0, height, rows)]

    def values(top: int, bottom: int) -> np.ndarray:  # [rows, W], the mode's own dtype
        return np.asarray(image.crop((0, top, width, bottom)))

    if image.mode == "F":
        lo, hi = np.inf, -np.inf
        for top, bottom in strips:
            v = _finite(values(top, bottom))
            lo, hi = min(lo, float(v.min())), max(hi, float(v.max()))

        def scale(v: np.ndarray) -> np.ndarray:
            v = _finite(v)
            if lo >= 0.0 and hi <= 1.0:  # the usual float convention: 0..1
                v = v * 255.0
            elif not (lo >= 0.0 and hi <= 255.0):  # no convention to rely on: stretch the range present
                v = (v - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(v)
            return np.clip(np.round(v), 0, 255)
    else:
        sixteen = image.mode.startswith("I;16")
        hi = 65535.0 if sixteen else max([0.0] + [float(values(t, b).max()) for t, b in strips])
        sixteen = sixteen or 255.0 < hi <= 65535.0  # 16-bit PNG/TIFF handed over as "I" too

        def scale(v: np.ndarray) -> np.ndarray:
            v = np.maximum(v, 0)
            if sixteen:
                return _SIXTEEN_BIT[v]
            if hi <= 255.0:
                return v
            return np.clip(np.round(v * (255.0 / hi)), 0, 255)  # 32-bit data beyond 16 bits: the maximum present

    gray = np.empty((height, width), dtype=np.uint8)  # [H, W]
    for top, bottom in strips:
        gray[top:bottom] = scale(values(top, bottom))
    return Image.fromarray(gray).convert("RGB")


def _finite(v: np.ndarray) -> np.ndarray:
    return np.nan_to_num(v.astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)


def _read_source(source: object) -> tuple[bytes, str]:
    """Return the encoded image bytes and a short description of where they came from."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        return data, f"{len(data)} bytes starting {data[:16]!r}"
    if isinstance(source, os.PathLike):
        return _read_file(Path(os.fspath(source)), f"path {os.fspath(source)!r}")
    if isinstance(source, str):
        head = source[:16].lower()
        if head.startswith("data:"):
            return _decode_data_url(source), f"data URL {_clip(source)!r}"
        if head.startswith("file://"):
            return _read_file(_file_url_path(source), f"file URL {_clip(source, 1024)!r}")  # shown whole, like a path
        if head.startswith(("http://", "https://")):
            raise InvalidImageError(
                f"remote image URL {_clip(source)!r}: the engine does not fetch remote URLs. Download the "
                f"image yourself and pass it as {ACCEPTED_SOURCES}.")
        if re.match(r"^[a-z][a-z0-9+.-]*://", head):
            raise InvalidImageError(f"unsupported URL scheme in {_clip(source)!r}; accepted: {ACCEPTED_SOURCES}.")
        return _read_file(Path(source), f"path {_clip(source, 1024)!r}")  # a path is shown whole
    raise InvalidImageError(f"cannot load an image from a {type(source).__name__} ({_clip(repr(source))}); "
                            f"accepted: {ACCEPTED_SOURCES}.")


def _read_file(path: Path, what: str) -> tuple[bytes, str]:
    # Read the bytes up front so no file handle stays open inside a lazily decoded PIL image.
    try:
        return path.read_bytes(), what
    except FileNotFoundError:
        raise InvalidImageError(f"image file not found: {what}. If this string was meant as image data, "
                                f"pass it as bytes or a base64 data URL; accepted: {ACCEPTED_SOURCES}.") from None
    except IsADirectoryError:
        raise InvalidImageError(f"{what} is a directory, not an image file.") from None
    except OSError as exc:
        raise InvalidImageError(f"cannot read image file {what}: {exc}") from exc
    except ValueError as exc:  # a NUL character, or a lone surrogate the file system cannot encode
        raise InvalidImageError(f"cannot read image file {what}: the path is not a valid file name ({exc}); "
                                f"pass a path without NUL characters or invalid Unicode.") from None


def _file_url_path(url: str) -> Path:
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidImageError(f"file URL {_clip(url)!r} names host {parsed.netloc!r}; only local files "
                                f"('file:///abs/path') are read.")
    return Path(url2pathname(unquote(parsed.path)))


def _decode_data_url(url: str) -> bytes:
    """The bytes of a base64 data URL, decoded a chunk at a time (multimodal/data_url.py): a 30 MiB one
    never holds the GIL for more than a few milliseconds at once."""
    try:
        header, start = split_data_url(url)
    except ValueError:
        header, start = "", -1
    if start < 0 or header[-7:].lower() != ";base64":
        raise InvalidImageError(f"data URL {_clip(url)!r} is not of the form 'data:image/<type>;base64,<data>'; "
                                f"only base64 data URLs are accepted.")
    try:
        return decode_base64(url, start)
    except Base64Error as exc:
        raise InvalidImageError(f"data URL {_clip(url)!r} holds invalid base64 ({exc}).") from None


def _open(data: bytes, what: str) -> Image.Image:
    if not data:
        raise InvalidImageError(f"empty image data from {what}; accepted: {ACCEPTED_SOURCES}.")
    try:
        return Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as exc:
        raise _bomb_error(what, exc) from exc
    except Exception as exc:  # any decoder failure means the data is not a usable image
        raise InvalidImageError(f"cannot identify an image in {what} ({_reason(exc)}); "
                                f"expected encoded PNG/JPEG/WebP/GIF/BMP/TIFF data; accepted: "
                                f"{ACCEPTED_SOURCES}.") from exc


def _check_size(size: tuple[int, int], max_image_pixels: int, what: str) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise InvalidImageError(f"image from {what} has zero size ({width}x{height}).")
    if width * height > max_image_pixels:
        raise InvalidImageError(
            f"image from {what} is {width}x{height} = {width * height} pixels, over the limit of "
            f"{max_image_pixels} pixels; downscale it or raise the setting max_image_pixels "
            f"(flag --max-image-pixels).")


def _decode(image: Image.Image, what: str) -> None:
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise _bomb_error(what, exc) from exc
    except Exception as exc:
        raise InvalidImageError(f"image data from {what} is corrupt or truncated ({_reason(exc)}).") from exc


def _apply_exif_orientation(image: Image.Image) -> Image.Image:
    try:
        orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # unparsable EXIF is common in the wild and must not cost the image
        return image
    if orientation == 1:
        return image  # skip exif_transpose's copy of the whole image
    return ImageOps.exif_transpose(image)


def _bomb_error(what: str, exc: Exception) -> InvalidImageError:
    return InvalidImageError(f"image from {what} was refused by Pillow as a decompression bomb ({exc}); "
                             f"this is Pillow's own limit PIL.Image.MAX_IMAGE_PIXELS, separate from the "
                             f"setting max_image_pixels.")


def _describe(image: Image.Image) -> str:
    return f"PIL image (mode {image.mode}, {image.size[0]}x{image.size[1]})"


def _reason(exc: Exception) -> str:
    """The decoder's complaint, without object reprs."""
    text = without_reprs(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _clip(text: str, limit: int = 64) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
