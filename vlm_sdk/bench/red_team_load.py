"""Issue 41's load rows for `vlm-sdk bench-serve --red-team`: preprocessing, GIL and admission
fairness, each beside the red team's victim stream (vlm_sdk/bench/red_team.py runs them after issue
28's rows, in its format: (name, bodies, at once, probes)).

    41.3  two hostile videos at once (frames of 16000x16000 PNG in a MOV; 1,000,000 tiny H.264 frames
          sampled with nframes 2), a 64x64 image request as the probe meanwhile: its slowest answer
          is the row's "slowest probe" (target < 2 s; it waited 154 s when images and videos shared
          two threads)
    41.5  a 30 MiB data: URL image (random pixels: 200) and a 30 MiB data: URL "video" (random bytes:
          400), one at a time: the base64 decoding must not stall the victim
    41.6  /v1/completions with 64 prompts x n=8 (512 sequences: 400 naming --max-sequences-per-request),
          then 8 prompts x n=8 (64 sequences, streamed, logprobs 20), plain probes meanwhile: their
          slowest answer is the worst first token another user waits
    41.8  two chat texts just under 1 MiB at once (400 on a model that cannot hold them), plain probes
          meanwhile: a new request must not wait for their tokenization

The videos are vlm_sdk/testing/hostile_videos.py's (made in well under a second each: 63 KB for two
16000x16000 frames, 13 MB for a million tiny ones). `scale` < 1 shrinks every size (the test suite's run).
"""
from __future__ import annotations

import base64
import io
import json

import numpy as np

MiB = 1 << 20


def noise_png(num_bytes: int, seed: int = 0) -> bytes:
    """An RGB PNG of random pixels (incompressible: stored, about `num_bytes` long)."""
    from PIL import Image
    side = int((num_bytes / 3) ** 0.5)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=0)
    return buf.getvalue()


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def load_rows(model: str, scale: float) -> list[tuple[str, list, int, bool | bytes]]:
    """(name, bodies, at once, probes) per row (see the module docstring). A body is bytes for
    /v1/chat/completions or (path, bytes); probes is True (plain one-token probes) or a probe's body."""
    def chat(content, **fields) -> bytes:
        return json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                           **fields}).encode()

    from vlm_sdk.testing.hostile_videos import many_frames, png_mov

    def video(url: str, **options) -> dict:
        return {"type": "video_url", "video_url": {"url": url, **options}}
    url_bytes = max(MiB, round(30 * MiB * scale))  # the data: URL's length
    payload = url_bytes * 3 // 4
    image_probe = chat([{"type": "image_url", "image_url": {"url": _data_url("image/png", noise_png(64 * 64 * 3))}},
                        {"type": "text", "text": "What is it?"}], max_tokens=1)
    fan_out = {"model": model, "stream": True, "logprobs": 20, "max_tokens": max(4, round(300 * scale)),
               "ignore_eos": True, "temperature": 1.0}
    long_text = ("All work and no play makes Jack a dull boy. " * (MiB // 44 + 1))[:MiB - 4096]
    return [
        ("41.3 image beside two hostile videos",
         [chat([video(_data_url("video/quicktime", png_mov(max(64, round(16000 * scale ** 0.5))))),
                {"type": "text", "text": "Describe it."}]),
          chat([video(_data_url("video/mp4", many_frames(max(100, round(1_000_000 * scale)), fps=1000,
                                                         keyframes=False)), nframes=2),
                {"type": "text", "text": "Describe it."}])], 2, image_probe),
        ("41.5 30 MiB data: URLs", [chat([{"type": "image_url", "image_url": {"url": _data_url("image/png",
                                                                                              noise_png(payload))}},
                                          {"type": "text", "text": "What is it?"}]),
                                    chat([video(_data_url("video/mp4", np.random.default_rng(1).bytes(payload))),
                                          {"type": "text", "text": "Describe it."}])], 1, False),
        ("41.6 completions fan-out", [("/v1/completions", json.dumps({**fan_out, "n": 8, "prompt": [
            f"Prompt number {i} says" for i in range(64)]}).encode()),
                                      ("/v1/completions", json.dumps({**fan_out, "n": 8, "prompt": [
                                          f"Prompt number {i} says" for i in range(8)]}).encode())], 1, True),
        ("41.8 texts just under 1 MiB", [chat(long_text), chat(long_text[::-1])], 2, True),
    ]
