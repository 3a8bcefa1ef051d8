"""Ask a question about an image and stream the answer, in this process or from a server.

    python samples/image_qa.py --image samples/shapes.png "What is in this image?"
    python samples/image_qa.py --model /models/Qwen2.5-VL-3B-Instruct --image cat.jpg "What is in this image?"
    python samples/image_qa.py --url http://127.0.0.1:8000 --image samples/shapes.png "What is in this image?"

Without --url the model runs here on an `AsyncLLM`: --model, or by default the tiny checkpoint with
RANDOM weights (built once under ~/.cache/vlm_sdk), whose answer is gibberish by design. With --url
the question goes to a running `vlm-sdk serve` through `vlm_sdk.client.AsyncClient`, which sends the
image as a base64 data URL. The answer streams to stdout; token counts go to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from vlm_sdk.errors import VLMError
from vlm_sdk.outputs import terminal_text  # control characters in model text shown as escapes


async def ask_server(url: str, api_key: str | None, messages: list, max_tokens: int) -> None:
    from vlm_sdk.client import AsyncClient
    usage = None
    async with AsyncClient(url, api_key) as client:
        async for delta in client.chat_stream(messages, max_tokens=max_tokens, temperature=0.0):
            print(terminal_text(delta.text), end="", flush=True)
            usage = delta.usage or usage
    print()
    if usage is not None:
        print(f"[{usage.prompt_tokens} prompt tokens (image included), {usage.completion_tokens} generated]",
              file=sys.stderr)


async def ask_in_process(model: str, messages: list, max_tokens: int) -> None:
    from vlm_sdk import AsyncLLM, SamplingParams  # loads torch: only on this path
    last = None
    async with AsyncLLM(model, show_progress=False) as engine:
        async for out in engine.chat_stream(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
            print(terminal_text(out.delta_text), end="", flush=True)
            last = out
    print()
    print(f"[{len(last.prompt_token_ids)} prompt tokens (image included), {len(last.token_ids)} generated]",
          file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="What is in this image?")
    parser.add_argument("--image", default=str(Path(__file__).resolve().parent / "shapes.png"))
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--model", help="checkpoint directory to run in this process (default: tiny random)")
    parser.add_argument("--api-key", default=None, help="bearer token for --url")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    messages = [{"role": "user", "content": [{"type": "image", "image": args.image},
                                             {"type": "text", "text": args.question}]}]
    try:
        if args.url:
            asyncio.run(ask_server(args.url, args.api_key, messages, args.max_tokens))
        else:
            model = args.model
            if model is None:
                from vlm_sdk.demo_checkpoint import tiny_model_dir
                model = str(tiny_model_dir())
                print(f"[no --model: tiny checkpoint with RANDOM weights at {model}; expect gibberish]",
                      file=sys.stderr)
            asyncio.run(ask_in_process(model, messages, args.max_tokens))
    except VLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
