"""`vlm-sdk chat` streams an answer (in process, or from a server with --url); `vlm-sdk bench` compares
our engine with transformers (`--gpu`: the Qwen2.5-VL-3B GPU figures; `--multi-turn`: prefix caching and
the encoder cache on vs off); `vlm-sdk bench-serve` measures a server over HTTP."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from vlm_sdk.config import KV_CACHE_DTYPES
from vlm_sdk.demo_checkpoint import tiny_model_dir
from vlm_sdk.errors import VLMError
from vlm_sdk.models import registry
from vlm_sdk.outputs import terminal_text
from vlm_sdk.server.cli import exit_now, show_engine_logs

FAMILIES = registry.family_names()  # --family choices; the first is the default


def _content(args) -> list[dict]:
    """The question's parts: its images, its videos (with --fps / --max-frames when given), the text."""
    video_options = {k: v for k, v in (("fps", args.fps), ("max_frames", args.max_frames)) if v is not None}
    return ([{"type": "image", "image": p} for p in args.image]
            + [{"type": "video", "video": p, **video_options} for p in args.video]
            + [{"type": "text", "text": args.question}])


async def _chat_remote(args) -> int:
    """`chat --url`: the same question, streamed from a server; usage comes from the server."""
    from vlm_sdk.bench.serve import timed_stream
    from vlm_sdk.client import AsyncClient
    content = _content(args)
    async with AsyncClient(args.url, args.api_key) as client:
        t = await timed_stream(client, [{"role": "user", "content": content}],
                               lambda piece: print(terminal_text(piece), end="", flush=True), model=args.model,
                               max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    tps = 1.0 / t.tpot_s if t.tpot_s else float("nan")
    print()
    print(f"[vlm-sdk] {args.url}: prompt tokens {t.prompt_tokens} (image tokens included), generated "
          f"{t.completion_tokens} ({t.finish_reason}); time to first token {t.ttft_s * 1000:.0f} ms; "
          f"{tps:.1f} tokens/s after it; request {t.latency_s:.2f} s", file=sys.stderr)
    return 0


async def _chat(args) -> int:
    if args.url:
        for flag, value in (("--device", args.device), ("--kv-cache-dtype", args.kv_cache_dtype)):
            if value:
                print(f"error: {flag} has no effect with --url (the server owns the engine)", file=sys.stderr)
                return 2
        return await _chat_remote(args)
    from vlm_sdk import AsyncLLM, SamplingParams
    model = args.model
    if model is None:
        model = str(tiny_model_dir(family=args.family))
        name = registry.load(args.family).display_name
        print(f"[vlm-sdk] no --model given: using a tiny {name}-shaped checkpoint with RANDOM weights at "
              f"{model}; its answer is gibberish. Pass --model /path/to/{name} for a real one.",
              file=sys.stderr)
    messages = [{"role": "user", "content": _content(args)}]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    engine_args = {"show_progress": True}
    if args.device:
        engine_args["device"] = args.device
    if args.kv_cache_dtype:
        engine_args["kv_cache_dtype"] = args.kv_cache_dtype
    if args.tensor_parallel_size != 1 or args.enable_expert_parallel:
        engine_args.update(tensor_parallel_size=args.tensor_parallel_size,
                           enable_expert_parallel=args.enable_expert_parallel)
    start = time.monotonic()
    async with AsyncLLM(model, **engine_args) as engine:
        peak_blocks = 0
        last = None
        t0 = time.monotonic()
        async for out in engine.chat_stream(messages, params):
            print(terminal_text(out.delta_text), end="", flush=True)  # no raw control bytes
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
    show_engine_logs()
    parser = argparse.ArgumentParser(prog="vlm-sdk", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="ask one question, optionally about images, and stream the answer")
    chat.add_argument("question")
    chat.add_argument("--model", help="HF-format checkpoint directory (default: a tiny random one); with "
                      "--url, the served model name (default: the server's first)")
    chat.add_argument("--family", choices=FAMILIES, default=FAMILIES[0],
                      help="shape of the built-in random checkpoint used without --model")
    chat.add_argument("--url", help="ask a running server (http://host:port) instead of loading a model")
    chat.add_argument("--api-key", default=os.environ.get("VLM_SDK_API_KEY"), help="with --url: bearer token "
                      "(default: $VLM_SDK_API_KEY)")
    chat.add_argument("--image", action="append", default=[], help="image path (repeatable)")
    chat.add_argument("--video", action="append", default=[], help="video path (repeatable)")
    chat.add_argument("--fps", type=float, default=None, help="with --video: frames sampled per second, "
                      "for families that sample by rate (default 2)")
    chat.add_argument("--max-frames", type=int, default=None, help="with --video: the most frames sampled "
                      "(the family's default: 768 where frames are sampled by rate, else the 8 frames taken)")
    chat.add_argument("--max-tokens", type=int, default=64)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--device", default=None)
    chat.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                      help="the KV cache's dtype: auto (the model's, the default) or fp8 (e4m3, per-layer scales)")
    chat.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                      help="split the model over this many ranks, one process each (default 1)")
    chat.add_argument("--enable-expert-parallel", action="store_true",
                      help="with --tp: whole MoE experts per rank instead of a slice of every expert")
    bench = sub.add_parser("bench", help="our engine vs transformers generate on the same checkpoint")
    bench.add_argument("--model", help="checkpoint (default: a ~100M-parameter random one of --family)")
    bench.add_argument("--family", choices=FAMILIES, default=FAMILIES[0],
                       help="shape of the default benchmark checkpoint (ignored with --model)")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--num-requests", type=int, default=16)
    bench.add_argument("--hf-batch-size", type=int, default=8)
    bench.add_argument("--device", default=None)
    bench.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                       help="> 1: our engine on this many ranks against one rank (time per step), not transformers")
    bench.add_argument("--enable-expert-parallel", action="store_true",
                       help="with --tensor-parallel-size: the ranks hold whole MoE experts (the engine's setting)")
    from vlm_sdk.bench.gpu import add_arguments as add_gpu_bench_arguments
    add_gpu_bench_arguments(bench)
    from vlm_sdk.bench.prefix_cache import add_arguments as add_multi_turn_arguments
    add_multi_turn_arguments(bench)
    from vlm_sdk.bench.structured import add_arguments as add_structured_arguments
    add_structured_arguments(bench)
    from vlm_sdk.bench.host_overhead import add_arguments as add_host_overhead_arguments
    add_host_overhead_arguments(bench)
    from vlm_sdk.bench.sampler import add_arguments as add_sampler_bench_arguments
    add_sampler_bench_arguments(bench)
    from vlm_sdk.bench.video import add_arguments as add_video_bench_arguments
    add_video_bench_arguments(bench)
    from vlm_sdk.bench.serve import add_arguments as add_bench_serve_arguments
    add_bench_serve_arguments(sub.add_parser("bench-serve", help="throughput and latency of a server over HTTP, "
                                             "vs the same workload in process"))
    from vlm_sdk.server.cli import add_serve_parser, run_serve
    add_serve_parser(sub)
    from vlm_sdk.plan.report import add_plan_parser, run_plan
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            return run_plan(args)
        if args.command == "serve":
            return run_serve(args, tiny_model_dir)
        if args.command == "chat":
            return asyncio.run(_chat(args))
        if args.command == "bench-serve" and args.red_team:
            from vlm_sdk.bench.red_team import run_red_team
            return run_red_team(args)
        if args.command == "bench-serve" and args.soak is not None:
            from vlm_sdk.bench.soak import run_soak
            return run_soak(args)
        if args.command == "bench-serve" and args.replicas is not None:
            from vlm_sdk.bench.routing import run_routing_bench
            from vlm_sdk.server.background import BackgroundServer
            from vlm_sdk.server.config import ServerConfig
            return run_routing_bench(args, lambda model, engine: BackgroundServer(model, ServerConfig(port=0),
                                                                                   engine=engine))
        if args.command == "bench-serve":
            from vlm_sdk.bench.serve import run_bench_serve
            return run_bench_serve(args)
        if args.sampler:
            from vlm_sdk.bench.sampler import main as run_sampler_bench
            return run_sampler_bench(args)
        from vlm_sdk.bench import gpu as bench_gpu
        from vlm_sdk.bench import host_overhead, prefix_cache, structured, video
        if args.video:
            bench_gpu.reject_without_gpu(args)
            return video.run_video(args)
        video.reject_without_video(args)
        if args.host_overhead:
            bench_gpu.reject_without_gpu(args)
            return host_overhead.run_host_overhead(args)
        host_overhead.reject_without_host_overhead(args)
        if args.structured:
            bench_gpu.reject_without_gpu(args)
            prefix_cache.reject_without_multi_turn(args)
            return structured.run_structured(args)
        structured.reject_without_structured(args)
        if args.multi_turn:
            bench_gpu.reject_without_gpu(args)
            return prefix_cache.run_multi_turn(args)
        prefix_cache.reject_without_multi_turn(args)
        if args.gpu:
            return bench_gpu.run_gpu_benchmark(args, sys.argv[1:] if argv is None else list(argv))
        bench_gpu.reject_without_gpu(args)
        from vlm_sdk.bench.engine import run_benchmark
        return run_benchmark(args)
    except VLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The `vlm-sdk` console script and `python -m vlm_sdk.cli`: `main()`, then exit."""
    exit_now(main())


if __name__ == "__main__":
    run()
