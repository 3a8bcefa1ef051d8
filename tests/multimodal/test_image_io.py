"""load_image: every source type, every PIL mode to RGB, the header-only pixel limit, clear errors."""
from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from vlm_sdk.errors import InvalidImageError
from vlm_sdk.multimodal.image_io import load_image, to_rgb


def _rgb(h: int = 24, w: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)  # [h, w, 3]


def _png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but whose pixel data is garbage: decoding would fail."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"not zlib") + chunk(b"IEND", b"")


def _transformers_rgb(image: Image.Image) -> np.ndarray:
    convert_to_rgb = pytest.importorskip("transformers.image_transforms").convert_to_rgb
    return convert_to_rgb(image, return_numpy=True)  # [h, w, 3] uint8


def test_every_source_type_gives_the_same_pixels(tmp_path):
    pixels = _rgb()
    data = _png_bytes(Image.fromarray(pixels))
    path = tmp_path / "img dir" / "photo.png"  # a space, so the file URL needs percent-encoding
    path.parent.mkdir()
    path.write_bytes(data)
    data_url = "data:image/png;base64," + base64.b64encode(data).decode()
    sources = {
        "pil": Image.fromarray(pixels),
        "opened pil": Image.open(path),
        "str path": str(path),
        "Path": path,
        "bytes": data,
        "bytearray": bytearray(data),
        "data URL": data_url,
        "data URL, no padding": data_url.rstrip("="),
        "file URL": path.as_uri(),
    }
    for name, source in sources.items():
        image = load_image(source)
        assert image.mode == "RGB", name
        np.testing.assert_array_equal(np.asarray(image), pixels, err_msg=name)


def test_rgba_composited_on_white_like_transformers():
    rgba = np.concatenate([_rgb(), np.zeros((24, 32, 1), np.uint8)], axis=-1)  # [24, 32, 4]
    rgba[..., 3] = np.arange(32, dtype=np.uint8)[None, :] * 8  # alpha 0 .. 248 across the columns
    rgba[0, 0, 3], rgba[0, 1, 3] = 0, 255
    image = Image.fromarray(rgba, mode="RGBA")
    out = np.asarray(load_image(image))
    assert out[0, 0].tolist() == [255, 255, 255]  # fully transparent -> white
    assert out[0, 1].tolist() == rgba[0, 1, :3].tolist()  # opaque -> unchanged
    np.testing.assert_array_equal(out, _transformers_rgb(image))
    np.testing.assert_array_equal(np.asarray(load_image(_png_bytes(image))), out)


def test_la_and_palette_with_transparency_match_transformers():
    rng = np.random.default_rng(1)
    la = Image.fromarray(rng.integers(0, 256, (16, 20, 2), dtype=np.uint8), mode="LA")
    np.testing.assert_array_equal(np.asarray(load_image(la)), _transformers_rgb(la))

    palette = Image.fromarray(_rgb(16, 20, seed=2)).quantize(colors=16)
    assert palette.mode == "P"
    np.testing.assert_array_equal(np.asarray(load_image(palette)), np.asarray(palette.convert("RGB")))
    palette.info["transparency"] = int(np.asarray(palette)[0, 0])  # one palette index is transparent
    reloaded = Image.open(io.BytesIO(_png_bytes(palette)))
    assert reloaded.mode == "P" and reloaded.info.get("transparency") is not None
    out = np.asarray(load_image(reloaded))
    assert out[0, 0].tolist() == [255, 255, 255]
    np.testing.assert_array_equal(out, _transformers_rgb(Image.open(io.BytesIO(_png_bytes(palette)))))


def test_gray_and_cmyk_convert():
    gray = np.random.default_rng(3).integers(0, 256, (8, 9), dtype=np.uint8)  # [8, 9]
    out = np.asarray(load_image(Image.fromarray(gray, mode="L")))
    assert out.shape == (8, 9, 3)
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], gray)

    cmyk = Image.new("CMYK", (4, 3), (0, 255, 0, 0))  # full magenta ink
    assert np.asarray(load_image(cmyk))[0, 0].tolist() == [255, 0, 255]


def test_sixteen_bit_scaled_not_clipped():
    values = np.array([[0, 32768, 65535, 257, 300]], dtype=np.uint16)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    for source in (image, _png_bytes(image)):
        out = np.asarray(load_image(source))
        assert out[..., 0].tolist() == [[0, 128, 255, 1, 1]]  # PIL's own convert would give 255 for 300
        assert (out[..., 0] == out[..., 2]).all()
    as_int32 = Image.fromarray(values.astype(np.int32))  # "I": how some decoders hand over 16-bit data
    assert as_int32.mode == "I"
    assert np.asarray(load_image(as_int32))[..., 0].tolist() == [[0, 128, 255, 1, 1]]


def test_float_image_in_unit_range():
    image = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))
    assert image.mode == "F"
    assert np.asarray(load_image(image))[..., 0].tolist() == [[0, 128, 255]]


def test_exif_orientation_applied():
    yy, xx = np.mgrid[0:30, 0:50]
    smooth = np.stack([xx * 5, yy * 8, (xx + yy) * 3], axis=-1).astype(np.uint8)  # [30, 50, 3]
    upright = Image.fromarray(smooth)  # 50 wide, 30 tall; smooth so that JPEG keeps it close
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # what a camera held sideways writes
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display", undone by exif_transpose's ROTATE_270
    buf = io.BytesIO()
    stored.save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    assert Image.open(io.BytesIO(buf.getvalue())).size == (30, 50)
    loaded = load_image(buf.getvalue())
    assert loaded.size == (50, 30)
    got = np.asarray(loaded, dtype=np.int16)
    assert np.abs(got - smooth).mean() < 3  # JPEG is lossy: close, not equal
    wrong = np.asarray(stored.transpose(Image.Transpose.ROTATE_90), dtype=np.int16)  # the other direction
    assert np.abs(got - wrong).mean() > 30


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@pytest.mark.timing  # a wall-clock bound: run alone
def test_pixel_limit_checked_from_header_before_decoding(monkeypatch):
    decoded = []
    original_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self) or original_load(self))
    start = time.perf_counter()
    with pytest.raises(InvalidImageError) as info:
        load_image(_png_header_only(10000, 10000), max_image_pixels=1_000_000)
    assert time.perf_counter() - start < 1.0
    assert decoded == []  # refused from the header: the (garbage) pixel data was never decoded
    msg = str(info.value)
    assert "10000x10000" in msg and "100000000" in msg and "1000000" in msg and "max_image_pixels" in msg


def test_pixel_limit_on_pil_input_and_default_is_generous():
    image = Image.fromarray(_rgb(100, 100))
    with pytest.raises(InvalidImageError, match="max_image_pixels"):
        load_image(image, max_image_pixels=9_999)
    assert load_image(image, max_image_pixels=10_000).size == (100, 100)


def test_garbage_bytes():
    with pytest.raises(InvalidImageError) as info:
        load_image(b"GIF89 this is not an image at all")
    msg = str(info.value)
    assert "33 bytes" in msg and "GIF89" in msg and "cannot identify" in msg and "data URL" in msg


def test_truncated_image_fails_at_load_time():
    data = _png_bytes(Image.fromarray(_rgb(64, 64)))
    with pytest.raises(InvalidImageError, match="corrupt or truncated"):
        load_image(data[: len(data) // 2])


def test_empty_bytes_and_zero_size():
    with pytest.raises(InvalidImageError, match="empty image data"):
        load_image(b"")
    with pytest.raises(InvalidImageError, match="zero size"):
        load_image(Image.new("RGB", (0, 5)))


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.png"
    for source in (missing, str(missing), missing.as_uri()):
        with pytest.raises(InvalidImageError) as info:
            load_image(source)
        assert "not found" in str(info.value) and "nope.png" in str(info.value)


def test_bad_base64():
    with pytest.raises(InvalidImageError) as info:
        load_image("data:image/png;base64,@@@not*base64@@@")
    assert "invalid base64" in str(info.value) and "data:image/png" in str(info.value)
    with pytest.raises(InvalidImageError, match="base64 data URLs"):
        load_image("data:image/png,rawpercentencoded")


def test_unknown_source_type():
    with pytest.raises(InvalidImageError) as info:
        load_image(42)
    msg = str(info.value)
    assert "int" in msg and "42" in msg and "PIL.Image.Image" in msg and "bytes" in msg


def test_remote_url_refused_without_network():
    with pytest.raises(InvalidImageError) as info:
        load_image("https://example.com/cat.png")
    msg = str(info.value)
    assert "example.com/cat.png" in msg and "does not fetch remote URLs" in msg and "data URL" in msg


def test_error_is_a_value_error():
    with pytest.raises(ValueError):
        load_image(object())


def test_to_rgb_returns_rgb_unchanged():
    image = Image.fromarray(_rgb())
    assert to_rgb(image) is image
