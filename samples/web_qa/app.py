"""A one-page web app: a chat about one image or video. Pick an image or a video, ask, watch the answer
stream in, ask follow-up questions about the same one; "New image" starts over.

    python samples/web_qa/app.py --url http://127.0.0.1:8000 [--api-key K]   # a running `vlm-sdk serve`
    python samples/web_qa/app.py                                            # starts a server here
    # then open http://127.0.0.1:8080 (--host / --port to change)

Without --url a server is started in this process on the tiny checkpoint with RANDOM weights
(gibberish answers). The app keeps no state: the page holds the conversation and posts all of it with
each question to POST /api/ask (multipart form: `image` (an image or a video: a video's MIME type
is video/*, or its bytes begin as an MP4, MOV, WebM, MKV or AVI file), `question`, `history` (JSON: the earlier
turns, `[{"question", "answer"}, ...]`), optional `max_tokens`, `temperature` (default 0)). The app
sends the server the whole conversation, image first, as a chat client does: the server's prefix
cache recognises the part it has seen, so a follow-up's first token comes sooner. The answer comes
back as server-sent events: `{"text": ...}` per piece, then `{"done": true, "finish_reason", "usage"
(with `cached_tokens`: prompt tokens served from the prefix cache), "time_to_first_token" (seconds,
from the app's request to the first piece of text)}`, or `{"error": message}`. Closing the page
mid-answer closes the upstream stream, which aborts the request.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

from aiohttp import web

from vlm_sdk.client import APIError, AsyncClient

HERE = Path(__file__).resolve().parent
MAX_UPLOAD_BYTES = 20 << 20
CLIENT = web.AppKey("client", AsyncClient)
HISTORY_SHAPE = 'history must be a JSON array of {"question": text, "answer": text} objects'


class FormError(ValueError):
    """The posted form cannot be asked: the message says what to fix."""


class Question(NamedTuple):  # not a dataclass: one fails when this file is loaded by path, as the tests do
    image: bytes  # an image's or a video's bytes
    history: list[tuple[str, str]]  # earlier (question, answer) turns, oldest first
    question: str
    max_tokens: int
    temperature: float
    kind: str = "image"  # or "video"

    def messages(self) -> list[dict]:
        """The whole conversation: the image (or video) goes with the first question, as when it was
        first asked, so every turn's prompt starts with the previous turn's."""
        questions = [q for q, _ in self.history] + [self.question]
        messages = [{"role": "user", "content": [{"type": self.kind, self.kind: self.image},
                                                 {"type": "text", "text": questions[0]}]}]
        for (_, answer), question in zip(self.history, questions[1:]):
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        return messages


async def read_question(request: web.Request) -> Question:
    try:
        form = await request.post()
    except web.HTTPRequestEntityTooLarge:
        raise FormError(f"the upload is over the limit of {MAX_UPLOAD_BYTES >> 20} MB") from None
    except ValueError as e:  # not a form at all
        raise FormError(f"expected a multipart form with fields image and question ({e})") from None
    image, question = form.get("image"), str(form.get("question") or "").strip()
    if not isinstance(image, web.FileField):
        raise FormError("choose an image first")
    data = image.file.read()
    if not data:
        raise FormError(f"the file {image.filename!r} is empty")
    if not question:
        raise FormError("type a question first")
    try:
        max_tokens = int(form.get("max_tokens") or 64)
        temperature = float(form.get("temperature") or 0.0)
    except ValueError:
        raise FormError("max_tokens must be an integer and temperature a number") from None
    kind = "video" if is_video(image.content_type, data) else "image"
    return Question(data, parse_history(str(form.get("history") or "[]")), question, max_tokens, temperature, kind)


# (offset, bytes) of the containers a video usually comes in: MP4 / MOV, WebM / MKV, AVI
_VIDEO_SIGNATURES = ((4, b"ftyp"), (0, b"\x1aE\xdf\xa3"), (8, b"AVI "))


def is_video(content_type: str | None, data: bytes) -> bool:
    if (content_type or "").startswith("video/"):
        return True
    return any(data[at:at + len(sig)] == sig for at, sig in _VIDEO_SIGNATURES)


def parse_history(raw: str) -> list[tuple[str, str]]:
    try:
        turns = json.loads(raw)
    except ValueError:
        raise FormError(HISTORY_SHAPE) from None
    if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("question"), str) and isinstance(t.get("answer"), str)
            for t in turns):
        raise FormError(HISTORY_SHAPE)
    return [(t["question"], t["answer"]) for t in turns]


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(HERE / "index.html")


async def ask(request: web.Request) -> web.StreamResponse:
    try:
        q = await read_question(request)
    except FormError as e:
        return web.json_response({"error": str(e)}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(event: dict) -> None:
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())

    finish_reason, usage, first_text = None, None, None
    start = time.perf_counter()
    stream = request.app[CLIENT].chat_stream(q.messages(), max_tokens=q.max_tokens, temperature=q.temperature)
    # aclosing: when the browser goes away, write() raises and closing the stream drops the upstream
    # connection at once, so the server aborts the request and frees its KV blocks
    async with contextlib.aclosing(stream):
        try:
            async for delta in stream:
                if delta.text:
                    first_text = first_text or time.perf_counter()
                    await send({"text": delta.text})
                finish_reason = delta.finish_reason or finish_reason
                usage = delta.usage or usage
        except APIError as e:
            await send({"error": e.message})
            return resp
    # an answer with no text at all: its first token came no later than the end
    ttft = (first_text or time.perf_counter()) - start
    await send({"done": True, "finish_reason": finish_reason, "time_to_first_token": ttft,
                "usage": dataclasses.asdict(usage) if usage else None})
    return resp


def make_app(client: AsyncClient) -> web.Application:
    app = web.Application(client_max_size=MAX_UPLOAD_BYTES)
    app[CLIENT] = client
    app.router.add_get("/", index)
    app.router.add_post("/api/ask", ask)

    async def close_client(app: web.Application) -> None:
        await client.close()
    app.on_cleanup.append(close_client)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one here on the tiny random model)")
    parser.add_argument("--api-key", help="the server's API key, if it has one")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from vlm_sdk.demo_checkpoint import tiny_model_dir
            from vlm_sdk.server.background import BackgroundServer
            from vlm_sdk.server.config import ServerConfig
            print("[no --url: serving the tiny checkpoint with RANDOM weights in this process; "
                  "answers are gibberish]", file=sys.stderr)
            server = stack.enter_context(BackgroundServer(tiny_model_dir(), ServerConfig(port=0)))
            url, args.api_key = server.url, None
        print(f"[web_qa] asking {url}; open http://{args.host}:{args.port}/", file=sys.stderr)
        # handler_cancellation: a browser that leaves cancels its handler at once, even between pieces
        web.run_app(make_app(AsyncClient(url, args.api_key)), host=args.host, port=args.port, print=None,
                    handler_cancellation=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
