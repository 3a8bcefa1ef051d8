"""The official `openai` package (pip install openai) against `vlm-sdk serve`: a streamed chat with an
image sent as a base64 data URL, then the token usage.

    python samples/openai_client.py --url http://127.0.0.1:8000 --image samples/shapes.png "What is in this image?"
    python samples/openai_client.py

Nothing here is specific to vlm_sdk except the default: without --url a server is started in this
process on the tiny checkpoint with RANDOM weights (gibberish answers). The API key is whatever the
server was started with (--api-key), or any string when it has none.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import mimetypes
import sys
from pathlib import Path

import openai


def ask(url: str, api_key: str, image: Path, question: str, max_tokens: int) -> None:
    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key)
    model = client.models.list().data[0].id
    mime = mimetypes.guess_type(image.name)[0] or "image/png"
    data_url = f"data:{mime};base64,{base64.b64encode(image.read_bytes()).decode()}"
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "text", "text": question}]}],
        max_tokens=max_tokens, temperature=0.0, stream=True, stream_options={"include_usage": True})
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage  # the last chunk: no choices, only usage
    print()
    print(f"model {model}; usage: prompt_tokens={usage.prompt_tokens} completion_tokens={usage.completion_tokens} "
          f"total_tokens={usage.total_tokens}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="What is in this image?")
    parser.add_argument("--url", help="a running server (default: start one here on the tiny random model)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--image", type=Path, default=Path(__file__).resolve().parent / "shapes.png")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from vlm_sdk.demo_checkpoint import tiny_model_dir
            from vlm_sdk.server.background import BackgroundServer
            from vlm_sdk.server.config import ServerConfig
            print("[no --url: serving the tiny checkpoint with RANDOM weights in this process]", file=sys.stderr)
            url = stack.enter_context(BackgroundServer(tiny_model_dir(), ServerConfig(port=0))).url
        try:
            ask(url, args.api_key, args.image, args.question, args.max_tokens)
        except (openai.OpenAIError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
