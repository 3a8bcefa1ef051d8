"""Decode a base64 `data:` URL in bounded steps, so that a 30 MiB one never holds the GIL for long.

`binascii.a2b_base64` (what `base64.b64decode` calls) holds the GIL for the whole payload (0.7 s for
200 MB on the CI machine, every other thread stopped), and a `re.sub` that strips whitespace first
holds it for a pass of the regex engine over every character (0.3 s for 30 MiB). Here the payload is
read `CHUNK_CHARS` characters at a time: each chunk is encoded to ASCII bytes, tried as strict base64
(one C call); only a chunk that fails is cleaned, by `bytes.translate` (whitespace deleted,
base64url's "-" and "_" read as "+" and "/", one C pass), and decoded with the characters it leaves over
carried into the next. Each step is a few milliseconds of C; between them the interpreter hands the
GIL to whichever thread asks (the event loop, the engine thread).

Accepted, as `base64.b64decode(payload, validate=True)` accepts it after whitespace is stripped and
base64url's alphabet mapped: the standard or the URL-safe alphabet (or both), ASCII whitespace
anywhere, padding only at the end and optional (stripped padding is tolerated, as clients strip it).
"""
from __future__ import annotations

import binascii

CHUNK_CHARS = 1 << 20  # base64 characters per C call: ~2 ms with the GIL held (a multiple of 4)
_WHITESPACE = b" \t\n\r\v\f"
_URLSAFE = bytes.maketrans(b"-_", b"+/")


class Base64Error(ValueError):
    """The payload is not base64; the message says where and why."""


def split_data_url(url: str) -> tuple[str, int]:
    """(the header before the first comma, where the payload starts); ValueError without a comma."""
    comma = url.find(",")
    if comma < 0:
        raise ValueError("no comma")
    return url[:comma], comma + 1


def decode_base64(text: str, start: int = 0) -> bytes:
    """The bytes that `text[start:]` encodes in base64 (see the module docstring), a chunk at a time."""
    parts: list[bytes] = []
    carry = b""  # characters of a cleaned chunk past its last whole group of 4
    end = len(text)
    for at in range(start, end, CHUNK_CHARS):
        last = at + CHUNK_CHARS >= end
        try:
            raw = text[at:at + CHUNK_CHARS].encode("ascii")
        except UnicodeEncodeError as e:
            raise Base64Error(f"a non-ASCII character at payload position {at - start + e.start}") from None
        if not carry and not last and not raw.endswith(b"="):
            try:  # strict first: a well-formed chunk is one C call
                parts.append(binascii.a2b_base64(raw, strict_mode=True))
                continue
            except binascii.Error:
                pass
        raw = carry + raw.translate(_URLSAFE, _WHITESPACE)
        if last:
            raw += b"=" * (-len(raw) % 4)  # tolerate stripped padding
            carry = b""
        else:
            cut = len(raw) - len(raw) % 4
            if cut and raw[cut - 1] == 0x3D:  # padding ("="): valid only at the end, told by what follows
                cut -= 4
            raw, carry = raw[:cut], raw[cut:]
        try:
            parts.append(binascii.a2b_base64(raw, strict_mode=True))
        except binascii.Error as e:
            raise Base64Error(f"{e} (in the characters at payload positions {at - start}..{at - start + CHUNK_CHARS})") \
                from None
    return b"".join(parts)
