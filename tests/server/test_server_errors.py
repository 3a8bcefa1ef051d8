"""A user's mistake over HTTP: each bad request gets its own status, OpenAI's error shape and a message
that says what to fix; the next good request is served; no KV block is left behind."""
import base64
import json

import pytest

from helpers import image
from server_helpers import API_KEY, data_url, get, image_message, post, sse_events
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

BLOCKS = 6  # 96 tokens: a 400x300 image does not fit, a small one does
LIMIT_IMAGES = 3
MAX_BODY = 1024 * 1024


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    config = ServerConfig(port=0, api_key=API_KEY, limit_images=LIMIT_IMAGES, max_request_bytes=MAX_BODY,
                          served_model_name="tiny")
    with BackgroundServer(tiny_ckpt, config, num_blocks=BLOCKS, allow_unfit_images=True) as s:
        yield s


SMALL = data_url(image(64, 48, 1))
GOOD = {"model": "tiny", "messages": image_message(SMALL, "hi"), "max_tokens": 3, "temperature": 0}


def _with(**fields):
    body = dict(GOOD)
    body.update(fields)
    return body


def _raw(text: str) -> bytes:
    return text.encode()


PNG_NOT = "data:image/png;base64," + base64.b64encode(b"this is not an image at all").decode()
# (name, body or raw bytes, status, code or None, param or None, words the message must contain)
CASES = [
    ("invalid_json", _raw('{"model": "tiny", "messages": ['), 400, None, None, ["not valid JSON", "line 1"]),
    ("body_is_array", _raw("[1, 2]"), 400, None, None, ["JSON object", "array"]),
    ("empty_body", _raw(""), 400, None, None, ["empty"]),
    ("not_utf8", b"\xff\xfe{", 400, None, None, ["UTF-8"]),
    ("missing_model", {"messages": GOOD["messages"]}, 400, None, "model", ["'model' is required", "'tiny'"]),
    ("unknown_model", _with(model="gpt-4o"), 404, "model_not_found", "model", ["gpt-4o", "does not exist", "'tiny'"]),
    ("missing_messages", {"model": "tiny"}, 400, None, "messages", ["'messages'", "non-empty"]),
    ("empty_messages", _with(messages=[]), 400, None, "messages", ["non-empty"]),
    ("message_without_role", _with(messages=[{"content": "hi"}]), 400, None, None, ["message 0", "'role'"]),
    ("bad_role", _with(messages=[{"role": "robot", "content": "hi"}]), 400, None, None, ["'robot'", "supported roles"]),
    ("bad_part_type", _with(messages=[{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]), 400,
     None, None, ["'audio'", "supported"]),
    ("nan_temperature", _raw(json.dumps(GOOD)[:-1] + ', "temperature": NaN}'), 400, None, "temperature",
     ["finite"]),
    ("negative_temperature", _with(temperature=-0.5), 400, None, "temperature", [">= 0"]),
    ("top_p_zero", _with(top_p=0), 400, None, "top_p", ["(0, 1]"]),
    ("top_p_above_one", _with(top_p=1.5), 400, None, "top_p", ["(0, 1]"]),
    ("negative_max_tokens", _with(max_tokens=-1), 400, None, "max_tokens", [">= 1"]),
    ("string_max_tokens", _with(max_tokens="ten"), 400, None, "max_tokens", ["integer", "'ten'"]),
    ("infinite_top_k", _raw(json.dumps(GOOD)[:-1] + ', "top_k": Infinity}'), 400, None, "top_k", ["integer"]),
    ("logprobs_not_bool", _with(logprobs=3), 400, None, "logprobs", ["true or false"]),
    ("top_logprobs_alone", _with(top_logprobs=2), 400, None, "top_logprobs", ["'logprobs': true"]),
    ("top_logprobs_21", _with(logprobs=True, top_logprobs=21), 400, None, "top_logprobs", ["0 to 20", "21"]),
    ("presence_penalty_3", _with(presence_penalty=3), 400, None, "presence_penalty", ["-2 to 2"]),
    ("frequency_penalty_str", _with(frequency_penalty="x"), 400, None, "frequency_penalty", ["-2 to 2"]),
    ("repetition_penalty_0", _with(repetition_penalty=0), 400, None, "repetition_penalty", ["> 0"]),
    ("negative_min_tokens", _with(min_tokens=-1), 400, None, "min_tokens", [">= 0"]),
    ("logit_bias_word_key", _with(logit_bias={"hi": 1}), 400, None, "logit_bias", ["token ids", "'hi'"]),
    ("logit_bias_101", _with(logit_bias={"5": 101}), 400, None, "logit_bias", ["-100 to 100"]),
    ("n_above_max_n", _with(n=9), 400, "too_many_choices", "n", ["at most 8", "--max-n"]),
    ("n_zero", _with(n=0), 400, None, "n", [">= 1"]),
    ("bad_stop", _with(stop=5), 400, None, "stop", ["'stop'"]),
    ("bad_seed", _with(seed="x"), 400, None, "seed", ["integer"]),
    ("seed_out_of_range", _with(seed=2 ** 64), 400, None, "seed", ["'seed'", str(2 ** 63 - 1)]),
    ("seed_past_int64", _with(seed=2 ** 63), 400, None, "seed", ["'seed'", str(-(2 ** 63)), str(2 ** 63 - 1)]),
    ("stream_not_bool", _with(stream="yes"), 400, None, "stream", ["true or false"]),
    ("bad_base64", _with(messages=image_message("data:image/png;base64,@@@@")), 400, "invalid_image", "messages",
     ["invalid base64"]),
    ("not_an_image", _with(messages=image_message(PNG_NOT)), 400, "invalid_image", "messages",
     ["cannot identify an image"]),
    ("too_many_images", _with(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": SMALL}}] * (LIMIT_IMAGES + 1)}]), 400, "too_many_images",
     "messages", [str(LIMIT_IMAGES + 1), f"at most {LIMIT_IMAGES}", "--limit-images"]),
    ("prompt_too_long", _with(messages=image_message(data_url(image(400, 300, 5)))), 400,
     "context_length_exceeded", "messages", ["prompt is", f"{BLOCKS * 16} tokens", "num_blocks=", "max_pixels="]),
    ("bad_max_pixels", _with(messages=image_message(SMALL, max_pixels=-4)), 400, None, "max_pixels",
     ["max_pixels", "positive integer"]),
    ("http_url_not_allowed", _with(messages=image_message("http://169.254.169.254/latest/meta-data")), 400,
     "invalid_image", "messages", ["169.254.169.254", "--allowed-media-domains"]),
    ("local_path", _with(messages=image_message("/etc/passwd")), 400, "invalid_image", "messages",
     ["data:", "file://"]),
    ("file_url_not_allowed", _with(messages=image_message("file:///etc/passwd")), 400, "invalid_image", "messages",
     ["--allowed-local-media-path"]),
    ("too_large", _with(messages=image_message("data:image/png;base64," + "A" * MAX_BODY)), 413,
     "request_too_large", None, [str(MAX_BODY), "--max-request-bytes"]),
    ("stream_with_bad_image", _with(stream=True, messages=image_message(PNG_NOT)), 400, "invalid_image", "messages",
     ["cannot identify"]),
]


def _check_error(status, body, want_status, code, param, words):
    assert status == want_status, body
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["param"] == param, err
    assert err["type"] == ("authentication_error" if status == 401 else "invalid_request_error")
    for word in words:
        assert word in err["message"], (word, err["message"])
    # never an internal repr or address
    assert " object at 0x" not in err["message"] and "Traceback" not in err["message"]


def _good_request_works(srv):
    status, body = post(srv.url, GOOD)
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("name, body, status, code, param, words", CASES, ids=[c[0] for c in CASES])
def test_bad_request_then_good_one(srv, name, body, status, code, param, words):
    if isinstance(body, bytes):
        got_status, got = post(srv.url, None, raw=body)
    else:
        got_status, got = post(srv.url, body)
    _check_error(got_status, got, status, code, param, words)
    _good_request_works(srv)


def test_auth_and_routes(srv):
    for key in (None, "wrong-key"):
        status, body = post(srv.url, GOOD, key=key)
        _check_error(status, body, 401, "invalid_api_key", None, ["API key", "--api-key"])
        _good_request_works(srv)
    status, text = get(srv.url, "/v1/models", key="wrong")
    assert status == 401
    status, text = get(srv.url, "/v1/embeddings")
    _check_error(status, json.loads(text), 404, "not_found", None, ["/v1/embeddings"])
    status, text = get(srv.url, "/v1/completions")  # served, but only as POST
    _check_error(status, json.loads(text), 405, None, None, ["GET /v1/completions"])
    # health and metrics stay open without the key, as in vLLM
    assert get(srv.url, "/health", key=None)[0] == 200
    assert get(srv.url, "/metrics", key=None)[0] == 200


def test_errors_leave_no_blocks_and_are_counted(srv):
    for name, body, *_ in CASES[:5]:
        post(srv.url, None, raw=body) if isinstance(body, bytes) else post(srv.url, body)
    _good_request_works(srv)
    stats = srv.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    status, text = get(srv.url, "/metrics")
    assert 'vlm_sdk_request_errors_total{model_name="tiny",status="400"}' in text


def test_stream_good_request_after_errors(srv):
    status, text = post(srv.url, _with(stream=True, stream_options={"include_usage": True}))
    assert status == 200
    events = sse_events(text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] >= 1
    assert srv.stats()["kv_blocks_used"] == 0
