"""`AsyncClient` against the real server (a `BackgroundServer` on the tiny checkpoint): text and usage
match the engine, every image form is sent, errors arrive typed, and leaving a stream early frees the
request's KV blocks. A small aiohttp fake covers only error shapes the real server does not produce
on demand (a non-JSON error body, an error inside a stream)."""
import asyncio
import contextlib
import dataclasses
import io
import socket
import time

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

from vlm_sdk import LLM, SamplingParams
from helpers import SAMPLE_IMAGE
from vlm_sdk.client import (APIConnectionError, AsyncClient, AuthenticationError, BadRequestError, ChatDelta,
                            ContextLengthExceededError, NotFoundError, RequestTooLargeError, ServerError, Usage,
                            encode_messages, to_data_url)
from vlm_sdk.errors import InvalidImageError, VLMError
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

SAMPLE = SAMPLE_IMAGE
KEY = "test-key"


def conv(image, text="What is in this image?", **pixels):
    return [{"role": "user", "content": [{"type": "image", "image": image, **pixels}, {"type": "text", "text": text}]}]


def run(coro_fn, url, **kw):
    async def main():
        async with AsyncClient(url, **kw) as client:
            return await coro_fn(client)
    return asyncio.run(main())


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0)) as s:
        yield s


@pytest.fixture(scope="module")
def strict(tiny_ckpt):
    """API key, a 64 KiB body limit and a 6-block (96-token) KV cache: every refusal on one server."""
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=KEY, max_request_bytes=64 * 1024),
                          num_blocks=6, allow_unfit_images=True) as s:
        yield s


def test_chat_and_stream_agree_with_the_engine(srv, tiny_ckpt):
    messages = conv(SAMPLE)

    async def go(client):
        assert await client.health() is True
        assert await client.models() == [srv.model_name]
        result = await client.chat(messages, max_tokens=8, temperature=0.0)
        deltas = [d async for d in client.chat_stream(messages, max_tokens=8, temperature=0.0)]
        return result, deltas

    result, deltas = run(go, srv.url)
    ref = LLM(tiny_ckpt, show_progress=False).chat(messages, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert result.text == ref.text and result.finish_reason == ref.finish_reason == "length"
    assert result.model == srv.model_name and result.id and result.latency_s > 0
    # prompt_tokens counts the image tokens: the same prompt length the engine builds
    assert result.usage.prompt_tokens == len(ref.prompt_token_ids) > 100
    assert result.usage.completion_tokens == 8 and result.usage.total_tokens == result.usage.prompt_tokens + 8

    assert all(isinstance(d, ChatDelta) for d in deltas)
    assert "".join(d.text for d in deltas) == result.text
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert all(d.usage is None for d in deltas[:-1])
    # the same counts, except what the stream found cached: the first request left its prompt in the cache
    assert dataclasses.replace(deltas[-1].usage, cached_tokens=None) == dataclasses.replace(result.usage,
                                                                                          cached_tokens=None)
    assert result.usage.cached_tokens == 0  # this server had not seen the prompt before
    assert 0 <= deltas[-1].usage.cached_tokens < deltas[-1].usage.prompt_tokens
    assert srv.stats()["kv_blocks_used"] == 0


def test_every_image_form_is_sent(srv, tmp_path):
    pil = Image.open(SAMPLE)
    pil.load()
    jpg = tmp_path / "shapes.jpg"
    pil.save(jpg, quality=95)
    forms = {"path str": str(SAMPLE), "pathlib": SAMPLE, "bytes": SAMPLE.read_bytes(), "PIL": pil,
             "file URL": SAMPLE.as_uri(), "data URL": to_data_url(SAMPLE)}

    async def go(client):
        out = {name: await client.chat(conv(src), max_tokens=4, temperature=0.0) for name, src in forms.items()}
        # an OpenAI image_url part holding a local path is converted too; a JPEG keeps its own bytes
        out["image_url path"] = await client.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(SAMPLE)}}, {"type": "text", "text": "What is in this image?"}]}],
            max_tokens=4, temperature=0.0)
        out["jpeg"] = await client.chat(conv(jpg), max_tokens=4, temperature=0.0)
        # per-image max_pixels reaches the server, on the part or inside image_url
        out["small"] = await client.chat(conv(SAMPLE, max_pixels=28 * 28 * 4), max_tokens=4, temperature=0.0)
        out["small inner"] = await client.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": SAMPLE, "max_pixels": 28 * 28 * 4}},
            {"type": "text", "text": "What is in this image?"}]}], max_tokens=4, temperature=0.0)
        return out

    out = run(go, srv.url)
    same = {name: (r.text, r.usage.prompt_tokens) for name, r in out.items() if name in forms or name == "image_url path"}
    assert len(set(same.values())) == 1, same  # identical pixels, identical prompt and greedy answer
    full = out["PIL"].usage.prompt_tokens
    assert out["jpeg"].usage.prompt_tokens == full
    assert out["small"].usage.prompt_tokens == out["small inner"].usage.prompt_tokens < full


def test_usage_reads_cached_tokens():
    assert Usage.from_json({"prompt_tokens": 90, "completion_tokens": 4,
                            "prompt_tokens_details": {"cached_tokens": 64}}) == Usage(90, 4, 94, 64)
    # a server that does not report it says nothing about the cache: None, not 0
    assert Usage.from_json({"prompt_tokens": 90, "completion_tokens": 4}).cached_tokens is None
    assert Usage.from_json({"prompt_tokens": 90, "prompt_tokens_details": None}).cached_tokens is None


def test_encode_messages_shapes_and_mime():
    png = SAMPLE.read_bytes()
    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, format="JPEG")
    assert to_data_url(buf.getvalue()).startswith("data:image/jpeg;base64,")
    assert to_data_url(png).startswith("data:image/png;base64,")
    assert to_data_url(Image.new("CMYK", (4, 4))).startswith("data:image/png;base64,")  # PNG cannot hold CMYK
    parts = encode_messages([{"role": "system", "content": "plain"}, {"role": "user", "content": [
        {"type": "image", "image": png, "min_pixels": 100, "max_pixels": 5000},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
        {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
        {"type": "text", "text": "hi"}]}])
    assert parts[0] == {"role": "system", "content": "plain"}
    a, b, c, d = parts[1]["content"]
    assert a == {"type": "image_url", "image_url": {"url": to_data_url(png), "min_pixels": 100, "max_pixels": 5000}}
    assert b == {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}}
    assert c == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert d == {"type": "text", "text": "hi"}
    with pytest.raises(InvalidImageError, match="missing.png"):
        encode_messages(conv("/nonexistent/missing.png"))


def test_typed_errors_from_the_server(srv, strict):
    async def bad_param(client):
        with pytest.raises(BadRequestError) as e:
            await client.chat(conv(SAMPLE), max_tokens=4, temperature=-1)
        assert e.value.status == 400 and e.value.param == "temperature" and "temperature" in e.value.message
        with pytest.raises(NotFoundError) as e:
            await client.chat(conv(SAMPLE), model="no-such-model", max_tokens=4)
        assert e.value.status == 404 and e.value.param == "model" and srv.model_name in e.value.message
        with pytest.raises(BadRequestError):  # the same refusal, raised before the first stream delta
            async for _ in client.chat_stream(conv(SAMPLE), max_tokens=4, top_p=7):
                pass

    run(bad_param, srv.url)

    async def no_key(client):
        with pytest.raises(AuthenticationError) as e:
            await client.chat(conv(SAMPLE), model=strict.model_name, max_tokens=4)
        assert e.value.status == 401
        with pytest.raises(AuthenticationError):
            await client.models()

    run(no_key, strict.url)
    run(no_key, strict.url, api_key="wrong")

    async def with_key(client):
        with pytest.raises(ContextLengthExceededError) as e:
            await client.chat(conv(SAMPLE), max_tokens=4)
        assert isinstance(e.value, BadRequestError) and e.value.code == "context_length_exceeded"
        assert "num_blocks" in e.value.message  # the engine's advice reaches the caller
        noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8))
        with pytest.raises(RequestTooLargeError) as e:
            await client.chat(conv(noise), max_tokens=4)
        assert e.value.status == 413
        return await client.chat([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0.0)

    ok = run(with_key, strict.url, api_key=KEY)
    assert ok.usage.completion_tokens == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_errors_name_url_and_timeout():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there any more

    async def refused(client):
        assert await client.health() is False
        with pytest.raises(APIConnectionError) as e:
            await client.chat([{"role": "user", "content": "hi"}], model="m")
        assert url in str(e.value) and e.value.status is None and isinstance(e.value, VLMError)
        with pytest.raises(APIConnectionError):
            await client.models()

    run(refused, url)

    async def silent():  # accepts connections, never answers
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        silent_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server, AsyncClient(silent_url, timeout=0.3) as client:
            with pytest.raises(APIConnectionError, match="timed out") as e:
                async for _ in client.chat_stream([{"role": "user", "content": "hi"}], model="m"):
                    pass
            assert silent_url in str(e.value) and "0.3" in str(e.value)

    asyncio.run(silent())


@pytest.mark.timing  # a wall-clock bound: run alone
def test_early_break_aborts_and_frees_kv_blocks(srv):
    async def go(client):
        held = None
        async with contextlib.aclosing(client.chat_stream(conv(SAMPLE), max_tokens=3000, temperature=0.0,
                                                          ignore_eos=True)) as stream:
            n = 0
            async for delta in stream:
                n += bool(delta.text)
                if n == 3:
                    held = srv.stats()["kv_blocks_used"]
                    break
        t0 = time.monotonic()
        while srv.stats()["kv_blocks_used"] and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.02)
        # a break inside a plain `async for` (no aclosing) releases it too, once the generator is collected
        async for delta in client.chat_stream(conv(SAMPLE), max_tokens=3000, temperature=0.0, ignore_eos=True):
            if delta.text:
                break
        t1 = time.monotonic()
        while srv.stats()["kv_blocks_used"] and time.monotonic() - t1 < 5:
            await asyncio.sleep(0.02)
        return held, time.monotonic() - t0

    held, waited = run(go, srv.url)
    assert held and held > 0
    stats = srv.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    assert waited < 5  # 3000 tokens would take far longer: the requests were aborted, not finished


# -- error shapes the real server does not produce on demand: a tiny fake ---------------------------------
@contextlib.asynccontextmanager
async def fake_server(handler):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def test_non_json_errors_and_errors_inside_a_stream():
    async def handler(request):
        body = await request.json()
        if body["messages"][0]["content"] == "proxy":
            return web.Response(status=502, text="<html>Bad Gateway " + "x" * 500 + "</html>")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = '{"choices":[{"index":0,"delta":{"content":"ab"},"finish_reason":null}]}'
        await resp.write(f"data: {chunk}\n\n".encode())
        kind = body["messages"][0]["content"]
        err = ('{"error":{"message":"engine died","type":"server_error","param":null,"code":"engine_dead"}}'
               if kind == "dead" else
               '{"error":{"message":"too long","type":"invalid_request_error","param":"messages",'
               '"code":"context_length_exceeded"}}')
        await resp.write(f"data: {err}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def go():
        async with fake_server(handler) as url, AsyncClient(url) as client:
            with pytest.raises(ServerError) as e:
                await client.chat([{"role": "user", "content": "proxy"}], model="m")
            assert e.value.status == 502 and e.value.message.startswith("HTTP 502: <html>Bad Gateway")
            assert len(e.value.message) < 230
            texts = []
            with pytest.raises(ServerError, match="engine died") as e:
                async for d in client.chat_stream([{"role": "user", "content": "dead"}], model="m"):
                    texts.append(d.text)
            assert texts == ["ab"] and e.value.code == "engine_dead"
            with pytest.raises(ContextLengthExceededError) as e:
                async for d in client.chat_stream([{"role": "user", "content": "long"}], model="m"):
                    pass
            assert e.value.param == "messages" and e.value.status == 400

    asyncio.run(go())
