"""Caption every image in a folder, many requests in flight at once, through a server.

    python samples/batch_caption.py --url http://127.0.0.1:8000 photos/ --concurrency 8 --out captions.jsonl
    python samples/batch_caption.py samples/

One JSON line per image, in the order they finish: {"image", "caption", "finish_reason",
"prompt_tokens", "completion_tokens"}, or {"image", "error"} for an image the server refused (the
others still run; the exit status is then 1). Lines go to stdout or --out; a progress bar and the
rate (images/s, generated tokens/s) go to stderr. Without --url a server is started in this process
on the tiny checkpoint with RANDOM weights, so the captions are gibberish by design.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from vlm_sdk.client import APIConnectionError, AsyncClient
from vlm_sdk.errors import VLMError

EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"}


async def caption_folder(url: str, api_key: str | None, images: list[Path], out, *, concurrency: int,
                         prompt: str, max_tokens: int) -> int:
    """Caption `images`, writing one JSON line each to `out`; returns how many failed."""
    gate = asyncio.Semaphore(concurrency)  # bounds the requests in flight, and so the images in memory

    async def caption(client: AsyncClient, path: Path) -> dict:
        messages = [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": prompt}]}]
        async with gate:
            try:
                r = await client.chat(messages, max_tokens=max_tokens, temperature=0.0)
            except APIConnectionError:  # the server is gone: stop the whole run
                raise
            except VLMError as e:  # a refusal or an unreadable file fails this image alone
                return {"image": str(path), "error": str(e)}
        return {"image": str(path), "caption": r.text, "finish_reason": r.finish_reason,
                "prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens}

    failed, tokens = 0, 0
    t0 = time.perf_counter()
    async with AsyncClient(url, api_key, max_connections=concurrency) as client:
        with tqdm(total=len(images), unit="img", file=sys.stderr) as bar:
            for done in asyncio.as_completed([caption(client, p) for p in images]):
                line = await done
                failed += "error" in line
                tokens += line.get("completion_tokens", 0)
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
                out.flush()
                bar.update()
    wall = time.perf_counter() - t0
    print(f"{len(images) - failed}/{len(images)} images captioned in {wall:.2f} s: {len(images) / wall:.2f} "
          f"images/s, {tokens / wall:.1f} generated tokens/s (concurrency {concurrency})", file=sys.stderr)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--url", help="a running server (default: start one here on the tiny random model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt", default="Describe this image in one sentence.")
    parser.add_argument("--out", type=Path, help="JSON lines file (default: stdout)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"error: {args.folder} is not a folder", file=sys.stderr)
        return 2
    images = sorted(p for p in args.folder.iterdir() if p.suffix.lower() in EXTENSIONS and p.is_file())
    if not images:
        print(f"error: no images ({', '.join(sorted(EXTENSIONS))}) in {args.folder}", file=sys.stderr)
        return 2
    if args.concurrency < 1:
        print("error: --concurrency must be >= 1", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from vlm_sdk.demo_checkpoint import tiny_model_dir
            from vlm_sdk.server.background import BackgroundServer
            from vlm_sdk.server.config import ServerConfig
            print("[no --url: serving the tiny checkpoint with RANDOM weights in this process]", file=sys.stderr)
            url = stack.enter_context(BackgroundServer(tiny_model_dir(), ServerConfig(port=0))).url
        out = stack.enter_context(open(args.out, "w", encoding="utf-8")) if args.out else sys.stdout
        try:
            failed = asyncio.run(caption_folder(url, args.api_key, images, out, concurrency=args.concurrency,
                                                prompt=args.prompt, max_tokens=args.max_tokens))
        except VLMError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
