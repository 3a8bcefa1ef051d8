"""`vlm-sdk chat` streams an answer (in process, or from a server with --url); `vlm-sdk serve` runs the
OpenAI-compatible server; `vlm-sdk plan` splits a model's memory from config.json alone; `vlm-sdk bench`
compares our engine with transformers (and the other benchmarks, each its mode); `vlm-sdk bench-serve`
measures a server over HTTP.

The parser is built from modules that import no torch (the engine's flags from EngineArgs in
vlm_sdk/server/engine_flags.py, the benchmarks' in bench/flags.py, plan's in plan/flags.py): `--help`
and a refused flag answer at once; each command imports what it runs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from urllib.parse import urlparse

from vlm_sdk.errors import VLMError
from vlm_sdk.models import registry
from vlm_sdk.server.engine_flags import add_engine_flags, engine_kwargs
from vlm_sdk.server.parser import COMMON, Parser, parse_with_hints
from vlm_sdk.server.vllm_names import add_vllm_names, apply_vllm_names

FAMILIES = registry.family_names()  # --family choices; the first is the default
# the engine settings plain `chat --help` shows
CHAT_COMMON_ENGINE = ("max_model_len", "num_blocks", "kv_cache_memory", "device", "tensor_parallel_size",
                      "pipeline_parallel_size")
CHAT_USAGE = "vlm-sdk chat [options] QUESTION"


def add_chat_parser(sub) -> Parser:
    chat = sub.add_parser("chat", help="ask one question, optionally about images or videos, and stream the answer",
                          usage=CHAT_USAGE, **({"brief": True} if issubclass(sub._parser_class, Parser) else {}),
                          description="Ask one question and stream the answer: in process on --model (default: a "
                                      "tiny random checkpoint), or from a running server with --url. The answer "
                                      "goes to stdout, figures and notes to stderr.")
    g = chat.add_argument_group(COMMON)
    g.add_argument("question", help="the question (quote it)")
    g.add_argument("--model", help="HF-format checkpoint directory or Hub id 'Org/Name' (default: a tiny random one "
                   "of --family); with --url, the served model name (default: the server's first)")
    g.add_argument("--family", choices=FAMILIES, default=FAMILIES[0],
                   help=f"shape of the built-in random checkpoint used without --model (default {FAMILIES[0]})")
    g.add_argument("--image", action="append", default=[], help="image path, repeatable (default: none)")
    g.add_argument("--video", action="append", default=[], help="video path, repeatable (default: none)")
    g.add_argument("--fps", type=float, default=None, help="with --video: frames sampled per second, for families "
                   "that sample by rate (default 2)")
    g.add_argument("--max-frames", type=int, default=None, help="with --video: the most frames sampled (default: "
                   "the family's: 768 where frames are sampled by rate, else the 8 frames taken)")
    g.add_argument("--system", default=None, help="a system message before the question (default: none; the chat "
                   "template may add its own)")
    g.add_argument("--max-tokens", type=_positive, default=64, help="most tokens of the answer (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default 0)")
    g.add_argument("--seed", type=int, default=None, help="this request's sampling seed (default: none)")
    g.add_argument("--quiet", action="store_true", help="print the answer only: no notes, no figures (default off)")
    g.add_argument("--verbose", action="store_true", help="also print the engine's start-up memory report and its "
                   "other notes (default off: one line of figures)")
    g.add_argument("--url", help="ask a running server (http://host:port) instead of loading a model (default: none)")
    g.add_argument("--api-key", default=os.environ.get("VLM_SDK_API_KEY"), help="with --url: bearer token "
                   "(default: $VLM_SDK_API_KEY)")
    # the engine's flags, from the same definitions as `vlm-sdk serve` (the request's --seed is the one above)
    add_engine_flags(chat, skip=("seed",), common=CHAT_COMMON_ENGINE, groups={COMMON: g})
    add_vllm_names(chat, "chat")
    return chat


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _content(args) -> list[dict]:
    """The question's parts: its images, its videos (with --fps / --max-frames when given), the text."""
    video_options = {k: v for k, v in (("fps", args.fps), ("max_frames", args.max_frames)) if v is not None}
    return ([{"type": "image", "image": p} for p in args.image]
            + [{"type": "video", "video": p, **video_options} for p in args.video]
            + [{"type": "text", "text": args.question}])


def _messages(args) -> list[dict]:
    system = [{"role": "system", "content": args.system}] if args.system else []
    return system + [{"role": "user", "content": _content(args)}]


def check_url(flag: str, url: str) -> None:
    from vlm_sdk.errors import InvalidRequestError
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise InvalidRequestError(f"{flag} {url!r} is not an http(s) URL: write e.g. http://127.0.0.1:8000")


def check_bench_inputs(args) -> None:
    """`bench` / `bench-serve`: the model, the image and the server's URL, checked before anything loads."""
    from vlm_sdk.errors import InvalidRequestError
    from vlm_sdk.server.cli import check_model_argument
    if getattr(args, "model", None) is not None and not getattr(args, "gpu", False):  # --gpu refuses any --model
        check_model_argument(args.model)
    if getattr(args, "url", None):
        check_url("--url", args.url)
    image = getattr(args, "image", None)
    if image is not None and not os.path.isfile(image):
        raise InvalidRequestError(f"image file not found: {image!r} (--image takes a file path)")


def check_chat_inputs(args) -> None:
    """Everything the command line names, checked before anything loads: the files exist, --url is a URL,
    engine flags are not given to a server's chat."""
    from vlm_sdk.errors import InvalidRequestError
    from vlm_sdk.server.cli import check_model_argument
    if args.model is not None and not args.url:
        check_model_argument(args.model)
    for kind, paths in (("image", args.image), ("video", args.video)):
        for path in paths:
            if path.startswith(("http://", "https://", "data:")):
                continue
            if not os.path.isfile(path):
                where = "is a directory" if os.path.isdir(path) else "does not exist"
                raise InvalidRequestError(f"{kind} file not found: {path!r} {where} (--{kind} takes a file path)")
    if args.url:
        check_url("--url", args.url)
        given = sorted("--" + k.replace("_", "-") for k in engine_kwargs(args))
        if given:
            raise InvalidRequestError(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect with "
                                      f"--url (the server owns the engine); leave {'it' if len(given) == 1 else 'them'} "
                                      f"out")


def _say(args, text: str) -> None:
    if not args.quiet:
        print(text, file=sys.stderr, flush=True)


async def _chat_remote(args) -> int:
    """`chat --url`: the same question, streamed from a server; usage comes from the server."""
    from vlm_sdk.bench.serve import timed_stream
    from vlm_sdk.client import AsyncClient
    from vlm_sdk.outputs import terminal_text
    async with AsyncClient(args.url, args.api_key) as client:
        t = await timed_stream(client, _messages(args), lambda piece: print(terminal_text(piece), end="", flush=True),
                               model=args.model, max_tokens=args.max_tokens, temperature=args.temperature,
                               seed=args.seed)
    tps = 1.0 / t.tpot_s if t.tpot_s else float("nan")
    print()
    _say(args, f"[vlm-sdk] {args.url}: prompt tokens {t.prompt_tokens} (image tokens included), generated "
               f"{t.completion_tokens} ({t.finish_reason}); time to first token {t.ttft_s * 1000:.0f} ms; "
               f"{tps:.1f} tokens/s after it; request {t.latency_s:.2f} s")
    return 0


async def _chat(args, started: float) -> int:
    if args.url:
        return await _chat_remote(args)
    from vlm_sdk import AsyncLLM, SamplingParams
    from vlm_sdk.outputs import terminal_text
    model = args.model
    if model is None:
        from vlm_sdk.demo_checkpoint import tiny_model_dir
        model = str(tiny_model_dir(family=args.family))
        name = registry.load(args.family).display_name
        _say(args, f"[vlm-sdk] no --model given: using a tiny {name}-shaped checkpoint with RANDOM weights at "
                   f"{model}; its answer is gibberish. Pass --model /path/to/{name} for a real one.")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    engine_args = {"show_progress": not args.quiet, **engine_kwargs(args)}
    start = time.monotonic()
    async with AsyncLLM(model, **engine_args) as engine:
        ready = time.monotonic()
        s = engine.stats()
        _say(args, f"[vlm-sdk] ready {ready - started:.1f} s after the command started (engine start "
                   f"{ready - start:.1f} s): KV cache {s['kv_blocks_total']} blocks x {s['kv_block_size']} tokens, "
                   f"max_model_len {s['max_model_len']}" + ("" if args.verbose else "; --verbose: memory report"))
        peak_blocks, last = 0, None
        async for out in engine.chat_stream(_messages(args), params):
            print(terminal_text(out.delta_text), end="", flush=True)  # no raw control bytes
            peak_blocks = max(peak_blocks, engine.stats()["kv_blocks_used"])
            last = out
        stats = engine.stats()
    m = last.metrics
    elapsed = time.monotonic() - ready
    decode_time = (m.finished_time - m.first_token_time) if m.generated_tokens > 1 else None
    tps = (m.generated_tokens - 1) / decode_time if decode_time else float("nan")
    print()
    _say(args, f"[vlm-sdk] prompt tokens {m.prompt_tokens} (image tokens {m.image_tokens}), generated "
               f"{m.generated_tokens} ({last.finish_reason}); time to first token {m.time_to_first_token * 1000:.0f} "
               f"ms; {tps:.1f} tokens/s after it; request {elapsed:.2f} s; KV blocks used "
               f"{peak_blocks}/{stats['kv_blocks_total']} at peak (block {stats['kv_block_size']} tokens)")
    return 0


def run_chat(args, started: float) -> int:
    """The engine's INFO lines (the start-up memory report) only with --verbose, nothing with --quiet;
    the logger's level is put back afterwards (the CLI may run inside another program)."""
    import asyncio
    import logging
    log = logging.getLogger("vlm_sdk")
    level = log.level
    if not args.verbose:
        log.setLevel(logging.WARNING if not args.quiet else logging.ERROR)
    try:
        return asyncio.run(_chat(args, started))
    finally:
        log.setLevel(level)


def build_parser() -> tuple[Parser, dict[str, argparse.ArgumentParser]]:
    """The `vlm-sdk` parser and its subcommands' parsers (by name)."""
    from vlm_sdk.bench.flags import add_bench_arguments, add_bench_serve_arguments
    from vlm_sdk.plan.flags import add_plan_parser
    from vlm_sdk.server.cli import add_serve_parser
    parser = Parser(prog="vlm-sdk", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{chat,serve,plan,bench,bench-serve}")
    commands: dict[str, argparse.ArgumentParser] = {"chat": add_chat_parser(sub), "serve": add_serve_parser(sub),
                                                     "plan": add_plan_parser(sub)}
    bench = sub.add_parser("bench", help="our engine vs transformers generate on the same checkpoint (and the other "
                           "benchmarks: --gpu, --multi-turn, --structured, --host-overhead, --sampler, --cpu-gemm, --video, "
                           "--speculative)")
    add_bench_arguments(bench, FAMILIES)
    commands["bench"] = bench
    bench_serve = sub.add_parser("bench-serve", help="throughput and latency of a server over HTTP, vs the same "
                                 "workload in process (--red-team, --soak, --replicas: the other modes)")
    add_bench_serve_arguments(bench_serve)
    commands["bench-serve"] = bench_serve
    return parser, commands


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """`started`: when the command began (time.monotonic()), for the time-to-ready it prints; default now."""
    from vlm_sdk.server.cli import show_engine_logs
    started = time.monotonic() if started is None else started
    show_engine_logs()
    parser, commands = build_parser()
    args = parse_with_hints(parser, argv, commands)
    try:
        if args.command == "plan":
            from vlm_sdk.plan.report import run_plan
            return run_plan(args)
        if args.command == "serve":
            from vlm_sdk.demo_checkpoint import tiny_model_dir
            from vlm_sdk.server.cli import run_serve
            return run_serve(args, tiny_model_dir)
        if args.command == "chat":
            apply_vllm_names(args)
            check_chat_inputs(args)
            return run_chat(args, started)
        check_bench_inputs(args)
        if args.command == "bench-serve":
            return _bench_serve(args)
        return _bench(args, argv)
    except VLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _bench_serve(args) -> int:
    if args.red_team:
        from vlm_sdk.bench.red_team import run_red_team
        return run_red_team(args)
    if args.flood:
        from vlm_sdk.bench.flood import run_flood
        return run_flood(args)
    if args.soak is not None:
        from vlm_sdk.bench.soak import run_soak
        return run_soak(args)
    if args.replicas is not None:
        from vlm_sdk.bench.routing import run_routing_bench
        from vlm_sdk.server.background import BackgroundServer
        from vlm_sdk.server.config import ServerConfig
        return run_routing_bench(args, lambda model, engine: BackgroundServer(model, ServerConfig(port=0), engine=engine))
    from vlm_sdk.bench.serve import run_bench_serve
    return run_bench_serve(args)


def _bench(args, argv: list[str] | None) -> int:
    if args.sampler:
        from vlm_sdk.bench.sampler import main as run_sampler_bench
        return run_sampler_bench(args)
    if args.cpu_gemm:
        from vlm_sdk.bench.cpu_gemm import main as run_cpu_gemm_bench
        return run_cpu_gemm_bench(args)
    from vlm_sdk.bench import gpu as bench_gpu
    from vlm_sdk.bench import host_overhead, prefix_cache, speculative, structured, video
    if args.speculative is not None:
        bench_gpu.reject_without_gpu(args)
        return speculative.run_speculative(args)
    speculative.reject_without_speculative(args)
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


def seconds_since_process_start() -> float:
    """How long this process has run (Linux: /proc; elsewhere 0): the imports before main() count."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def run() -> None:
    """The `vlm-sdk` console script and `python -m vlm_sdk.cli`: `main()`, then exit."""
    from vlm_sdk.server.cli import exit_now
    exit_now(main(started=time.monotonic() - seconds_since_process_start()))


if __name__ == "__main__":
    run()
