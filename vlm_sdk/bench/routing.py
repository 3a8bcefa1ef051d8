"""`vlm-sdk bench-serve --replicas N`: cache-aware vs round-robin routing over N data-parallel replicas
on Ray Serve (vlm_sdk/replicas/), on a multi-turn image workload.

Workload: `--users` conversations at once, each about an image of its own, each sending its next
turn (`--turns`) when the last answer has streamed in; greedy, `--max-tokens` with eos ignored. Every
user is a tenant (a cache salt of its own per run), so a run only hits the blocks it made itself.
The same replicas serve both policies (the router reads the policy per request), the two taking
turns `--rounds` times under the same drift of a shared machine. Reported per policy: output tokens
per second over the run's wall time, TTFT (to the first text) mean / p50 / p90, and the prompt tokens
served from the replicas' prefix caches; then cache-aware / round-robin ratios.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import time

POLICIES = ("round_robin", "cache_aware")


def _user_image(user: int, size: int) -> bytes:
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(1000 + user)
    blobs = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((size, size), Image.BICUBIC)
    buf = io.BytesIO()
    blobs.save(buf, "PNG")
    return buf.getvalue()


def _conversation(image_url: str, answers: list[str]) -> list[dict]:
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                         {"type": "text", "text": "Describe my picture."}]}]
    for turn, answer in enumerate(answers, start=1):
        msgs += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": f"Turn {turn + 1}: tell me more about the left side."}]
    return msgs


async def _run(url: str, images: list[str], turns: int, max_tokens: int, salt: str) -> dict:
    from vlm_sdk.bench.serve import timed_stream
    from vlm_sdk.client import AsyncClient
    timings = []

    async def user(client, u: int) -> None:
        answers = []
        for _ in range(turns):
            t = await timed_stream(client, _conversation(images[u], answers), max_tokens=max_tokens, temperature=0,
                                   ignore_eos=True, cache_salt=f"{salt}-{u}")
            answers.append(t.text)
            timings.append(t)
    t0 = time.perf_counter()
    async with AsyncClient(url) as client:
        await asyncio.gather(*(user(client, u) for u in range(len(images))))
    seconds = time.perf_counter() - t0
    ttfts = sorted(t.ttft_s for t in timings)
    return {"seconds": seconds, "requests": len(timings), "output_tokens": sum(t.completion_tokens for t in timings),
            "prompt_tokens": sum(t.prompt_tokens for t in timings), "ttft_s": ttfts}


def _summary(runs: list[dict], cached: int) -> dict:
    ttfts = sorted(x for r in runs for x in r["ttft_s"])
    seconds, tokens = sum(r["seconds"] for r in runs), sum(r["output_tokens"] for r in runs)
    prompt = sum(r["prompt_tokens"] for r in runs)
    return {"seconds": seconds, "requests": sum(r["requests"] for r in runs), "output_tokens": tokens,
            "output_tokens_per_s": tokens / seconds, "ttft_mean_s": sum(ttfts) / len(ttfts),
            "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "prompt_tokens": prompt, "cached_prompt_tokens": cached, "cached_share": cached / prompt if prompt else 0.0}


def run_routing_bench(args, front) -> int:
    """`front(model, engine)`: an HTTP server on `engine` as a context manager with `.url` (the CLI
    passes `vlm_sdk.server.background.BackgroundServer`; the benchmarks sit beside the server, not above)."""
    from vlm_sdk.bench.device_share import bench_device
    from vlm_sdk.client import to_data_url
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    from vlm_sdk.errors import InvalidRequestError
    from vlm_sdk.replicas import require_ray
    require_ray()
    from vlm_sdk.replicas.launch import ReplicaConfig, serve_replicas
    from vlm_sdk.replicas.routing import RoutingConfig
    if args.url is not None:
        raise InvalidRequestError("--replicas starts its own replicas: leave out --url")
    if min(args.replicas, args.users, args.turns, args.max_tokens, args.rounds) < 1:
        raise InvalidRequestError("--replicas, --users, --turns, --max-tokens and --rounds must each be >= 1")
    model = args.model or str(tiny_model_dir())
    period = 0.2
    llm = serve_replicas(model, ReplicaConfig(data_parallel_size=args.replicas,
                                              replica_cpus=min(1.0, (os.cpu_count() or 1) / args.replicas)),
                         RoutingConfig(stats_period_s=period), device=bench_device(args.device))
    runs = {p: [] for p in POLICIES}
    cached = dict.fromkeys(POLICIES, 0)
    try:
        servers = {p: front(model, llm.with_routing(RoutingConfig(policy=p))) for p in POLICIES}
        for srv in servers.values():
            srv.__enter__()
        try:
            for r in range(args.rounds):
                for p in POLICIES:
                    images = [to_data_url(_user_image(100 * r + u, args.image_size)) for u in range(args.users)]
                    before = llm.stats()["prefix_cache_hit_tokens"]
                    runs[p].append(asyncio.run(_run(servers[p].url, images, args.turns, args.max_tokens, f"{p}-{r}")))
                    time.sleep(3 * period)  # every replica's last stats report is in
                    cached[p] += llm.stats()["prefix_cache_hit_tokens"] - before
        finally:
            for srv in servers.values():
                srv.__exit__(None, None, None)
    finally:
        asyncio.run(llm.shutdown())
    report = {"model": model, "replicas": args.replicas, "users": args.users, "turns": args.turns,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "image_size": args.image_size,
              **{p: _summary(runs[p], cached[p]) for p in POLICIES}}
    aware, rr = report["cache_aware"], report["round_robin"]
    report["throughput_ratio"] = aware["output_tokens_per_s"] / rr["output_tokens_per_s"]
    report["ttft_mean_ratio"] = aware["ttft_mean_s"] / rr["ttft_mean_s"]
    report["cached_tokens_ratio"] = aware["cached_prompt_tokens"] / max(1, rr["cached_prompt_tokens"])
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{args.replicas} replicas, {args.users} users x {args.turns} turns, {args.max_tokens} tokens each, "
              f"{args.rounds} rounds per policy ({model})")
        print(f"{'policy':<12} {'tok/s':>8} {'TTFT mean':>10} {'p50':>7} {'p90':>7} {'cached prompt tokens':>22}")
        for p in POLICIES:
            s = report[p]
            print(f"{p:<12} {s['output_tokens_per_s']:>8.1f} {s['ttft_mean_s'] * 1e3:>8.1f}ms "
                  f"{s['ttft_p50_s'] * 1e3:>5.0f}ms {s['ttft_p90_s'] * 1e3:>5.0f}ms "
                  f"{s['cached_prompt_tokens']:>8} ({100 * s['cached_share']:.0f}% of prompt)")
        print(f"cache-aware / round-robin: throughput x{report['throughput_ratio']:.2f}, mean TTFT "
              f"x{report['ttft_mean_ratio']:.2f}, cached prompt tokens x{report['cached_tokens_ratio']:.2f}")
    return 0
