"""`vlm-sdk bench-serve`: a server's throughput and latency over HTTP, next to the same workload run on
an in-process `AsyncLLM`, so the ratio is the cost of the HTTP layer.

Workload: N streaming chat requests, each the same image and question, greedy, `max_tokens` with eos
ignored (`ignore_eos`, an extension field the server accepts as vLLM does), at most C in flight. Both
sides get the same messages, parameters and engine settings, one warm-up request first, and count
the tokens they actually produced (HTTP: from `usage`).

Per request: TTFT is the time to the first non-empty piece of text (same rule on both sides), TPOT
is (latency - TTFT) / (completion tokens - 1). Throughput is all output tokens over the wall time of
the whole run. Without `--url` a server is started as a child process (`vlm-sdk serve --port 0`, as
it would be deployed) on `--model` (default: the tiny random checkpoint). The two sides take turns, `--rounds` times (HTTP, then in
process), while both engines stay loaded (the idle one blocks on its queue): a shared VM's speed
drifts by tens of percent between minutes, and alternating puts both sides under the same drift.
On CUDA both engines hold a KV cache at once: a server started here and the in-process engine are each
sized for half the device (`device_share.py`); with `--url` the in-process engine takes what is left.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

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



def run_bench_serve(args) -> int:
    from vlm_sdk.bench.device_share import bench_device, shared_engine_args
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    from vlm_sdk.client import to_data_url
    from vlm_sdk.errors import InvalidRequestError

    if min(args.num_requests, args.concurrency, args.max_tokens, args.rounds) < 1:
        raise InvalidRequestError("--num-requests, --concurrency, --max-tokens and --rounds must each be >= 1")
    model_dir = args.model or (None if args.url else str(tiny_model_dir()))
    compare = args.compare_inprocess if args.compare_inprocess is not None else model_dir is not None
    if compare and model_dir is None:
        raise InvalidRequestError("--compare-inprocess with --url needs --model, the checkpoint directory the "
                                  "server runs, to build the in-process engine from")
    try:
        image = Path(args.image).read_bytes()
    except OSError as e:
        raise InvalidRequestError(f"cannot read --image {args.image!r}: {e}") from e
    device = bench_device(args.device)
    engine_args = {"show_progress": False, "device": device}
    # a server started here and the in-process engine hold their caches at once: each takes its share
    server_share, inprocess_share = shared_engine_args(device, 2) if args.url is None and compare else ({}, {})
    # the HTTP side gets the image pre-encoded, so client-side base64 is not counted as server time
    http_messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": to_data_url(image)}},
                                                  {"type": "text", "text": args.prompt}]}]
    report = {"url": args.url, "model": model_dir, "num_requests": args.num_requests,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "image": str(args.image), "rounds": args.rounds,
              "engine_shares": {"server": server_share, "inprocess": inprocess_share}}

    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": args.prompt}]}]
    with contextlib.ExitStack() as stack:
        url, server = args.url, None
        if url is None:  # a server process of its own, as deployed: its loop shares no GIL with this client
            server = stack.enter_context(ServerProcess(model_dir, {**engine_args, **server_share}))
            url = report["url"] = server.url
        engine = None
        if compare:
            from vlm_sdk import AsyncLLM
            engine = AsyncLLM(model_dir, **engine_args, **inprocess_share)  # idle (blocked on its queue) during HTTP rounds
        rounds = asyncio.run(_rounds(url, args.api_key if args.url else None, args.served_model, http_messages,
                                     engine, messages, args))
        report["http"] = _merge([r[0] for r in rounds])
        report["http"]["server_stats"] = server.stats() if server is not None else None
        if server is not None:
            report["http"]["server_exit_code"] = server.stop()
        if compare:
            report["inprocess"] = _merge([r[1] for r in rounds])
            report["inprocess"]["stats"] = engine.stats()
            report["round_ratios"] = [h["output_tokens"] / h["seconds"] / (i["output_tokens"] / i["seconds"])
                                      for h, i in rounds]
            report["ratio"] = report["http"]["output_tokens_per_s"] / report["inprocess"]["output_tokens_per_s"]
            report["same_token_counts"] = report["http"]["output_tokens"] == report["inprocess"]["output_tokens"]

    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_report(report)
    return 0 if report["http"]["failed"] == 0 else 1


class ServerProcess:
    """`vlm-sdk serve MODEL --port 0` in a child process; stopped with SIGTERM (graceful drain)."""

    def __init__(self, model_dir: str, engine_args: dict):
        self.model_dir = model_dir
        self.engine_args = engine_args
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def __enter__(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "vlm_sdk.cli", "serve", self.model_dir, "--port", "0"]
        for key, value in self.engine_args.items():
            if key != "show_progress":
                cmd += ["--" + key.replace("_", "-"), str(value)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for line in self.proc.stdout:
            match = re.search(r" at (http://\S+) \(OpenAI API", line)
            if match:
                self.url = match.group(1)
                return self
        code = self.proc.wait()
        raise RuntimeError(f"the server process exited with {code} before listening: {' '.join(cmd)}")

    def stats(self) -> dict:
        """KV cache use read from the server's /metrics."""
        import urllib.request
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        found = {}
        for name in ("kv_blocks_used", "kv_blocks_total"):
            match = re.search(rf"^vlm_sdk_{name}{{[^}}]*}} (\S+)$", text, re.M)
            found[name] = int(float(match.group(1))) if match else None
        return found

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


async def _rounds(url: str, api_key: str | None, model: str | None, http_messages, engine, messages,
                  args) -> list[tuple[dict, dict | None]]:
    """`--rounds` times: the workload over HTTP, then (with an engine) the same in process. The VM's
    speed drifts; alternating keeps both sides under the same conditions."""
    from vlm_sdk import SamplingParams
    from vlm_sdk.client import AsyncClient
    http_params = dict(model=model, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def local(p: SamplingParams = params) -> StreamTiming:
        t0 = time.perf_counter()
        ttft, last = None, None
        async for out in engine.chat_stream(messages, p):
            if ttft is None and out.delta_text:
                ttft = time.perf_counter() - t0
            last = out
        latency = time.perf_counter() - t0
        return StreamTiming(last.text, last.finish_reason, len(last.prompt_token_ids), len(last.token_ids),
                            latency if ttft is None else ttft, latency)

    results = []
    async with AsyncClient(url, api_key, max_connections=args.concurrency) as client:
        # warm-up (also fetches the model name)
        await timed_stream(client, http_messages, **{**http_params, "max_tokens": 2})
        if engine is not None:
            await local(SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        for _ in range(args.rounds):
            http = await _drive(lambda: timed_stream(client, http_messages, **http_params), args.num_requests,
                                args.concurrency)
            inproc = await _drive(local, args.num_requests, args.concurrency) if engine is not None else None
            results.append((http, inproc))
        if engine is not None:
            await engine.shutdown()
    return results


def _merge(runs: list[dict]) -> dict:
    """Rounds pooled: throughput over the summed wall time, percentiles over every request."""
    wall = sum(r["seconds"] for r in runs)
    timings = [t for r in runs for t in r["timings"]]
    out_tokens = sum(r["output_tokens"] for r in runs)
    tpots = [t.tpot_s for t in timings if t.tpot_s is not None]
    return {"rounds": len(runs), "completed": sum(r["completed"] for r in runs),
            "failed": sum(r["failed"] for r in runs), "errors": [e for r in runs for e in r["errors"]][:3],
            "seconds": wall, "requests_per_s": len(timings) / wall, "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall,
            "prompt_tokens": timings[0].prompt_tokens if timings else None,
            "finish_reasons": sorted({t.finish_reason for t in timings}, key=str),
            "ttft_ms": _dist([t.ttft_s for t in timings]), "tpot_ms": _dist(tpots),
            "latency_ms": _dist([t.latency_s for t in timings])}


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
    return {"completed": len(ok), "failed": len(errors), "errors": errors[:3], "seconds": wall,
            "output_tokens": sum(r.completion_tokens for r in ok), "timings": ok}


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
        rounds = ", ".join(f"{x:.2f}" for x in r["round_ratios"])
        print(f"  ratio http/in-process output tokens/s: {r['ratio']:.2f}x over {len(r['round_ratios'])} "
              f"alternating rounds (each: {rounds}; output tokens {r['http']['output_tokens']} vs "
              f"{r['inprocess']['output_tokens']})")
    stats = r["http"].get("server_stats")
    if stats:
        print(f"  server KV blocks used after the run: {stats['kv_blocks_used']}/{stats['kv_blocks_total']}")
    for err in r["http"]["errors"]:
        print(f"  http error: {err}", file=sys.stderr)

