"""Engine death (issue 18, point 7): the traceback is logged once, every open request fails (503, or an
in-band error on a stream), `vlm-sdk serve` exits non-zero so that a supervisor restarts it, and
/metrics shows no request still running."""
import logging
import sys
import threading
import time

import pytest

from helpers import start_server
from server_helpers import get, post, sse_events, wait_for
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

FAULT = "simulated device fault"
# the engine's step fails once two requests are running and have made a few tokens
SERVE_WITH_FAULT = f"""
import sys
from vlm_sdk.engine.llm_engine import LLMEngine
real_step = LLMEngine.step
def step(self):
    if len(self.scheduler.running) >= 2 and self.totals["generation_tokens"] >= 8:
        raise RuntimeError({FAULT!r})
    return real_step(self)
LLMEngine.step = step
from vlm_sdk.server.cli import serve_main
sys.exit(serve_main(sys.argv[1:]))
"""
LONG = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 400, "ignore_eos": True}


def _both_fail(url: str) -> tuple[list, tuple]:
    """One stream and one plain request, in flight together when the engine dies."""
    stream = {}
    t = threading.Thread(target=lambda: stream.update(r=post(url, {**LONG, "stream": True}, key=None)))
    t.start()
    plain = post(url, LONG, key=None)
    t.join(timeout=60)
    status, text = stream["r"]
    assert status == 200  # its headers went out before the engine died
    return sse_events(text), plain


def _check_failed(events: list, plain: tuple) -> None:
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead", events[-3:]
    status, body = plain
    assert status == 503 and body["error"]["code"] == "engine_dead", body


@pytest.mark.timing  # a wall-clock bound: run alone
def test_serve_fails_open_requests_logs_once_and_exits_nonzero(tiny_ckpt):
    proc, url = start_server([sys.executable, "-c", SERVE_WITH_FAULT, str(tiny_ckpt), "--port", "0",
                              "--served-model-name", "m", "--shutdown-timeout", "30"], timeout=60)
    try:
        events, plain = _both_fail(url)
        t0 = time.monotonic()
        code = proc.wait(timeout=30)
        assert time.monotonic() - t0 < 5  # not --shutdown-timeout: nothing is left to wait for
        err = proc.stderr.read()
        _check_failed(events, plain)
        assert code == 1, err[-2000:]
        assert err.count("Traceback") == 1 and err.count(FAULT) >= 1, err[-3000:]
        assert "supervisor" in err
    finally:
        proc.kill()


def test_metrics_after_engine_death_show_nothing_running(tiny_ckpt, caplog):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, served_model_name="m"), num_blocks=64) as srv:
        engine = srv.engine.engine
        real_step = engine.step

        def step():
            if len(engine.scheduler.running) >= 2 and engine.totals["generation_tokens"] >= 8:
                raise RuntimeError(FAULT)
            return real_step()

        engine.step = step
        with caplog.at_level(logging.INFO):
            _check_failed(*_both_fail(srv.url))
            assert wait_for(lambda: get(srv.url, "/health")[0] == 503)
        metrics = get(srv.url, "/metrics")[1]
        for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_used"):
            assert f'vlm_sdk_{name}{{model_name="m"}} 0.0' in metrics, name
    with_traceback = [r for r in caplog.records if r.exc_info]
    assert len(with_traceback) == 1 and FAULT in repr(with_traceback[0].exc_info[1])
