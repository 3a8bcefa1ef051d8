"""Base64 data URLs decoded a chunk at a time (multimodal/data_url.py): the same bytes as
`base64.b64decode` after whitespace is stripped, the same refusals, at every chunk boundary."""
import base64
import os
import re
import threading
import time

import pytest

from vlm_sdk.multimodal import data_url
from vlm_sdk.multimodal.data_url import Base64Error, decode_base64


def _reference(text: str) -> bytes:
    """What the decoder replaced did: whitespace stripped by a regex, padding restored, strict base64."""
    text = re.sub(r"\s+", "", text)
    text += "=" * (-len(text) % 4)
    if "-" in text or "_" in text:
        return base64.b64decode(text, altchars=b"-_", validate=True)
    return base64.b64decode(text, validate=True)


def _cases() -> dict[str, str]:
    data = os.urandom(301)
    std, url = base64.b64encode(data).decode(), base64.urlsafe_b64encode(data).decode()
    return {"standard": std, "url-safe": url, "no padding": std.rstrip("="),
            "newlines every 76": "\n".join(std[i:i + 76] for i in range(0, len(std), 76)),
            "spaces and tabs everywhere": " \t".join(std), "trailing whitespace after padding": std + " \r\n\t",
            "one byte": base64.b64encode(b"x").decode(), "empty": ""}


@pytest.mark.parametrize("chunk", [4, 8, 12, 76, data_url.CHUNK_CHARS])
def test_same_bytes_as_b64decode_at_every_chunk_size(monkeypatch, chunk):
    monkeypatch.setattr(data_url, "CHUNK_CHARS", chunk)
    for name, text in _cases().items():
        assert decode_base64(text) == _reference(text), name
        assert decode_base64("data:image/png;base64," + text, len("data:image/png;base64,")) == _reference(text), name


@pytest.mark.parametrize("chunk", [4, 8, 12, data_url.CHUNK_CHARS])
@pytest.mark.parametrize("bad", ["QUJD@RUY=", "QUJD=RUY=", "QUJDRA==RUZH", "QUJDR", "=QUJD", "QUJD\u00e9RUY="])
def test_same_refusals_as_b64decode(monkeypatch, chunk, bad):
    monkeypatch.setattr(data_url, "CHUNK_CHARS", chunk)
    with pytest.raises(ValueError):  # binascii.Error is a ValueError
        _reference(bad)
    with pytest.raises(Base64Error):
        decode_base64(bad)


def test_a_30_mib_payload_never_holds_the_gil_for_long():
    """Another thread keeps running while 30 MiB of base64 (newlines included) is decoded: the longest
    it waits for the GIL is a few chunks' C calls, not the whole payload's (0.3 s of regex and 0.1 s of
    b64decode before). No wall-clock bound here: the count of its wake-ups during the decode is."""
    raw = os.urandom(22 << 20)
    text = base64.encodebytes(raw).decode()  # a newline every 76 characters: the cleaning path throughout
    ticks: list[float] = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)
    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.01)
    t0 = time.perf_counter()
    out = decode_base64(text)
    t1 = time.perf_counter()
    stop.set()
    thread.join()
    assert out == raw
    chunks = len(text) // data_url.CHUNK_CHARS
    woke = sum(t0 < t < t1 for t in ticks)
    assert woke >= chunks // 4, f"the other thread woke {woke} times during {chunks} chunks ({t1 - t0:.2f} s)"
