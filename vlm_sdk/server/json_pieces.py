"""`json.loads` for a large body, in pieces, so that the GIL changes hands while it is parsed.

The C decoder holds the GIL for a whole call: a 2 MB body of 10,000 tool definitions (~200,000 values)
stopped every other stream for ~0.2 s wherever it was parsed (issue 41 row 7). Here the containers of
the top `PIECE_DEPTH` levels (the body, its `messages` / `tools` / `prompt` arrays, one message, one
tool) are walked in Python and each of their members is parsed by one `raw_decode` call: the
interpreter can hand the GIL over between two members (every `sys.getswitchinterval()`), and no single
call parses more than one member. What comes out equals `json.loads(text)`, errors included (the same
`json.JSONDecodeError` messages and positions, duplicate keys keeping the last value).
"""
from __future__ import annotations

import json
import re

PIECE_DEPTH = 4  # levels walked in Python; below, one C call per member
_SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace (json.decoder.WHITESPACE)
_DECODER = json.JSONDecoder()  # stateless: raw_decode keeps nothing between calls


def loads_in_pieces(text: str):
    """The value of the JSON document `text`, as json.loads(text) gives it."""
    if text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    value, end = _value(text, _skip(text, 0), 1)
    end = _skip(text, end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _skip(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def _value(text: str, pos: int, depth: int):
    """(value, end) of the value starting at `pos` (no whitespace before it)."""
    head = text[pos:pos + 1]
    if depth > PIECE_DEPTH or head not in ("{", "["):
        return _DECODER.raw_decode(text, pos)
    return (_object if head == "{" else _array)(text, pos + 1, depth)


def _object(text: str, pos: int, depth: int):
    out: dict = {}
    pos = _skip(text, pos)
    if text[pos:pos + 1] == "}":
        return out, pos + 1
    while True:
        if text[pos:pos + 1] != '"':
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, pos)
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _skip(text, pos)
        if text[pos:pos + 1] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
        pos = _skip(text, pos + 1)
        if pos >= len(text):
            raise json.JSONDecodeError("Expecting value", text, pos)
        out[key], pos = _value(text, pos, depth + 1)
        pos = _skip(text, pos)
        sep = text[pos:pos + 1]
        if sep == "}":
            return out, pos + 1
        if sep != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        pos = _skip(text, pos + 1)  # a trailing comma fails on the next round, as json.loads fails


def _array(text: str, pos: int, depth: int):
    out: list = []
    pos = _skip(text, pos)
    if text[pos:pos + 1] == "]":
        return out, pos + 1
    while True:
        if pos >= len(text):
            raise json.JSONDecodeError("Expecting value", text, pos)
        item, pos = _value(text, pos, depth + 1)
        out.append(item)
        pos = _skip(text, pos)
        sep = text[pos:pos + 1]
        if sep == "]":
            return out, pos + 1
        if sep != ",":
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
        pos = _skip(text, pos + 1)
