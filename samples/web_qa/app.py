"""A one-page web app: pick an image, type a question, press Ask, watch the answer stream in.

    python samples/web_qa/app.py --url http://127.0.0.1:8000 [--api-key K]   # a running `vlm-sdk serve`
    python samples/web_qa/app.py                                            # starts a server here
    # then open http://127.0.0.1:8080 (--host / --port to change)

Without --url a server is started in this process on the tiny checkpoint with RANDOM weights
(gibberish answers). The browser posts the image and question to POST /api/ask (multipart form:
`image`, `question`, optional `max_tokens`, `temperature` (default 0)); the answer comes back as
server-sent events: `{"text": ...}` per piece, then `{"done": true, "finish_reason", "usage"}`, or
`{"error": message}`. Closing the page mid-answer closes the upstream stream, which aborts the request.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

from aiohttp import web

from vlm_sdk.client import APIError, AsyncClient

HERE = Path(__file__).resolve().parent
MAX_UPLOAD_BYTES = 20 << 20
CLIENT = web.AppKey("client", AsyncClient)


def _bad(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(HERE / "index.html")


async def ask(request: web.Request) -> web.StreamResponse:
    try:
        form = await request.post()
    except web.HTTPRequestEntityTooLarge:
        return _bad(f"the upload is over the limit of {MAX_UPLOAD_BYTES >> 20} MB")
    except ValueError as e:  # not a form at all
        return _bad(f"expected a multipart form with fields image and question ({e})")
    image, question = form.get("image"), str(form.get("question") or "").strip()
    if not isinstance(image, web.FileField):
        return _bad("choose an image first")
    data = image.file.read()
    if not data:
        return _bad(f"the file {image.filename!r} is empty")
    if not question:
        return _bad("type a question first")
    try:
        max_tokens = int(form.get("max_tokens") or 64)
        temperature = float(form.get("temperature") or 0.0)
    except ValueError:
        return _bad("max_tokens must be an integer and temperature a number")

    messages = [{"role": "user", "content": [{"type": "image", "image": data},
                                             {"type": "text", "text": question}]}]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)

    async def send(event: dict) -> None:
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())

    finish_reason, usage = None, None
    stream = request.app[CLIENT].chat_stream(messages, max_tokens=max_tokens, temperature=temperature)
    # aclosing: when the browser goes away, write() raises and closing the stream drops the upstream
    # connection at once, so the server aborts the request and frees its KV blocks
    async with contextlib.aclosing(stream):
        try:
            async for delta in stream:
                if delta.text:
                    await send({"text": delta.text})
                finish_reason = delta.finish_reason or finish_reason
                usage = delta.usage or usage
        except APIError as e:
            await send({"error": e.message})
            return resp
    await send({"done": True, "finish_reason": finish_reason,
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
