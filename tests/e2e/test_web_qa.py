"""samples/web_qa in a real headless Chromium (Playwright): upload an image, ask, watch the answer stream
in; follow-up questions continue the conversation, served from the prefix cache, each answer showing
its time to first token and cached prompt tokens; "New image" starts over; the error paths show the
app's or the server's message; a client that leaves aborts upstream."""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import json
import re
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from PIL import Image

from helpers import REPO, image
from vlm_sdk.client import APIError, AsyncClient
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

APP_PATH = REPO / "samples" / "web_qa" / "app.py"
QUESTION = "What is in this image?"
MAX_TOKENS = 16
# the line under each answer
META = re.compile(r"first token (\d+) ms · (\d+) of (\d+) prompt tokens cached · (\d+) tokens \((\w+)\)")


def _load_app_module():
    spec = importlib.util.spec_from_file_location("web_qa_app", APP_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _png(image: Image.Image | None = None) -> bytes:
    buf = io.BytesIO()
    (image or Image.new("RGB", (64, 48), (200, 40, 30))).save(buf, "PNG")
    return buf.getvalue()


def _messages(image: bytes, question: str = QUESTION, *earlier: tuple[str, str]) -> list[dict]:
    """A chat about `image`: the `earlier` (question, answer) turns, then `question`; the image goes with
    the first question."""
    questions = [q for q, _ in earlier] + [question]
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": questions[0]}]}]
    for (_, answer), q in zip(earlier, questions[1:]):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": q}]
    return messages


class HoldingClient(AsyncClient):
    """An AsyncClient that, while `hold` is set, holds each stream after its first piece of text until
    `hold` is cleared again: the test sees what the page shows while the rest has not been sent yet."""

    hold = threading.Event()

    async def chat_stream(self, messages, **params):
        held = False
        async with contextlib.aclosing(super().chat_stream(messages, **params)) as stream:
            async for delta in stream:
                yield delta
                if delta.text and not held:
                    held = True
                    deadline = time.monotonic() + 10
                    while self.hold.is_set() and time.monotonic() < deadline:
                        await asyncio.sleep(0.005)


class WebQA:
    """The sample app on 127.0.0.1, port 0, on a thread of its own with its own event loop."""

    def __init__(self, upstream: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="web-qa", daemon=True)
        self.thread.start()
        self.runner: web.AppRunner | None = None
        self.url = self.call(self._start(upstream))

    def call(self, coro, timeout: float = 30.0):
        """Run a coroutine on the app's loop (Playwright's sync API holds a loop on the test's thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, upstream: str) -> str:
        app = _load_app_module().make_app(HoldingClient(upstream))
        # aiohttp's default handler_cancellation=False: a client that leaves is noticed when the app writes
        # to it, and then only the app's closing of chat_stream aborts the request upstream
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return "http://127.0.0.1:%d" % self.runner.addresses[0][1]

    def close(self) -> None:
        try:
            if self.runner is not None:
                self.call(self.runner.cleanup())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            self.loop.close()


def _wait_idle(srv: BackgroundServer, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = srv.stats()
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0) \
                or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0)) as srv:
        yield srv
        stats = _wait_idle(srv)
        assert stats["kv_blocks_used"] == 0, f"KV blocks still held after the web_qa tests: {stats}"


@pytest.fixture(scope="module")
def web_qa(server):
    app = WebQA(server.url)
    yield app
    app.close()


@pytest.fixture
def page(browser, web_qa):
    page = browser.new_page()
    page.set_default_timeout(15_000)
    page.goto(web_qa.url)
    yield page
    page.close()


@pytest.fixture
def png_path(tmp_path) -> Path:
    path = tmp_path / "red.png"
    path.write_bytes(_png())
    return path



def _ask(page, image: Path | None, question: str = QUESTION, max_tokens: int = MAX_TOKENS) -> None:
    if image is not None:
        page.set_input_files("#image", str(image))
    page.fill("#question", question)
    page.fill("#max_tokens", str(max_tokens))
    page.click("#ask")


def _turn(page, n: int):
    """The n-th turn (from 1) on the page."""
    return page.locator("#chat .turn").nth(n - 1)


def _answered(page, n: int) -> dict:
    """Wait for the n-th answer to finish; its text and the figures under it."""
    meta = _turn(page, n).locator(".meta")
    page.wait_for_function(f"document.querySelectorAll('#chat .turn .meta')[{n - 1}]?.textContent.length > 0")
    match = META.fullmatch(meta.text_content())
    assert match, meta.text_content()
    ttft, cached, prompt, tokens = map(int, match.groups()[:4])
    return {"answer": _turn(page, n).locator(".answer").text_content(), "ttft_ms": ttft, "cached": cached,
            "prompt": prompt, "tokens": tokens, "finish_reason": match.group(5)}


def _reference(web_qa, server, messages: list[dict], max_tokens: int = MAX_TOKENS):
    async def go():
        async with AsyncClient(server.url) as client:
            return await client.chat(messages, max_tokens=max_tokens, temperature=0)
    return web_qa.call(go())


def test_answer_streams_into_the_page(page, server, web_qa, png_path):
    HoldingClient.hold.set()  # the app gets the first piece of the answer, then nothing until cleared
    try:
        _ask(page, png_path)
        page.wait_for_function("document.querySelector('#chat .turn .answer')?.textContent.length > 0")
        first = _turn(page, 1).locator(".answer").text_content()
        assert page.text_content("#status") == "streaming…"
        assert page.is_disabled("#ask")
    finally:
        HoldingClient.hold.clear()
    turn = _answered(page, 1)
    ref = _reference(web_qa, server, _messages(png_path.read_bytes()))
    assert turn["answer"] == ref.text  # temperature 0 is the app's default: the page gets the greedy answer
    assert page.text_content("#status") == f"done ({ref.usage.completion_tokens} tokens)"
    assert (turn["tokens"], turn["prompt"], turn["finish_reason"]) == \
        (ref.usage.completion_tokens, ref.usage.prompt_tokens, ref.finish_reason)
    # streamed: the page showed the first piece on its own, and the rest was added to it
    assert turn["answer"].startswith(first) and len(first) < len(turn["answer"]), (first, turn["answer"])
    assert page.is_visible("#preview")
    assert page.is_disabled("#image") and page.input_value("#question") == ""  # ready for a follow-up


def test_follow_ups_keep_the_conversation(page, server, web_qa, tmp_path):
    """Three turns about one image: each answer is the server's greedy answer to the whole conversation,
    image included; turns 2 and 3 find the earlier turns' prompts in the prefix cache. "New image"
    starts a conversation about another image."""
    path = tmp_path / "blobs.png"
    path.write_bytes(_png(image(96, 64, seed=7)))
    questions = ["Describe the picture.", "Which colour covers most of it?", "Is anything written on it?"]
    turns = []
    for n, question in enumerate(questions, 1):
        _ask(page, path if n == 1 else None, question)  # the image is chosen once
        turns.append(_answered(page, n))
        assert page.locator("#chat .turn").count() == n
    block = server.stats()["kv_block_size"]
    for before, after in zip(turns, turns[1:]):
        # each prompt starts with the previous one: at least its full blocks are reused
        assert after["prompt"] > before["prompt"]
        assert before["prompt"] // block * block <= after["cached"] < after["prompt"], turns
    assert all(t["ttft_ms"] >= 0 and t["tokens"] == MAX_TOKENS for t in turns)  # shown for every answer

    # the page sent the whole conversation, image first: the same answers as the client asking for it itself
    earlier = []
    for question, turn in zip(questions, turns):
        ref = _reference(web_qa, server, _messages(path.read_bytes(), question, *earlier))
        assert (turn["answer"], turn["prompt"]) == (ref.text, ref.usage.prompt_tokens), question
        earlier.append((question, turn["answer"]))

    page.click("#new")
    assert page.locator("#chat .turn").count() == 0 and page.is_enabled("#image")
    assert page.input_value("#image") == "" and not page.is_visible("#preview")
    other = tmp_path / "other.png"
    other.write_bytes(_png(image(80, 80, seed=8)))
    _ask(page, other, questions[1])
    turn = _answered(page, 1)
    ref = _reference(web_qa, server, _messages(other.read_bytes(), questions[1]))
    assert (turn["answer"], turn["prompt"]) == (ref.text, ref.usage.prompt_tokens)  # no earlier turns sent


def test_new_image_mid_answer_aborts_it(page, server, web_qa, png_path):
    before = _wait_idle(server)["total_generation_tokens"]
    HoldingClient.hold.set()
    try:
        _ask(page, png_path, "Tell me everything.", max_tokens=2000)
        page.wait_for_function("document.querySelector('#chat .turn .answer')?.textContent.length > 0")
        page.click("#new")
        assert page.locator("#chat .turn").count() == 0 and page.is_enabled("#image")
    finally:
        HoldingClient.hold.clear()  # the app's next write finds the page gone and closes the upstream stream
    page.wait_for_function("!document.getElementById('ask').disabled")
    assert page.text_content("#status") == ""
    stats = _wait_idle(server)
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0, stats
    assert stats["total_generation_tokens"] - before < 1000, "the abandoned answer ran on upstream"


def test_no_image_shows_the_apps_error(page):
    _ask(page, None)
    page.wait_for_function("document.getElementById('status').className === 'error'")
    assert page.text_content("#status") == "choose an image first"
    assert page.locator("#chat .turn").count() == 0  # nothing was answered
    assert page.input_value("#question") == QUESTION  # kept, to ask again


def test_non_image_file_shows_the_servers_message(page, server, web_qa, tmp_path):
    bogus = tmp_path / "notes.txt"
    bogus.write_bytes(b"these are not the pixels you are looking for")

    async def server_message():
        async with AsyncClient(server.url) as client:
            with pytest.raises(APIError) as err:
                await client.chat(_messages(bogus.read_bytes()), max_tokens=MAX_TOKENS)
            return err.value
    err = web_qa.call(server_message())
    assert err.status == 400 and err.code == "invalid_image"
    _ask(page, bogus)
    page.wait_for_function("document.getElementById('status').className === 'error'")
    assert page.text_content("#status") == err.message
    assert "cannot identify an image" in err.message
    assert page.locator("#chat .turn").count() == 0 and page.is_enabled("#image")  # choose another


def test_bad_forms_get_400_json(web_qa):
    async def post(form: aiohttp.FormData) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.post(web_qa.url + "/api/ask", data=form) as resp:
                return resp.status, await resp.json()

    def form(image: bytes | None, question: str, history: str | None = None) -> aiohttp.FormData:
        f = aiohttp.FormData()
        if image is not None:
            f.add_field("image", image, filename="x.png", content_type="image/png")
        f.add_field("question", question)
        if history is not None:
            f.add_field("history", history)
        return f

    status, body = web_qa.call(post(form(_png(), "   ")))
    assert (status, body) == (400, {"error": "type a question first"})
    status, body = web_qa.call(post(form(b"\0" * (21 << 20), QUESTION)))
    assert status == 400 and "over the limit of 20 MB" in body["error"]
    shape = 'history must be a JSON array of {"question": text, "answer": text} objects'
    for history in ("not json", '{"question": "q", "answer": "a"}', '[{"question": "q"}]', '[["q", "a"]]'):
        assert web_qa.call(post(form(_png(), QUESTION, history))) == (400, {"error": shape}), history


def test_leaving_mid_answer_aborts_upstream(web_qa, server):
    image = _png()

    async def reference() -> int:  # how long the answer runs when nobody leaves, up to 200 tokens
        async with AsyncClient(server.url) as client:
            return (await client.chat(_messages(image), max_tokens=200, temperature=0)).usage.completion_tokens
    full = web_qa.call(reference())
    assert full == 200, f"the reference answer is too short ({full} tokens) to tell an abort from the end"
    before = _wait_idle(server)["total_generation_tokens"]

    async def leave_after_first_piece() -> None:
        form = aiohttp.FormData()
        form.add_field("image", image, filename="x.png", content_type="image/png")
        form.add_field("question", QUESTION)
        form.add_field("max_tokens", "2000")
        async with aiohttp.ClientSession() as session:
            async with session.post(web_qa.url + "/api/ask", data=form) as resp:
                assert resp.status == 200
                line = await resp.content.readline()
                assert json.loads(line.decode().removeprefix("data: "))["text"]
                resp.close()  # drop the connection mid-answer
    web_qa.call(leave_after_first_piece())
    stats = _wait_idle(server)
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0, stats
    generated = stats["total_generation_tokens"] - before
    assert generated < full // 2, (f"{generated} tokens generated for a request whose client left after the first "
                                   f"piece; it would have run to {full} or more")


def test_too_big_upload_shows_the_limit(page, tmp_path):
    big = tmp_path / "big.png"
    big.write_bytes(_png() + b"\0" * (21 << 20))
    _ask(page, big)
    page.wait_for_function("document.getElementById('status').className === 'error'")
    assert page.text_content("#status") == "the upload is over the limit of 20 MB"


def test_a_video_is_asked_about_as_a_video(page, server, web_qa, tmp_path):
    """An MP4 upload goes to the server as a video part: the page's answer is the one a video_url
    request gets, and the page previews it as a video."""
    from vlm_sdk.testing.videos import write_video
    clip = tmp_path / "clip.mp4"
    write_video(clip, frames=16, fps=8, width=96, height=64)
    _ask(page, clip, "What happens?")
    turn = _answered(page, 1)
    video = [{"role": "user", "content": [{"type": "video", "video": clip.read_bytes()},
                                          {"type": "text", "text": "What happens?"}]}]
    ref = _reference(web_qa, server, video)
    assert (turn["answer"], turn["prompt"]) == (ref.text, ref.usage.prompt_tokens)
    image_tokens = _reference(web_qa, server, _messages(_png(), "What happens?")).usage.prompt_tokens
    assert turn["prompt"] != image_tokens
    assert page.is_visible("#video-preview") and not page.is_visible("#preview")
