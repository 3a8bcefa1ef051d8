"""GET /plan (server/plan_page.py) in a real headless Chromium, found and skipped as tests/e2e/test_web_qa.py
does: the running engine's memory bar equals its start-up report, and the live bar and counts change in
place while a request runs and after it ends; no console errors."""
from __future__ import annotations

import json
import urllib.request

import pytest

from server_helpers import API_KEY
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig



def _live(page, key: str) -> str:
    return page.locator(f"#{key}").text_content()


def test_the_live_page_follows_a_running_request(browser, tiny_ckpt, tmp_path):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny"),
                          num_blocks=256, block_size=4, show_progress=False) as srv:
        page = browser.new_page(viewport={"width": 1000, "height": 900})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.set_default_timeout(30_000)
        page.goto(srv.url + "/plan")
        report = srv.engine.memory_report
        segments = page.evaluate("Object.fromEntries(Array.from(document.querySelectorAll('#memory-bar rect.segment'))"
                                 ".map(r => [r.dataset.name, Number(r.dataset.bytes)]))")
        assert segments["weights: language model"] == report.weights_language_model_bytes
        assert segments["KV cache"] == report.kv_cache_bytes == 256 * report.kv_bytes_per_block
        page.wait_for_function("document.getElementById('live-bar').dataset.updated >= 1")
        assert _live(page, "live-running") == "0" and _live(page, "live-used-n") == "0"
        assert _live(page, "live-free-n") == "256"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Count to a thousand."}], "stream": True,
                "max_tokens": 900, "ignore_eos": True, "temperature": 0}
        req = urllib.request.Request(srv.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        stream = urllib.request.urlopen(req, timeout=60)
        try:
            stream.readline()  # its first chunk: it runs
            before = int(page.evaluate("document.getElementById('live-bar').dataset.updated"))
            page.wait_for_function("document.getElementById('live-running').textContent === '1' && "
                                   "Number(document.getElementById('live-used').dataset.blocks) > 0")
            assert int(page.evaluate("document.getElementById('live-bar').dataset.updated")) > before  # in place
            width = float(page.get_attribute("#live-used", "width"))
            used = int(_live(page, "live-used-n"))
            assert width == pytest.approx(used / 256 * 900, rel=1e-6) and used > 0
        finally:
            stream.close()  # the client leaves: the request is aborted, its blocks freed
        page.wait_for_function("document.getElementById('live-running').textContent === '0' && "
                               "document.getElementById('live-used-n').textContent === '0'")
        assert int(_live(page, "live-cached-n")) > 0  # its full blocks stay cached, free
        page.screenshot(path=str(tmp_path / "live.png"), full_page=True)
        assert errors == []
        page.close()
