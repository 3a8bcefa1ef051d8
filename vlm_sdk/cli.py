"""`vlm-sdk chat` streams an answer; `vlm-sdk bench` compares our engine with transformers."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from vlm_sdk.errors import VLMError


def cache_dir() -> Path:
    root = os.environ.get("VLM_SDK_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vlm_sdk")
    return Path(root)


def tiny_model_dir(kind: str = "tiny") -> Path:
    """The random-weight checkpoint used when no model is given, made once."""
    from vlm_sdk.testing import make_bench_checkpoint, make_tiny_checkpoint
    path = cache_dir() / f"{kind}-qwen2_5_vl"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        (make_bench_checkpoint if kind == "bench" else make_tiny_checkpoint)(tmp)
        tmp.rename(path)
    return path


async def _chat(args) -> int:
    from vlm_sdk import AsyncLLM, SamplingParams
    model = args.model
    if model is None:
        model = str(tiny_model_dir())
        print(f"[vlm-sdk] no --model given: using a tiny Qwen2.5-VL-shaped checkpoint with RANDOM weights at "
              f"{model}; its answer is gibberish. Pass --model /path/to/Qwen2.5-VL for a real one.",
              file=sys.stderr)
    content = [{"type": "image", "image": p} for p in args.image] + [{"type": "text", "text": args.question}]
    messages = [{"role": "user", "content": content}]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    engine_args = {"show_progress": True}
    if args.device:
        engine_args["device"] = args.device
    start = time.monotonic()
    async with AsyncLLM(model, **engine_args) as engine:
        peak_blocks = 0
        last = None
        t0 = time.monotonic()
        async for out in engine.chat_stream(messages, params):
            print(out.delta_text, end="", flush=True)
            peak_blocks = max(peak_blocks, engine.stats()["kv_blocks_used"])
            last = out
        stats = engine.stats()
    m = last.metrics
    elapsed = time.monotonic() - t0
    decode_time = (m.finished_time - m.first_token_time) if m.generated_tokens > 1 else None
    tps = (m.generated_tokens - 1) / decode_time if decode_time else float("nan")
    print()
    print(f"[vlm-sdk] prompt tokens {m.prompt_tokens} (image tokens {m.image_tokens}), generated "
          f"{m.generated_tokens} ({last.finish_reason}); time to first token {m.time_to_first_token * 1000:.0f} ms; "
          f"{tps:.1f} tokens/s after it; request {elapsed:.2f} s (start-up {t0 - start:.1f} s); "
          f"KV blocks used {peak_blocks}/{stats['kv_blocks_total']} at peak "
          f"(block {stats['kv_block_size']} tokens)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlm-sdk", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="ask one question, optionally about images, and stream the answer")
    chat.add_argument("question")
    chat.add_argument("--model", help="HF-format checkpoint directory (default: a tiny random one)")
    chat.add_argument("--image", action="append", default=[], help="image path (repeatable)")
    chat.add_argument("--max-tokens", type=int, default=64)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--device", default=None)
    bench = sub.add_parser("bench", help="our engine vs transformers generate on the same checkpoint")
    bench.add_argument("--model", help="checkpoint (default: a ~100M-parameter random Qwen2.5-VL)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--num-requests", type=int, default=16)
    bench.add_argument("--hf-batch-size", type=int, default=8)
    bench.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "chat":
            return asyncio.run(_chat(args))
        from vlm_sdk.benchmark import run_benchmark
        return run_benchmark(args)
    except VLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
