"""`vlm-sdk bench-serve`: a server's throughput and latency over HTTP, next to the same workload run on
an in-process `AsyncLLM`, so the ratio is the cost of the HTTP layer.

Workload: N streaming chat requests, each the same image and question, greedy, `max_tokens` with eos
ignored (`ignore_eos`, an extension field the server accepts as vLLM does), at most C in flight. Both
sides get the same messages, parameters and engine settings, one warm-up request first, and count
the tokens they actually produced (HTTP: from `usage`).

Per request: TTFT is the time to the first non-empty piece of text (same rule on both sides), TPOT
is (latency - TTFT) / (completion tokens - 1). Throughput is all output tokens over the wall time of
the whole run. Without `--url` a server is started in this process on `--model` (default: the tiny
random checkpoint) on a free port, and stopped before the in-process engine is built, so the two
never share a device.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

DEFAULT_IMAGE = Path(__file__).resolve().parents[1] / "samples" / "shapes.png"


@dataclass(frozen=True)
class StreamTiming:
    """One streamed request as its caller saw it."""
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # to the first non-empty text (the whole latency if there was none)
    latency_s: float

    @property
    def tpot_s(self) -> float | None:
        n = self.completion_tokens
        return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else None


async def timed_stream(client, messages: list[dict], on_text: Callable[[str], None] | None = None,
                       **params) -> StreamTiming:
    """Stream one request through an `AsyncClient`, timing it; `on_text` gets each new piece."""
    t0 = time.perf_counter()
    ttft, pieces, finish, usage = None, [], None, None
    async for delta in client.chat_stream(messages, **params):
        if delta.text:
            if ttft is None:
                ttft = time.perf_counter() - t0
            pieces.append(delta.text)
            if on_text is not None:
                on_text(delta.text)
        finish = delta.finish_reason or finish
        usage = delta.usage or usage
    latency = time.perf_counter() - t0
    return StreamTiming("".join(pieces), finish, usage.prompt_tokens if usage else 0,
                        usage.completion_tokens if usage else 0, latency if ttft is None else ttft, latency)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running server (default: start one in this process on --model)")
    p.add_argument("--api-key", default=os.environ.get("VLM_SDK_API_KEY"),
                   help="bearer token for --url (default: $VLM_SDK_API_KEY)")
    p.add_argument("--model", help="checkpoint directory for the in-process server and the in-process "
                                   "comparison (default without --url: the tiny random checkpoint)")
    p.add_argument("--served-model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (eos ignored)")
    p.add_argument("--image", default=str(DEFAULT_IMAGE), help="image sent with every request")
    p.add_argument("--prompt", default="Describe this image in detail.")
    p.add_argument("--compare-inprocess", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the workload on an in-process AsyncLLM (default: on when a checkpoint is "
                        "known, i.e. without --url or with --model)")
    p.add_argument("--device", default=None, help="device of the engines started here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_bench_serve(args) -> int:
    from vlm_sdk.cli import tiny_model_dir
    from vlm_sdk.client import to_data_url
    from vlm_sdk.errors import InvalidRequestError

    if args.num_requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        raise InvalidRequestError("--num-requests, --concurrency and --max-tokens must each be >= 1")
    model_dir = args.model or (None if args.url else str(tiny_model_dir()))
    compare = args.compare_inprocess if args.compare_inprocess is not None else model_dir is not None
    if compare and model_dir is None:
        raise InvalidRequestError("--compare-inprocess with --url needs --model, the checkpoint directory the "
                                  "server runs, to build the in-process engine from")
    try:
        image = Path(args.image).read_bytes()
    except OSError as e:
        raise InvalidRequestError(f"cannot read --image {args.image!r}: {e}") from e
    engine_args = {"show_progress": False, **({"device": args.device} if args.device else {})}
    # the HTTP side gets the image pre-encoded, so client-side base64 is not counted as server time
    http_messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": to_data_url(image)}},
                                                  {"type": "text", "text": args.prompt}]}]
    report = {"url": args.url, "model": model_dir, "num_requests": args.num_requests,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "image": str(args.image)}

    if args.url:
        report["http"] = asyncio.run(_bench_http(args.url, args.api_key, args.served_model, http_messages, args))
        report["http"]["server_stats"] = None  # a remote server's engine is not visible from here
    else:
        from vlm_sdk.server.background import BackgroundServer
        from vlm_sdk.server.config import ServerConfig
        with BackgroundServer(model_dir, ServerConfig(port=0), **engine_args) as srv:
            report["url"] = srv.url
            report["http"] = asyncio.run(_bench_http(srv.url, None, args.served_model, http_messages, args))
            report["http"]["server_stats"] = srv.stats()
    if compare:
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": args.prompt}]}]
        report["inprocess"] = asyncio.run(_bench_inprocess(model_dir, engine_args, messages, args))
        report["ratio"] = report["http"]["output_tokens_per_s"] / report["inprocess"]["output_tokens_per_s"]
        report["same_token_counts"] = report["http"]["output_tokens"] == report["inprocess"]["output_tokens"]

    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    return 0 if report["http"]["failed"] == 0 else 1


async def _bench_http(url: str, api_key: str | None, model: str | None, messages, args) -> dict:
    from vlm_sdk.client import AsyncClient
    params = dict(model=model, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    async with AsyncClient(url, api_key, max_connections=args.concurrency) as client:
        await timed_stream(client, messages, **{**params, "max_tokens": 2})  # warm-up, also fetches the model name
        return await _drive(lambda: timed_stream(client, messages, **params), args.num_requests, args.concurrency)


async def _bench_inprocess(model_dir: str, engine_args: dict, messages, args) -> dict:
    from vlm_sdk import AsyncLLM, SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def one(p: SamplingParams = params) -> StreamTiming:
        t0 = time.perf_counter()
        ttft, last = None, None
        async for out in engine.chat_stream(messages, p):
            if ttft is None and out.delta_text:
                ttft = time.perf_counter() - t0
            last = out
        latency = time.perf_counter() - t0
        return StreamTiming(last.text, last.finish_reason, len(last.prompt_token_ids), len(last.token_ids),
                            latency if ttft is None else ttft, latency)

    # the constructor loads weights on this thread; nothing else is running on this loop yet
    async with AsyncLLM(model_dir, **engine_args) as engine:
        await one(SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
        result = await _drive(one, args.num_requests, args.concurrency)
        result["stats"] = engine.stats()
    return result


async def _drive(make: Callable[[], Awaitable[StreamTiming]], n: int, concurrency: int) -> dict:
    """Run `make()` n times with at most `concurrency` in flight; failures are counted, not raised."""
    gate = asyncio.Semaphore(concurrency)

    async def gated():
        async with gate:
            return await make()

    t0 = time.perf_counter()
    results = await asyncio.gather(*(gated() for _ in range(n)), return_exceptions=True)
    wall = time.perf_counter() - t0
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, Exception):
            raise r  # cancellation and KeyboardInterrupt are not request failures
    ok = [r for r in results if isinstance(r, StreamTiming)]
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, Exception)]
    out_tokens = sum(r.completion_tokens for r in ok)
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    return {"completed": len(ok), "failed": len(errors), "errors": errors[:3], "seconds": wall,
            "requests_per_s": len(ok) / wall, "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / wall,
            "prompt_tokens": ok[0].prompt_tokens if ok else None,
            "finish_reasons": sorted({r.finish_reason for r in ok}, key=str),
            "ttft_ms": _dist([r.ttft_s for r in ok]), "tpot_ms": _dist(tpots),
            "latency_ms": _dist([r.latency_s for r in ok])}


def _dist(values_s: list[float]) -> dict:
    if not values_s:
        return {"mean": None, "p50": None, "p99": None}
    ms = sorted(v * 1000.0 for v in values_s)
    return {"mean": sum(ms) / len(ms), "p50": _percentile(ms, 50), "p99": _percentile(ms, 99)}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _print_report(r: dict) -> None:
    def fmt(x) -> str:
        return "   n/a" if x is None else f"{x:6.1f}"

    print(f"bench-serve {r['url']}: {r['num_requests']} requests, concurrency {r['concurrency']}, max_tokens "
          f"{r['max_tokens']} (eos ignored), image {r['image']}, prompt {r['http']['prompt_tokens']} tokens")
    print(f"  {'':11} {'req/s':>7} {'out tok/s':>10}   TTFT ms p50 / p99   TPOT ms p50 / p99   failed")
    for name, key in (("http", "http"), ("in-process", "inprocess")):
        if key in r:
            s = r[key]
            print(f"  {name:11} {s['requests_per_s']:7.2f} {s['output_tokens_per_s']:10.1f}   "
                  f"{fmt(s['ttft_ms']['p50'])} / {fmt(s['ttft_ms']['p99'])}     "
                  f"{fmt(s['tpot_ms']['p50'])} / {fmt(s['tpot_ms']['p99'])}     {s['failed']}")
    if "ratio" in r:
        print(f"  ratio http/in-process output tokens/s: {r['ratio']:.2f}x "
              f"(output tokens {r['http']['output_tokens']} vs {r['inprocess']['output_tokens']})")
    stats = r["http"].get("server_stats")
    if stats:
        print(f"  server KV blocks used after the run: {stats['kv_blocks_used']}/{stats['kv_blocks_total']}")
    for err in r["http"]["errors"]:
        print(f"  http error: {err}", file=sys.stderr)

