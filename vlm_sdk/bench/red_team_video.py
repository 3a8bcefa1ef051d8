"""`bench-serve --red-team`'s video rows (issue 41 rows 1, 2 and 4), in red_team.py's row format:
(name, bodies, at once, with plain probes). The videos travel as data: URLs, so that any server takes
them (no file:// path needed); they are made before the run (vlm_sdk/testing/hostile_videos.py).

    41.1  two 16000x16000 PNG frames in a 63 KB MOV, twice: refused from the header (max_image_pixels)
    41.2  1,000,000 tiny frames in a 14 MB MP4 (the header states the count), 250,000 in a Matroska file
          (it does not: counted while indexed) and 130,000 reached from one keyframe (the decode budget),
          each with nframes 2
    41.4  clients that send 120,000-frame videos (indexed, then decoded from one keyframe) and hang up
          after 0.5 s, two at a time, then a small video: the row's seconds are the hang-ups' and that
          video's answer; the hostile work must have stopped for it to come at once

`--red-team-scale` < 1 makes the videos that much shorter (the quick run in the tests).
"""
from __future__ import annotations

import asyncio
import base64
import json

import aiohttp

HANG_UP_AFTER_S = 0.5
HUNG_UP = 499  # the status reported for a request whose client left (nginx's "client closed request")


class HangUp(bytes):
    """A request body whose client hangs up HANG_UP_AFTER_S after sending it; red_team.py's sender
    calls `send` for a body that has one."""

    async def send(self, session: aiohttp.ClientSession, url: str, headers: dict) -> tuple[int, str]:
        async def post():
            async with session.post(url + "/v1/chat/completions", data=bytes(self), headers=headers) as resp:
                await resp.read()
                return resp.status
        try:
            status = await asyncio.wait_for(post(), HANG_UP_AFTER_S)  # cancelled: the connection is closed
        except asyncio.TimeoutError:
            return HUNG_UP, ""
        return status, "" if status == 200 else f"answered before the hang-up: {status}"


def video_rows(model: str, scale: float) -> list[tuple[str, list[bytes], int, bool]]:
    """Issue 41's video rows, each body a chat request with one video part (nframes 2 where it samples)."""
    from vlm_sdk.testing.hostile_videos import many_frames, png_mov
    from vlm_sdk.testing.videos import write_video

    def n(count: int) -> int:
        return max(2, round(count * scale))

    def body(video: bytes, kind: str = "mp4", **options) -> bytes:
        url = f"data:video/{kind};base64," + base64.b64encode(video).decode()
        return json.dumps({"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url, **options}},
            {"type": "text", "text": "What happens?"}]}]}).encode()
    huge = body(png_mov(16000), "quicktime")
    hostile = HangUp(body(many_frames(n(120_000), fps=1000, container="matroska", keyframes=False), "x-matroska",
                          nframes=2))
    small = body(write_video(frames=24, fps=8, width=96, height=64), fps=2.0, min_pixels=4 * 28 * 28,
                 max_pixels=8 * 28 * 28)
    return [
        ("41.1 16000x16000 PNG frames", [huge, huge], 1, False),
        ("41.2 many tiny frames, nframes 2", [body(many_frames(n(1_000_000), fps=1000), nframes=2),
                                              body(many_frames(n(250_000), fps=1000, container="matroska"),
                                                   "x-matroska", nframes=2),
                                              body(many_frames(n(130_000), fps=1000, keyframes=False), nframes=2)],
         1, False),
        ("41.4 hang-ups mid-video, then a video", [hostile] * 4 + [small], 2, False),
    ]
