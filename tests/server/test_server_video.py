"""Video through the server with the official openai client, on the tiny Qwen2.5-VL: a `video_url` part
(vLLM's shape) as a data: URL and as a file:// URL streams the answer the Python API gives; every bad
video is a 400 with code invalid_video (or too_many_videos) naming the problem, and the next request is
served; video URLs go through the same SSRF rules as image URLs."""
from __future__ import annotations

import asyncio
import base64
import re

import openai
import pytest
from openai import OpenAI

from server_helpers import API_KEY
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import InvalidVideoError
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import MediaPolicy, ServerConfig
from vlm_sdk.server.media import MediaFetcher
from vlm_sdk.testing.videos import write_video

OPTS = {"fps": 2.0, "min_pixels": 4 * 28 * 28, "max_pixels": 8 * 28 * 28}
GREEDY = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_media")
    write_video(root / "clip.mp4", frames=24, fps=8, width=96, height=64)
    write_video(root / "long.mp4", frames=80, fps=8, width=64, height=48)
    return root


@pytest.fixture(scope="module")
def srv(tiny_ckpt, media_dir):
    config = ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny", limit_videos=1,
                          media=MediaPolicy(allowed_local_path=str(media_dir), allowed_domains=("127.0.0.1",)))
    with BackgroundServer(tiny_ckpt, config, max_video_seconds=5.0, max_video_frames=16) as s:
        yield s


def _client(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def _video(url: str, **opts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url, **opts}},
                                         {"type": "text", "text": "What happens?"}]}]


def _data_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def test_streamed_video_answer_equals_the_python_api(srv, tiny_ckpt, media_dir):
    expected = LLM(str(tiny_ckpt), show_progress=False).chat(
        [{"role": "user", "content": [{"type": "video", "video": str(media_dir / "clip.mp4"), **OPTS},
                                      {"type": "text", "text": "What happens?"}]}],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    for url in (_data_url((media_dir / "clip.mp4").read_bytes()), (media_dir / "clip.mp4").as_uri()):
        stream = _client(srv).chat.completions.create(model="tiny", messages=_video(url, **OPTS), stream=True,
                                                      stream_options={"include_usage": True}, **GREEDY)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected.text
        assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)


def _bad(srv, messages) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        _client(srv).chat.completions.create(model="tiny", messages=messages, **GREEDY)
    return info.value


def _truncated_unknown_codec() -> bytes:
    data = write_video(frames=4, codec="ffv1", container="matroska")
    return data.replace(b"V_FFV1", b"V_QQQQ")


BAD = {
    "corrupt": (lambda d: _video(_data_url(bytes(range(256)) * 40)), "invalid_video", "cannot read a video container"),
    "truncated": (lambda d: _video(_data_url((d / "clip.mp4").read_bytes()[:2000])), "invalid_video",
                  "cannot read a video container|corrupt"),
    "not a video": (lambda d: _video("data:video/mp4;base64," + base64.b64encode(
        b"\x89PNG\r\n\x1a\n" + b"\0" * 64).decode()), "invalid_video", "cannot read|is an image"),
    "unknown codec": (lambda d: _video(_data_url(_truncated_unknown_codec())), "invalid_video",
                      "no decoder for its video codec"),
    "zero length": (lambda d: _video(_data_url(write_video(frames=0))), "invalid_video", "no video stream|no frames"),
    "too long": (lambda d: _video((d / "long.mp4").as_uri()), "invalid_video",
                 r"lasts 10\.0 s, over the limit of 5 s \(setting max_video_seconds"),
    "too many frames": (lambda d: _video((d / "clip.mp4").as_uri(), fps=8.0), "invalid_video",
                        r"24 frames sampled, over the limit of 16 \(setting max_video_frames"),
    "bad setting": (lambda d: _video((d / "clip.mp4").as_uri(), fps=-1), "invalid_request_error",
                    "fps must be a positive number"),
    "unknown setting": (lambda d: _video((d / "clip.mp4").as_uri(), resized_height=28), None,
                        "resized_height is not a video setting of Qwen2.5-VL"),
    "outside the media path": (lambda d: _video("file:///etc/hostname"), "invalid_video", "--allowed-local-media-path"),
    "private address": (lambda d: _video("http://127.0.0.1:9/clip.mp4"), "invalid_video",
                        "loopback address.*--allow-private-media-addresses"),
    "two videos": (lambda d: [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": (d / "clip.mp4").as_uri()}}] * 2}], "too_many_videos",
        "at most 1 per request \\(server setting --limit-videos\\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_video_is_a_400_and_the_next_request_is_served(srv, media_dir, case):
    make, code, words = BAD[case]
    err = _bad(srv, make(media_dir))
    assert err.status_code == 400
    assert re.search(words, err.message), err.message
    if code in ("invalid_video", "too_many_videos"):
        assert (err.body["code"], err.body["param"]) == (code, "messages")
    else:  # a setting of the part: named as the param
        assert err.body["param"] == {"bad setting": "fps", "unknown setting": "resized_height"}[case]
    ok = _client(srv).chat.completions.create(model="tiny", messages=_video((media_dir / "clip.mp4").as_uri(),
                                                                            **OPTS), **GREEDY)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 8
    stats = srv.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0


def test_video_urls_are_fetched_under_the_video_byte_cap(media_dir):
    policy = MediaPolicy(allowed_local_path=str(media_dir), max_bytes=100, max_video_bytes=1000)

    async def resolve(url):
        fetcher = MediaFetcher(policy)
        try:
            return await fetcher.resolve_messages(_video(url))
        finally:
            await fetcher.close()
    size = (media_dir / "clip.mp4").stat().st_size
    assert size > 1000
    with pytest.raises(InvalidVideoError, match=r"over the limit of 1000 bytes per video \(server setting "
                                                r"--max-video-bytes\)"):
        asyncio.run(resolve((media_dir / "clip.mp4").as_uri()))
    big = MediaPolicy(allowed_local_path=str(media_dir), max_bytes=100, max_video_bytes=size)
    fetcher = MediaFetcher(big)
    out = asyncio.run(fetcher.resolve_messages(_video((media_dir / "clip.mp4").as_uri())))
    assert out[0]["content"][0]["video_url"]["url"] == (media_dir / "clip.mp4").read_bytes()


def test_async_client_sends_a_local_video(srv, media_dir, tmp_path):
    """A path outside the server's media directory: the client sends the bytes as a data: URL in a
    video_url part, its options inside; the answer equals the server's own read of the file."""
    from vlm_sdk.client import AsyncClient, encode_messages
    copy = tmp_path / "elsewhere.mp4"
    copy.write_bytes((media_dir / "clip.mp4").read_bytes())
    local = [{"role": "user", "content": [{"type": "video", "video": str(copy), **OPTS},
                                          {"type": "text", "text": "What happens?"}]}]
    part = encode_messages(local)[0]["content"][0]
    assert part["type"] == "video_url" and part["video_url"]["url"].startswith("data:video/mp4;base64,")
    assert {k: v for k, v in part["video_url"].items() if k != "url"} == OPTS

    async def ask():
        async with AsyncClient(srv.url, API_KEY) as client:
            return await client.chat(local, max_tokens=8, temperature=0, ignore_eos=True)
    result = asyncio.run(ask())
    served = _client(srv).chat.completions.create(model="tiny", messages=_video((media_dir / "clip.mp4").as_uri(),
                                                                                **OPTS), **GREEDY)
    assert result.text == served.choices[0].message.content
    assert result.usage.prompt_tokens == served.usage.prompt_tokens


def test_chat_cli_with_a_video(srv, media_dir, tiny_ckpt, capsys):
    from vlm_sdk.cli import main
    clip = str(media_dir / "clip.mp4")
    assert main(["chat", "--model", str(tiny_ckpt), "--video", clip, "--fps", "2", "--max-tokens", "4",
                 "What happens?"]) == 0
    local = capsys.readouterr()
    assert "generated 4" in local.err and "image tokens" in local.err
    assert main(["chat", "--url", srv.url, "--api-key", API_KEY, "--video", clip, "--fps", "2", "--max-tokens", "4",
                 "What happens?"]) == 0
    remote = capsys.readouterr()
    assert remote.out == local.out  # the same greedy answer, in process and over HTTP
    assert main(["chat", "--model", str(tiny_ckpt), "--video", str(media_dir / "missing.mp4"), "hi"]) == 2
    assert "video file not found" in capsys.readouterr().err


@pytest.mark.timing  # a wall-clock bound: run alone
def test_decoding_a_video_does_not_stall_another_stream(tiny_ckpt, tmp_path):
    """While one client streams, another sends an 8 s 720p clip whose 64 sampled frames need all of its
    frames decoded (one keyframe) and resized: that runs on a prompt thread, never the engine's, so the
    stream's largest gap between chunks stays under the text-prompt test's bound (server_helpers.stall_bound)."""
    import time

    from server_helpers import VictimStream, assert_no_stall, post, stall_bound
    clip = tmp_path / "long.mp4"
    write_video(clip, frames=240, fps=30, width=1280, height=720, gop=240)
    config = ServerConfig(port=0, api_key=API_KEY, media=MediaPolicy(allowed_local_path=str(tmp_path)))
    with BackgroundServer(tiny_ckpt, config, num_blocks=512) as srv, VictimStream(srv.url, srv.model_name) as victim:
        body = {"model": srv.model_name, "max_tokens": 2, "messages": _video(clip.as_uri(), fps=8.0,
                                                                              min_pixels=4 * 28 * 28,
                                                                              max_pixels=16 * 28 * 28)}
        t0 = time.monotonic()
        status, answer = post(srv.url, body, timeout=300)
        t1 = time.monotonic()
        gap = victim.worst_gap(t0, t1)
        quiet = victim.quiet_gap(t1 - t0)
    assert status == 200, answer
    print(f"largest gap {gap:.3f} s (quiet: {quiet}) while a video request took {t1 - t0:.2f} s")
    # decoded on the engine thread, the stream would wait the whole request: it must be long enough to tell
    assert t1 - t0 > 2 * stall_bound(quiet), "the video request was too quick to show anything"
    assert_no_stall(gap, quiet, f"while a video request took {t1 - t0:.2f} s")
