"""`vlm-sdk serve` logs one line per request (client, method, path, status, prompt and completion tokens,
seconds) once it is answered, a stream once it ended; `--disable-log-requests` (vLLM's flag) turns it off."""
from __future__ import annotations

import logging
import re

import pytest

from server_helpers import API_KEY, get, post
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

LINE = re.compile(r"^(\S+) (GET|POST) (\S+) (\d{3}) (prompt_tokens=(\d+) completion_tokens=(\d+)|-) (\d+\.\d{3}) s$")


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY), num_blocks=64) as s:
        yield s


def _lines(caplog) -> list[re.Match]:
    records = [r for r in caplog.records if r.name == "vlm_sdk.server" and r.levelno == logging.INFO]
    matches = [LINE.match(r.getMessage()) for r in records]
    assert all(matches), [r.getMessage() for r in records]
    return matches


def test_one_line_per_request_with_its_tokens(srv, caplog):
    caplog.set_level(logging.INFO, logger="vlm_sdk.server")
    messages = [{"role": "user", "content": "Hello"}]
    status, body = post(srv.url, {"model": srv.model_name, "messages": messages, "max_tokens": 5, "ignore_eos": True})
    assert status == 200
    status, _ = post(srv.url, {"model": srv.model_name, "messages": messages, "max_tokens": 3, "ignore_eos": True,
                               "stream": True})
    assert status == 200
    assert post(srv.url, {"model": srv.model_name, "messages": messages}, key="wrong")[0] == 401
    assert get(srv.url, "/health")[0] == 200
    chat, stream, refused, health = _lines(caplog)
    assert chat.group(1) == "127.0.0.1" and chat.group(2, 3, 4) == ("POST", "/v1/chat/completions", "200")
    assert (int(chat.group(6)), int(chat.group(7))) == (body["usage"]["prompt_tokens"], 5)
    assert stream.group(4) == "200" and int(stream.group(7)) == 3 and stream.group(6) == chat.group(6)
    assert refused.group(4, 5) == ("401", "-")
    assert health.group(2, 3, 4, 5) == ("GET", "/health", "200", "-")
    assert all(float(m.group(8)) >= 0 for m in (chat, stream, refused, health))


def test_completions_are_logged_with_their_tokens(srv, caplog):
    import json
    import urllib.request
    caplog.set_level(logging.INFO, logger="vlm_sdk.server")
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(
        {"model": srv.model_name, "prompt": ["Once upon", "a time"], "max_tokens": 2, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        usage = json.loads(r.read())["usage"]
    [line] = _lines(caplog)
    assert line.group(3, 4) == ("/v1/completions", "200")
    assert (int(line.group(6)), int(line.group(7))) == (usage["prompt_tokens"], 4)


def test_disable_log_requests_turns_it_off(tiny_ckpt, caplog):
    from vlm_sdk.cli import build_parser
    from vlm_sdk.server.cli import server_config
    from vlm_sdk.server.parser import parse_with_hints
    parser, commands = build_parser()
    assert server_config(parse_with_hints(parser, ["serve"], commands), {}).log_requests
    config = server_config(parse_with_hints(parser, ["serve", "--disable-log-requests", "--port", "0"], commands), {})
    assert not config.log_requests
    caplog.set_level(logging.INFO, logger="vlm_sdk.server")
    with BackgroundServer(tiny_ckpt, config, num_blocks=64) as s:
        assert get(s.url, "/health", key=None)[0] == 200
    assert not [r for r in caplog.records if r.name == "vlm_sdk.server" and LINE.match(r.getMessage())]
