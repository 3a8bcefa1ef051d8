"""Ask about an image and stream the answer, in this process or from a server; follow-up questions
continue the same conversation.

    python samples/image_qa.py --image samples/shapes.png "What is in this image?"
    python samples/image_qa.py --image samples/shapes.png "What is in this image?" \\
        --follow-up "Which shape is largest?" --follow-up "What colour is it?"
    python samples/image_qa.py --model /models/Qwen2.5-VL-3B-Instruct --image cat.jpg "What is in this image?"
    python samples/image_qa.py --url http://127.0.0.1:8000 --image samples/shapes.png "What is in this image?"

Without --url the model runs here on an `AsyncLLM`: --model, or by default the tiny checkpoint with
RANDOM weights (built once under ~/.cache/vlm_sdk), whose answer is gibberish by design. With --url
the question goes to a running `vlm-sdk serve` through `vlm_sdk.client.AsyncClient`, which sends the
image as a base64 data URL.

Each --follow-up is one more turn: the whole conversation so far (the image, every question and
answer) is sent again, as a chat client does. The prefix cache recognises what it has seen, so a
follow-up's prompt is mostly served from the cache and its first token comes sooner; the line after
each answer shows how many prompt tokens were cached and the time to the first token.
Answers stream to stdout, one after another; follow-up questions and the figures go to stderr.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable, NamedTuple

from vlm_sdk.errors import VLMError
from vlm_sdk.outputs import terminal_text  # control characters in model text shown as escapes


class Turn(NamedTuple):  # not a dataclass: one fails when this file is loaded by path, as the tests do
    answer: str
    prompt_tokens: int  # image tokens included
    cached_tokens: int | None  # of prompt_tokens, served from the prefix cache; None: the server did not say
    generated: int
    ttft_s: float  # time to the first token


def show(out: str) -> None:
    print(terminal_text(out), end="", flush=True)


async def converse(ask: Callable[[list], Awaitable[Turn]], image: str, questions: list[str]) -> None:
    """Ask each question in turn, each with the whole conversation before it."""
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": questions[0]}]}]
    for n, question in enumerate(questions, 1):
        if n > 1:
            messages.append({"role": "user", "content": question})
            print(f"[turn {n}] {question}", file=sys.stderr, flush=True)
        turn = await ask(messages)
        print()
        cached = "?" if turn.cached_tokens is None else turn.cached_tokens
        print(f"[turn {n}: {turn.prompt_tokens} prompt tokens (image included), {cached} cached; "
              f"time to first token {turn.ttft_s * 1000:.0f} ms; {turn.generated} generated]",
              file=sys.stderr, flush=True)
        messages.append({"role": "assistant", "content": turn.answer})


async def over_http(url: str, api_key: str | None, image: str, questions: list[str], max_tokens: int) -> None:
    from vlm_sdk.client import AsyncClient

    async with AsyncClient(url, api_key) as client:
        async def ask(messages: list) -> Turn:
            t0, ttft, pieces, usage = time.perf_counter(), None, [], None
            async for delta in client.chat_stream(messages, max_tokens=max_tokens, temperature=0.0):
                if delta.text:
                    # the first text piece: what a person waits for (as `vlm-sdk chat --url` times it)
                    ttft = time.perf_counter() - t0 if ttft is None else ttft
                    pieces.append(delta.text)
                    show(delta.text)
                usage = delta.usage or usage
            if usage is None:
                raise VLMError(f"{url} sent no usage with the stream; cannot show the turn's figures")
            elapsed = time.perf_counter() - t0
            return Turn("".join(pieces), usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                        elapsed if ttft is None else ttft)

        await converse(ask, image, questions)


async def in_process(model: str, image: str, questions: list[str], max_tokens: int) -> None:
    from vlm_sdk import AsyncLLM, SamplingParams  # loads torch: only on this path

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async with AsyncLLM(model, show_progress=False) as engine:
        async def ask(messages: list) -> Turn:
            last = None
            async for out in engine.chat_stream(messages, params):
                show(out.delta_text)
                last = out
            return Turn(last.text, len(last.prompt_token_ids), last.num_cached_tokens, len(last.token_ids),
                        last.metrics.time_to_first_token)

        await converse(ask, image, questions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="What is in this image?")
    parser.add_argument("--follow-up", action="append", default=[], metavar="QUESTION",
                        help="another question about the same image, in the same conversation (repeatable)")
    parser.add_argument("--image", default=str(Path(__file__).resolve().parent / "shapes.png"))
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--model", help="checkpoint directory to run in this process (default: tiny random)")
    parser.add_argument("--api-key", default=None, help="bearer token for --url")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    questions = [args.question, *args.follow_up]
    if not all(q.strip() for q in questions):
        parser.error("every question, --follow-up ones included, needs some text")
    try:
        if args.url:
            asyncio.run(over_http(args.url, args.api_key, args.image, questions, args.max_tokens))
        else:
            model = args.model
            if model is None:
                from vlm_sdk.demo_checkpoint import tiny_model_dir
                model = str(tiny_model_dir())
                print(f"[no --model: tiny checkpoint with RANDOM weights at {model}; expect gibberish]",
                      file=sys.stderr)
            asyncio.run(in_process(model, args.image, questions, args.max_tokens))
    except VLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
