"""Ask about a video and stream the answer, in this process or from a server.

    python samples/video_qa.py --video clip.mp4 "What happens in this video?"
    python samples/video_qa.py --video clip.mp4 --fps 1 --max-frames 32 "Describe each scene."
    python samples/video_qa.py --model /models/Qwen2.5-VL-3B-Instruct --video clip.mp4 "What happens?"
    python samples/video_qa.py --url http://127.0.0.1:8000 --video clip.mp4 "What happens?"

Without --video a 3-second demo clip (moving colour bands) is written to a temporary file first.
Without --url the model runs here on an `AsyncLLM`: --model, or by default the tiny Qwen2.5-VL-shaped
checkpoint with RANDOM weights (built once under ~/.cache/vlm_sdk), whose answer is gibberish by
design. With --url the question goes to a running `vlm-sdk serve` through
`vlm_sdk.client.AsyncClient`, which sends the file as a base64 data URL in a `video_url` part.

The video part carries qwen-vl-utils' settings (--fps: frames sampled per second, default 2;
--max-frames); InternVL samples --max-frames frames (default 8) and takes no --fps. The answer
streams to stdout; the figures (prompt tokens, video tokens, time to first token) go to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from vlm_sdk.errors import VLMError
from vlm_sdk.outputs import terminal_text  # control characters in model text shown as escapes


def show(out: str) -> None:
    print(terminal_text(out), end="", flush=True)


def messages(video: str, question: str, fps: float | None, max_frames: int | None) -> list[dict]:
    options = {k: v for k, v in (("fps", fps), ("max_frames", max_frames)) if v is not None}
    return [{"role": "user", "content": [{"type": "video", "video": video, **options},
                                         {"type": "text", "text": question}]}]


async def over_http(url: str, api_key: str | None, msgs: list, max_tokens: int) -> None:
    from vlm_sdk.client import AsyncClient

    async with AsyncClient(url, api_key) as client:
        t0, ttft, usage = time.perf_counter(), None, None
        async for delta in client.chat_stream(msgs, max_tokens=max_tokens, temperature=0.0):
            if delta.text:
                ttft = time.perf_counter() - t0 if ttft is None else ttft
                show(delta.text)
            usage = delta.usage or usage
    print()
    if usage is None:
        raise VLMError(f"{url} sent no usage with the stream; cannot show the figures")
    print(f"[{usage.prompt_tokens} prompt tokens (video included); time to first token "
          f"{(ttft or 0.0) * 1000:.0f} ms (upload, decoding and prefill); {usage.completion_tokens} generated]",
          file=sys.stderr)


async def in_process(model: str, msgs: list, max_tokens: int) -> None:
    from vlm_sdk import AsyncLLM, SamplingParams  # loads torch: only on this path

    async with AsyncLLM(model, show_progress=False) as engine:
        t0 = time.perf_counter()
        prompt = await engine.build_prompt(msgs)  # decoding and preprocessing, off the event loop
        built = time.perf_counter() - t0
        last = None
        async for out in engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
            show(out.delta_text)
            last = out
    print()
    print(f"[{len(prompt.token_ids)} prompt tokens, {sum(prompt.image_tokens)} of them the video's "
          f"({len(prompt.images)} vision items); decoding + preprocessing {built * 1000:.0f} ms, then time to "
          f"first token {last.metrics.time_to_first_token * 1000:.0f} ms; {len(last.token_ids)} generated]",
          file=sys.stderr)


def demo_clip() -> str:
    from vlm_sdk.testing.videos import write_video
    path = Path(tempfile.mkdtemp(prefix="vlm_sdk_video_")) / "demo.mp4"
    write_video(path, frames=72, fps=24, width=320, height=240)
    print(f"[no --video: a 3 s demo clip at {path}]", file=sys.stderr)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="What happens in this video?")
    parser.add_argument("--video", help="a video file (default: a demo clip written now)")
    parser.add_argument("--fps", type=float, default=None, help="frames sampled per second (Qwen; default 2)")
    parser.add_argument("--max-frames", type=int, default=None, help="the most frames sampled")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--model", help="checkpoint directory to run in this process (default: tiny random)")
    parser.add_argument("--api-key", default=None, help="bearer token for --url")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if not args.question.strip():
        parser.error("the question needs some text")
    try:
        msgs = messages(args.video or demo_clip(), args.question, args.fps, args.max_frames)
        if args.url:
            asyncio.run(over_http(args.url, args.api_key, msgs, args.max_tokens))
        else:
            model = args.model
            if model is None:
                from vlm_sdk.demo_checkpoint import tiny_model_dir
                model = str(tiny_model_dir())
                print(f"[no --model: tiny checkpoint with RANDOM weights at {model}; expect gibberish]",
                      file=sys.stderr)
            asyncio.run(in_process(model, msgs, args.max_tokens))
    except VLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
