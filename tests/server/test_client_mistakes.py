"""Every client mistake the red-team pass found answered with a 500, a text/plain body or a traceback
in the log (issue 18, point 4), sent as raw bytes: each gets a 4xx in OpenAI's error shape, nothing
is logged with a traceback, and the server goes on serving. The body-level cases of
test_server_errors.py stay there; this is the list of the wire- and JSON-level ones."""
import gzip
import json
import logging

import pytest

from server_helpers import API_KEY, post, post_bytes, raw_http
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import MediaPolicy, ServerConfig

MAX_BODY = 1 << 20
GOOD = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def srv(tiny_ckpt, tmp_path_factory):
    media = MediaPolicy(allowed_local_path=str(tmp_path_factory.mktemp("media")))
    config = ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny", max_request_bytes=MAX_BODY, media=media)
    with BackgroundServer(tiny_ckpt, config, num_blocks=16) as s:
        yield s


def _json_with(text: str) -> bytes:
    """GOOD with `text` spliced in verbatim as the user's content (escapes and all)."""
    return b'{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"' + text.encode() + b'"}]}'


def _nested(depth: int) -> bytes:
    return b'{"model":"tiny","max_tokens":2,"messages":' + b"[" * depth + b"]" * depth + b"}"


REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
BODY = json.dumps(GOOD).encode()
# (name, bytes on the wire, status, code, param)
CASES = [
    # aiohttp's own parser: answered before routing, auth or middleware
    ("bad_request_line", b"GE T / HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request", None),
    ("tls_on_http_port", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 32 + b"\r\n\r\n", 400,
     "malformed_request", None),
    ("bad_header_name", REQUEST + b"Bad Header: y\r\n\r\n", 400, "malformed_request", None),
    ("control_char_in_authorization", REQUEST + b"Authorization: Bearer \x01" + API_KEY.encode() + b"\r\n\r\n",
     400, "malformed_request", None),
    ("header_line_too_long", REQUEST + b"X-Long: " + b"a" * 9000 + b"\r\n\r\n", 400, "malformed_request", None),
    ("too_many_headers", REQUEST + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n", 400,
     "malformed_request", None),
    ("bad_content_length", REQUEST + b"Content-Length: abc\r\n\r\n", 400, "malformed_request", None),
    ("bad_chunk_size", REQUEST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n", 400,
     "malformed_request", None),
    ("non_utf8_path", b"GET /v1/mo\xffdels HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request", None),
    # headers the parser accepts: decoded with surrogates, which must never be re-encoded strictly
    ("authorization_not_utf8", post_bytes(BODY, key=API_KEY.encode() + b"\xff"), 401, "invalid_api_key", None),
    ("authorization_non_ascii", post_bytes(BODY, key=API_KEY + "\u00e9"), 401, "invalid_api_key", None),
    # the body
    ("content_length_over_limit", REQUEST + b"Authorization: Bearer " + API_KEY.encode()
     + b"\r\nContent-Length: 999999999999\r\n\r\n{", 413, "request_too_large", None),
    ("gzip_body_not_gzip", post_bytes(BODY, extra=b"Content-Encoding: gzip\r\n"), 400, None, None),
    ("json_nested_5000", post_bytes(_nested(5000)), 400, "json_too_deep", None),
    ("json_nested_100", post_bytes(_nested(100)), 400, "json_too_deep", "messages"),
    ("integer_5000_digits", post_bytes(BODY[:-1] + b', "seed": ' + b"1" * 5000 + b"}"), 400, None, None),
    ("lone_surrogate_escape", post_bytes(_json_with("a\\ud800b")), 400, "invalid_unicode", "messages"),
    ("lone_surrogate_cesu8_bytes", post_bytes(_json_with("a").replace(b'"a"', b'"a\xed\xa0\x80"')), 400, None,
     None),
    ("utf16_body", post_bytes(BODY.decode().encode("utf-16")), 400, None, None),
    ("lone_surrogate_in_key", post_bytes(b'{"model":"tiny","messages":[{"role":"user","content":"hi",'
                                         b'"\\udfff":1}]}'), 400, "invalid_unicode", "messages"),
    ("file_url_with_nul", post_bytes(json.dumps({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///x%00.png"}}]}]}).encode()), 400, "invalid_image",
     "messages"),
]


@pytest.mark.parametrize("name, data, status, code, param", CASES, ids=[c[0] for c in CASES])
def test_client_mistake_is_a_4xx_in_openai_shape(srv, caplog, name, data, status, code, param):
    with caplog.at_level(logging.DEBUG):
        got, body, _ = raw_http(srv.url, data)
    assert got == status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == (
        "authentication_error" if status == 401 else "invalid_request_error")
    assert (err["code"], err["param"]) == (code, param), err
    assert "Traceback" not in err["message"] and "\n" not in err["message"]
    tracebacks = [r for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    assert post(srv.url, GOOD)[0] == 200


def test_a_valid_gzip_body_is_still_accepted(srv):
    assert raw_http(srv.url, post_bytes(gzip.compress(BODY), extra=b"Content-Encoding: gzip\r\n"))[0] == 200


def test_protocol_errors_are_counted_in_metrics(srv):
    raw_http(srv.url, CASES[0][1])
    status, text, _ = raw_http(srv.url, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 200 and 'vlm_sdk_request_errors_total{model_name="tiny",status="400"}' in text


def test_bearer_scheme_is_case_insensitive(srv):
    for header in (f"bearer {API_KEY}", f"BEARER {API_KEY}", f"Bearer   {API_KEY} "):
        assert raw_http(srv.url, post_bytes(BODY, key=None, extra=f"Authorization: {header}\r\n".encode()))[0] == 200
    for header in (f"Basic {API_KEY}", f"Bearer{API_KEY}", API_KEY):
        status, body, _ = raw_http(srv.url, post_bytes(BODY, key=None, extra=f"Authorization: {header}\r\n".encode()))
        assert status == 401 and body["error"]["code"] == "invalid_api_key", header
