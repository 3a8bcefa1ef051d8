"""A chat request's body, from the socket to a JSON value the handlers can walk safely.

Declared JSON (`Content-Type: application/json`, else 415) and bounded before any work: a `Content-Length` over the limit is refused (413) before a byte is read,
the whole body must arrive within `body_timeout` (408; a slow sender otherwise holds a connection and
a handler forever). Then JSON that is well-formed but unusable is refused with a 400 too, instead of
failing deep inside the server: nesting deeper than `MAX_JSON_DEPTH` (Python's decoder stops near
1,000 levels with a RecursionError, and everything that walks the value afterwards would recurse as
deep), integers longer than Python converts (ValueError), and strings holding lone surrogates (a
`\\ud800` escape, or CESU-8 bytes, which `json.loads` passes through; no tokenizer can encode them).

`json.loads` holds the GIL for the whole body: about 1 µs per value, so a 28 MB object of 2,000,000
keys would stop every other client for 2 s wherever it is parsed. A large body's values are counted
first (`count_values`: its separators outside strings, a MiB at a time with the GIL given back
between, stopping past the limit) and a body with more than `max_values` is refused unparsed; one
within the limit is parsed in pieces (server/json_pieces.py: one C call per member of the top
levels), so that the GIL changes hands while it is.
"""
from __future__ import annotations

import asyncio
import json
import re

from aiohttp import web

from vlm_sdk.server.json_pieces import loads_in_pieces
from vlm_sdk.server.protocol import APIError, bad_request

# a chat request needs 6 levels (body, messages, message, content, part, image_url); fields we ignore
# (metadata, response_format schemas) get room to spare
MAX_JSON_DEPTH = 64
# bodies above this are decoded off the loop: a 20 MB base64 image takes tens of ms to parse
_INLINE_JSON_BYTES = 256 * 1024
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes (server "
                         f"setting --max-request-bytes); send smaller or fewer images",
                    "invalid_request_error", None, "request_too_large")


def check_json_content_type(request: web.Request) -> None:
    """415 unless the body is declared JSON: a form or plain-text body is not read as JSON, as vLLM
    refuses it (aiohttp reports a missing Content-Type as application/octet-stream)."""
    if request.content_type != "application/json":
        given = request.headers.get("Content-Type")
        raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json', got "
                            f"{'no Content-Type' if given is None else repr(one_line(given, 80))}",
                       "invalid_request_error", None, "unsupported_media_type")


async def read_json(request: web.Request, max_bytes: int, timeout_s: float, max_values: int | None = None):
    """The decoded body of `request`, or an APIError (400, 408, 413, 415) that says what to fix. A body
    larger than `_INLINE_JSON_BYTES` holding more than `max_values` JSON values is refused before it is
    parsed (a smaller one cannot hold that many)."""
    length = request.content_length
    if length is not None and length > max_bytes:
        raise too_large(max_bytes)
    check_json_content_type(request)
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)  # 413 past client_max_size (chunked bodies)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s (server setting "
                            f"--body-timeout)", "invalid_request_error", None, "request_timeout") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large(max_bytes) from None
    except web.RequestPayloadError as e:  # a broken chunked encoding, gzip stream or short body
        raise bad_request(f"the request body could not be read: {one_line(str(e))}") from None
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    if len(raw) > _INLINE_JSON_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, decode_json, raw, max_values)
    return decode_json(raw)


_CHUNK = 1 << 20


def count_values(raw: bytes, limit: int) -> int:
    """The JSON values of `raw`, as its commas and colons outside strings + 1 (each separates two), or
    a count past `limit` as soon as it is reached. A chunk at a time (never cut after a backslash, so
    no escape is split), each a few short C calls: the GIL goes back to the loop between them."""
    count, inside, start, n = 1, False, 0, len(raw)
    while start < n:
        end = min(start + _CHUNK, n)
        while end < n and raw[end - 1] == 0x5C:
            end += 1
        parts = raw[start:end].replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')
        outside = b"".join(parts[1::2] if inside else parts[0::2])
        count += outside.count(b",") + outside.count(b":")
        inside ^= (len(parts) - 1) % 2 == 1
        if count > limit:
            return count
        start = end
    return count


def too_many_values(limit: int) -> APIError:
    return bad_request(f"the request body holds more than {limit} JSON values (server setting --max-json-values); "
                       f"a chat request needs a few per message: send fewer entries", None, "too_many_json_values")


def decode_json(raw: bytes, max_values: int | None = None):
    if max_values is not None and count_values(raw, max_values) > max_values:
        raise too_many_values(max_values)
    try:
        # UTF-8 only (RFC 8259): json.loads(bytes) would also take UTF-16/32 and pass CESU-8 surrogates
        text = raw.decode("utf-8-sig")
        value = json.loads(text) if len(raw) <= _INLINE_JSON_BYTES else loads_in_pieces(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") \
            from None
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text; send a JSON object") from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:  # an integer past sys.get_int_max_str_digits()
        raise bad_request(f"the request body holds a number JSON cannot carry here: {one_line(str(e))}") from None
    # a lone surrogate can now only come from a \uD800-\uDFFF escape: most bodies have none
    check_tree(value, strings=_SURROGATE_ESCAPE.search(text) is not None)
    return value


def check_tree(value, strings: bool = True) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH and (with `strings`) strings that are not valid
    Unicode; `param` is the top-level field the problem is under. Level by level with comprehensions,
    not recursion: the value may be 1,000 levels deep or hold millions of numbers."""
    fields = value.items() if isinstance(value, dict) else [(None, value)]
    kept = (dict, list, str) if strings else (dict, list)  # numbers, booleans and null need no look
    for field, top in fields:
        if strings and isinstance(field, str):
            _check_strings([field], None)  # a broken name cannot be the param
        level, depth = [top] if type(top) in kept else [], 2 if isinstance(value, dict) else 1
        while level:
            if strings:
                _check_strings([x for x in level if type(x) is str], field)
                level = [x for x in level if type(x) is not str]
            if level and depth > MAX_JSON_DEPTH:
                raise _too_deep(field)
            below = []
            for node in level:
                if type(node) is dict:
                    if strings:
                        _check_strings(list(node), field)
                    node = node.values()
                below += [x for x in node if type(x) in kept]
            level, depth = below, depth + 1


def _check_strings(texts: list, field: str | None) -> None:
    for text in texts:
        if not text.isascii() and _SURROGATE.search(text):
            raise bad_request(f"a string under {field or 'the body'!r} holds a lone UTF-16 surrogate (such as "
                              f"\\ud800), which is not a Unicode character; send valid UTF-8 text", field,
                              "invalid_unicode")


def _too_deep(field: str | None = None) -> APIError:
    return bad_request(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep; a "
                       f"chat request needs 6", field, "json_too_deep")


def one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
