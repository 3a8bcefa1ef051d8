"""The benchmarks' flags and their defaults, for `vlm-sdk bench` and `vlm-sdk bench-serve`: plain data
and argparse only, so `--help` answers without importing torch (each benchmark's module does). The
benchmarks read their settings from here (`MultiTurnConfig`, `SamplerBenchConfig`, `QUANTIZATIONS`)."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from vlm_sdk.errors import InvalidRequestError

DEFAULT_IMAGE = Path(__file__).resolve().parents[2] / "samples" / "shapes.png"
# the reference quantizer's methods: AWQ GEMM int4, compressed-tensors W4A16 int4, block-wise FP8
QUANTIZATIONS = ("awq", "w4a16", "fp8")


@dataclass(frozen=True)
class MultiTurnConfig:
    turns: int = 4
    answer_tokens: int = 16  # tokens of each answer kept in the history
    rounds: int = 5  # conversations per mode (each turn's figure is its median over them)
    users: int = 64
    user_tokens: int = 8
    user_rounds: int = 1  # many-users runs per mode
    image_size: int = 448

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidRequestError(f"--{f.name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.turns < 2:
            raise InvalidRequestError("--turns must be at least 2: the figure is the TTFT of turns 2 and later")


@dataclass(frozen=True)
class SamplerBenchConfig:
    rows: int = 64
    vocab: int = 151936
    repeats: int = 3
    prompt_tokens: int = 1000  # history of the penalty scenario
    output_tokens: int = 200


def add_bench_arguments(bench: argparse.ArgumentParser, families: tuple[str, ...]) -> None:
    """Every `vlm-sdk bench` flag: the transformers comparison's, then each mode's group."""
    bench.add_argument("--model", help="checkpoint (default: a ~100M-parameter random one of --family)")
    bench.add_argument("--family", choices=families, default=families[0],
                       help=f"shape of the default benchmark checkpoint, ignored with --model (default {families[0]})")
    bench.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    bench.add_argument("--num-requests", type=int, default=16, help="requests in the comparison (default 16)")
    bench.add_argument("--hf-batch-size", type=int, default=8,
                       help="transformers generate's batch size in the comparison (default 8)")
    bench.add_argument("--device", default=None, help="'cpu' or 'cuda[:N]' (default: cuda when a GPU is visible)")
    bench.add_argument("--tensor-parallel-size", "--tp", "-tp", type=int, default=1,
                       help="> 1: our engine on this many ranks against one rank (time per step), not transformers "
                            "(default 1)")
    bench.add_argument("--pipeline-parallel-size", "--pp", "-pp", type=int, default=1,
                       help="> 1: our engine on this many pipeline stages (x --tensor-parallel-size ranks each) "
                            "against one rank, time per step; and micro-batched (one micro-batch in flight per "
                            "stage) against the same stages taking turns, tokens/s and time per batch (default 1)")
    bench.add_argument("--enable-expert-parallel", action="store_true",
                       help="with --tensor-parallel-size: the ranks hold whole MoE experts (the engine's setting; "
                            "default off)")
    for add in (_gpu, _multi_turn, _structured, _host_overhead, _sampler, _cpu_gemm, _video, _speculative):
        add(bench)


def _gpu(bench) -> None:
    """The `--gpu` flag and its options, on the `vlm-sdk bench` parser."""
    g = bench.add_argument_group("GPU benchmark (vlm_sdk/bench/gpu.py)")
    g.add_argument("--gpu", action="store_true", help="run the Qwen2.5-VL-3B GPU benchmark instead (random bf16 "
                   "weights, no download; about 3-6 minutes on an H100; default off)")
    g.add_argument("--tiny", action="store_true", help="with --gpu: the same code path, tiny shape, on the CPU (default off)")
    g.add_argument("--decode-batches", type=_int_list, help="with --gpu: decode batch sizes (default 1,8,64)")
    g.add_argument("--context", type=int, help="with --gpu: decode prompt tokens (default 2048)")
    g.add_argument("--decode-steps", type=int, help="with --gpu: timed decode steps per batch (default 32)")
    g.add_argument("--requests", type=int, help="with --gpu: concurrent image requests (default 64)")
    g.add_argument("--max-tokens", type=int, help="with --gpu: tokens per request (default 128)")
    g.add_argument("--attn-batch", type=int, help="with --gpu: paged_attention_decode sequences (default 16)")
    g.add_argument("--attn-context", type=int, help="with --gpu: their cached tokens (default 4096)")
    g.add_argument("--memory-utilization", type=float, help="with --gpu: our engine's share (default 0.45)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="with --gpu: our engine's asynchronous scheduling (default: the engine's, on with CUDA); "
                        "--no-async-scheduling measures the synchronous engine for the comparison")
    g.add_argument("--piecewise-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="with --gpu: our engine's piecewise_cuda_graphs (steps with prefill rows replayed from "
                        "graphs around eager attention; default off): the prefill figures with and without")
    g.add_argument("--small-m-gemm", choices=("torch", "triton"), help="with --gpu: our engine's small_m_gemm "
                   "(default torch: cuBLAS); the small-M section times both either way")
    _quantized(g)
    g.add_argument("--profile", metavar="PATH", help="with --gpu: also profile decode (smallest and largest batch) "
                   "and a cold prefill with torch.profiler; write the kernel tables (name, calls and time per "
                   "step) to PATH (default: no profile)")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,8,64, got {text!r}") from None


def _multi_turn(bench) -> None:
    """`--multi-turn` and its options, on the `vlm-sdk bench` parser."""
    d = MultiTurnConfig()
    g = bench.add_argument_group("prefix caching and encoder cache, on vs off (vlm_sdk/bench/prefix_cache.py)")
    g.add_argument("--multi-turn", action="store_true", help="time multi-turn image chat and many users sharing a "
                   "system prompt and image, with caching on and off, instead of the transformers comparison (default off)")
    g.add_argument("--turns", type=int, help=f"with --multi-turn: turns per conversation (default {d.turns})")
    g.add_argument("--answer-tokens", type=int, help=f"with --multi-turn: tokens per answer "
                   f"(default {d.answer_tokens})")
    g.add_argument("--rounds", type=int, help=f"with --multi-turn: conversations per mode (default {d.rounds})")
    g.add_argument("--users", type=int, help=f"with --multi-turn: requests sharing one system prompt and image "
                   f"(default {d.users})")
    g.add_argument("--user-tokens", type=int, help=f"with --multi-turn: tokens per user request "
                   f"(default {d.user_tokens})")
    g.add_argument("--user-rounds", type=int, help=f"with --multi-turn: many-users runs per mode "
                   f"(default {d.user_rounds})")
    g.add_argument("--image-size", type=int, help=f"with --multi-turn: side of the square image (default "
                   f"{d.image_size})")


def _structured(bench) -> None:
    g = bench.add_argument_group("structured outputs keep batching (vlm_sdk/bench/structured.py)")
    g.add_argument("--structured", action="store_true", help="time a batch with half its requests constrained to "
                   "a JSON Schema against the same batch unconstrained, instead of the transformers comparison (default off)")
    g.add_argument("--so-requests", type=int, default=None, help="with --structured: requests per batch (default 32)")
    g.add_argument("--so-tokens", type=int, default=None, help="with --structured: tokens per request (default 64)")
    g.add_argument("--so-rounds", type=int, default=None, help="with --structured: rounds per workload (default 3)")


def _speculative(bench) -> None:
    g = bench.add_argument_group("speculative decoding vs without, in one run (vlm_sdk/bench/speculative.py)")
    g.add_argument("--speculative", choices=("ngram", "eagle3", "mtp"), default=None, metavar="METHOD",
                   help="time greedy decoding with speculative drafts of METHOD (ngram, eagle3) against without, "
                        "instead of the transformers comparison: tokens/s of each and the mean accepted length "
                        "(default off)")
    g.add_argument("--spec-tokens", type=int, default=None, help="with --speculative: draft tokens per step (default 4)")
    g.add_argument("--spec-requests", type=int, default=None, help="with --speculative: requests at once (default 4)")
    g.add_argument("--spec-max-tokens", type=int, default=None,
                   help="with --speculative: tokens per request (default 64)")
    g.add_argument("--spec-rounds", type=int, default=None, help="with --speculative: timed rounds each (default 3)")
    g.add_argument("--spec-draft", default=None, metavar="DIR",
                   help="with --speculative eagle3 and --model: the EAGLE-3 draft checkpoint (default: none; without --model the "
                        "bench builds a target and a draft that agrees with it)")


def _host_overhead(bench) -> None:
    g = bench.add_argument_group("host time per decode step (vlm_sdk/bench/host_overhead.py)")
    g.add_argument("--host-overhead", action="store_true", help="time the host side of decode steps with the "
                   "model replaced by a no-op, instead of the transformers comparison (default off)")
    g.add_argument("--ho-batches", default=None, help="with --host-overhead: comma-separated batch sizes "
                   "(default 1,64,256)")
    g.add_argument("--ho-steps", type=int, default=None, help="with --host-overhead: timed decode steps per "
                   "batch (default 50)")
    g.add_argument("--ho-prompt-len", type=int, default=None, help="with --host-overhead: prompt tokens per "
                   "request (default 512: 32 blocks of 16 per block table)")


def _sampler(bench) -> None:
    """`--sampler` and its options, on the `vlm-sdk bench` parser."""
    d = SamplerBenchConfig()
    g = bench.add_argument_group("the sampler: its first version vs now (vlm_sdk/bench/sampler.py)")
    g.add_argument("--sampler", action="store_true", help="time the sampler's old and new paths on the CPU "
                   "instead of the transformers comparison (default off)")
    g.add_argument("--sampler-rows", type=int, default=d.rows, help=f"with --sampler: rows (default {d.rows})")
    g.add_argument("--sampler-vocab", type=int, default=d.vocab, help=f"with --sampler: vocabulary (default {d.vocab})")
    g.add_argument("--sampler-repeats", type=int, default=d.repeats,
                   help=f"with --sampler: timed calls per path, the median is shown (default {d.repeats})")


def _cpu_gemm(bench) -> None:
    """`--cpu-gemm`: the CPU's float32 product paths on a checkpoint's shapes (vlm_sdk/bench/cpu_gemm.py)."""
    g = bench.add_argument_group("the CPU's float32 products: F.linear, MKL packed, oneDNN (vlm_sdk/bench/cpu_gemm.py)")
    g.add_argument("--cpu-gemm", action="store_true", help="time each product path at the checkpoint's LM head and "
                   "decoder shapes instead of the transformers comparison (default off)")
    g.add_argument("--gemm-repeats", type=int, default=9, help="with --cpu-gemm: timed calls per cell (default 9)")


def _video(bench) -> None:
    g = bench.add_argument_group("video: time to first token in parts, preprocessing vs transformers "
                                 "(vlm_sdk/bench/video.py)")
    g.add_argument("--video", action="store_true", help="time one question about a video (decode, preprocessing, "
                   "prefill) and the video preprocessing against transformers, instead of the generate comparison (default off)")
    g.add_argument("--video-seconds", type=float, default=30.0, help="with --video: clip length (default 30)")
    g.add_argument("--video-fps", type=float, default=2.0, help="with --video: frames sampled per second (default 2)")
    g.add_argument("--video-max-pixels", type=int, default=None,
                   help="with --video: the video part's max_pixels (default qwen-vl-utils': 768 tokens a frame)")
    g.add_argument("--video-rounds", type=int, default=3, help="with --video: timed rounds (default 3)")


def _quantized(group) -> None:
    """The quantized run's flags, in the `--gpu` group of `vlm-sdk bench`."""
    group.add_argument("--quantization", choices=sorted(QUANTIZATIONS), help="with --gpu: decode of a "
                       "Qwen2.5-VL-7B-shaped checkpoint quantized so (AWQ int4 group 128, compressed-tensors "
                       "W4A16 group 128, or block-wise FP8 128x128) against its bf16 weights, in one run "
                       "(vlm_sdk/bench/quantized.py; default: none, the bf16 benchmark)")
    group.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), help="with --gpu --quantization: fp8 adds the "
                       "quantized weights over an FP8 KV cache, its decode attention and its cache tokens (default auto)")


def add_bench_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running server (default: start one in this process on --model)")
    p.add_argument("--api-key", default=os.environ.get("VLM_SDK_API_KEY"),
                   help="bearer token for --url (default: $VLM_SDK_API_KEY)")
    p.add_argument("--model", help="checkpoint directory for the in-process server and the in-process "
                                   "comparison (default without --url: the tiny random checkpoint)")
    p.add_argument("--served-model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--num-requests", type=int, default=32, help="requests in all (default 32)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request, eos ignored (default 64)")
    p.add_argument("--image", default=str(DEFAULT_IMAGE), help="image sent with every request (default "
                   "samples/shapes.png)")
    p.add_argument("--prompt", default="Describe this image in detail.",
                   help="the question of every request (default 'Describe this image in detail.')")
    p.add_argument("--compare-inprocess", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the workload on an in-process AsyncLLM (default: on when a checkpoint is "
                        "known, i.e. without --url or with --model)")
    p.add_argument("--rounds", type=int, default=3, help="alternate HTTP and in-process this many times (default 3)")
    p.add_argument("--device", default=None, help="device of the engines started here (default: cuda when a GPU is visible)")
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="cache-aware vs round-robin routing over N replicas on Ray Serve, on a multi-turn image "
                        "workload (bench/routing.py; pip install 'vlm-sdk[ray]'; default: not this mode)")
    p.add_argument("--users", type=int, default=8, help="--replicas: conversations at once (default 8)")
    p.add_argument("--turns", type=int, default=4, help="--replicas: turns per conversation (default 4)")
    p.add_argument("--image-size", type=int, default=448, help="--replicas: each user's image, pixels per side (default 448)")
    p.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                   help="instead: mixed traffic (streams, images, aborts, bad requests) for this long, then "
                        "outcomes, the server's RSS slope and the KV blocks left (vlm_sdk/bench/soak.py; default: "
                        "not this mode)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="--soak: a request unanswered this long is lost (default 120)")
    p.add_argument("--seed", type=int, default=0, help="--soak: the random mix (default 0)")
    p.add_argument("--red-team", action="store_true",
                   help="instead: the attacks of README 'What one request may cost', row by row beside a victim stream, "
                        "then per row the statuses, the victim's worst gap and the server's RSS "
                        "(vlm_sdk/bench/red_team.py; default off)")
    p.add_argument("--red-team-scale", type=float, default=1.0,
                   help="--red-team: send this share of each row's requests, at least one (default 1)")
    p.add_argument("--red-team-rows", default=None, metavar="NAMES",
                   help="--red-team: only the rows whose names start with one of these, comma-separated, "
                        "e.g. 41.7,41.3 (default: every row)")
    p.add_argument("--flood", action="store_true",
                   help="instead: steady text victims alone, then beside an image flood and a video flood; the "
                        "victims' TTFT/TPOT p50/p99 alone and during, the floods' images/s, the ratios "
                        "(vlm_sdk/bench/flood.py; default: --model the ~100M bench checkpoint)")
    p.add_argument("--flood-seconds", type=float, default=20.0, help="--flood: seconds per phase (default 20)")
    p.add_argument("--flood-warmup", type=float, default=3.0,
                   help="--flood: seconds a flood runs before its phase's window opens (default 3)")
    p.add_argument("--flood-concurrency", type=int, default=8, help="--flood: flood requests in flight (default 8)")
    p.add_argument("--flood-victim-interval", type=float, default=0.5,
                   help="--flood: seconds between two victims' arrivals (default 0.5)")
    p.add_argument("--flood-image-size", type=int, default=448, help="--flood: image side in pixels (default 448)")
    p.add_argument("--flood-distinct", type=int, default=400,
                   help="--flood: distinct images per phase (a quarter as many videos; default 400)")
    p.add_argument("--flood-video-frames", type=int, default=8,
                   help="--flood: frames per video, all sampled (0: no video phases; default 8)")
    p.add_argument("--flood-video-size", type=int, default=224, help="--flood: video side in pixels (default 224)")
    p.add_argument("--flood-max-tokens", type=int, default=4, help="--flood: tokens per flood request (default 4)")
    p.add_argument("--flood-preprocess-images", type=int, default=60,
                   help="--flood: images in the preprocessing rows (1, 2, 4 worker processes against transformers' "
                        "image processor, before the phases: vlm_sdk/bench/preprocess_scaling.py; 0: no rows; "
                        "default 60)")
    p.add_argument("--flood-preprocess-workers", default="1,2,4", metavar="COUNTS",
                   help="--flood: the worker counts of the preprocessing rows, comma-separated (default 1,2,4)")
    p.add_argument("--flood-preprocess-size", type=int, default=1024,
                   help="--flood: side of the preprocessing rows' JPEGs, resized by the model's processor "
                        "(default 1024)")
    p.add_argument("--flood-engine-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="--flood: an engine setting for the server started here, e.g. "
                        "max_num_encoder_tokens_per_step=512 (repeatable; default: none, the engine's defaults)")
