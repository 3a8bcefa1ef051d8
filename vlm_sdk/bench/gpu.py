"""`vlm-sdk bench --gpu`: the Qwen2.5-VL-3B figures of issue 5, measured in one run on one GPU.

The full Qwen2.5-VL-3B architecture (3.75B parameters) is built on the GPU with random bf16 weights
and saved to a temporary checkpoint (under $VLM_SDK_CACHE when set); our engine loads it with
`memory_utilization` 0.45 while the transformers model that wrote it stays on the GPU as the peer.
Every floor uses rates measured in the same run:

    copy bandwidth  a 2 GiB device-to-device copy, (bytes read + bytes written) / time, best of 10
    matmul rate     an 8192^3 bf16 torch.matmul, 2 n^3 / time, best of 10

    figure                            measured as                       against                target
    decode, batch 1/8/64, 2048 ctx    ms per llm.engine.step()          (LLM weight bytes + KV   1.25x (b=1)
                                      (32 steps, all sequences decoding) bytes attended) / copy  1.5x (b=64)
    paged_attention_decode alone      K+V+q+out bytes / time per call   copy bandwidth          >= 70%
      (16 x 4096, H16/Hkv2/D128)      (CUDA graph of 50 calls, best of 5)
    prefill: 1024x1024 image + 32     add_request -> first token, after matmul FLOPs (vision     2x
      text tokens                     a warm-up (median of 5)           tower + LLM) / rate
    64 concurrent 448x448 requests,   LLM.chat on all at once           transformers generate   >= 5x
      128 tokens each (ignore_eos)                                      (sdpa, bf16, batch 64)

Expected runtime on one H100: about 3-6 minutes, an estimate (not yet run on a GPU): building, saving
and loading the 7.5 GB checkpoint ~1-2 min, Triton compilation and 11 CUDA graphs ~1 min, transformers'
batch-64 generate ~0.5-1 min, the rest seconds. Smaller runs: `--decode-batches 1,8 --requests 16`.
`--tiny`: the same code path on the CPU with `vlm_sdk.testing`'s tiny shape and small sizes (what the
smoke test runs, well under a minute); its figures check the plumbing, not the targets.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from vlm_sdk.testing.hooks import local_worker
from vlm_sdk.bench.gpu_parts import (QWEN2_5_VL_3B, TINY, DeviceTimer, GpuBenchError, ModelShape, build_checkpoint,
                                     check_tokens, checkpoint_dir, copy_bandwidth, decode_weight_bytes, device_name,
                                     free_memory, matmul_rate, paged_attention_alone, plan_options, plan_vs_engine,
                                     prefill_flops, transformers_throughput, triton_version)
from vlm_sdk.bench.engine import _images

__all__ = ["GpuBenchConfig", "GpuBenchError", "FULL_RUN", "TINY_RUN", "add_arguments", "config_from_args",
           "format_report", "reject_without_gpu", "run", "run_gpu_benchmark"]


# issue 5's targets: ratio to the floor (at most), share of copy bandwidth and speed-up (at least)
DECODE_TARGETS = MappingProxyType({1: 1.25, 64: 1.5})
ATTENTION_TARGET = 0.70
PREFILL_TARGET = 2.0
THROUGHPUT_TARGET = 5.0
TEXT_VOCAB = 1000  # ids below this are the test tokenizer's ordinary BPE tokens (specials come after)
QUESTIONS = ("What is in this image?", "Describe the picture.", "What colours do you see?", "Is there any text?")


@dataclass(frozen=True)
class GpuBenchConfig:
    shape: ModelShape
    device: str
    dtype: str  # a vlm_sdk.config.DTYPES name
    attention_backend: str | None  # None: the engine's default for the device (Triton on CUDA)
    init_std: float
    memory_utilization: float  # CUDA only: our engine shares the GPU with the transformers peer
    max_model_len: int  # raised to fit the decode contexts
    decode_batches: tuple[int, ...]
    context: int  # prompt tokens of every decode sequence
    decode_warmup: int
    decode_steps: int
    attn_batch: int
    attn_context: int
    attn_calls: int
    prefill_image: int  # side of the square image
    prefill_text_tokens: int
    prefill_reps: int
    requests: int
    request_image: int
    max_tokens: int
    copy_bytes: int
    copy_reps: int
    matmul_n: int
    matmul_reps: int
    max_num_batched_tokens: int = 8192  # the engine's default
    block_size: int = 16
    seed: int = 0
    async_scheduling: bool | None = None  # None: the engine's default (on with CUDA and one rank)

    def decode_max_tokens(self, batch: int) -> int:
        """Tokens each decode sequence may generate: the first ones to finish prefill decode while the
        rest prefill (a step's token budget holds a few prompts), and nobody may finish while timed."""
        prefill_steps = -(-batch * self.context // self.max_num_batched_tokens) + 1
        return prefill_steps + self.decode_warmup + self.decode_steps + 2

    @property
    def engine_max_model_len(self) -> int:
        return max(self.max_model_len, self.context + max(map(self.decode_max_tokens, self.decode_batches)))

    def validate(self) -> None:
        for name in ("context", "decode_steps", "attn_batch", "attn_context", "attn_calls", "prefill_image",
                     "prefill_reps", "requests", "request_image", "max_tokens"):
            if getattr(self, name) < 1:
                raise GpuBenchError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.decode_batches or min(self.decode_batches) < 1:
            raise GpuBenchError(f"decode batches must be positive integers, got {list(self.decode_batches)}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise GpuBenchError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")


FULL_RUN = GpuBenchConfig(
    shape=QWEN2_5_VL_3B, device="cuda", dtype="bfloat16", attention_backend=None, init_std=0.02,
    memory_utilization=0.45, max_model_len=4096, decode_batches=(1, 8, 64), context=2048, decode_warmup=3,
    decode_steps=32, attn_batch=16, attn_context=4096, attn_calls=50, prefill_image=1024, prefill_text_tokens=32,
    prefill_reps=5, requests=64, request_image=448, max_tokens=128, copy_bytes=2 << 30, copy_reps=10,
    matmul_n=8192, matmul_reps=10)
TINY_RUN = GpuBenchConfig(
    shape=TINY, device="cpu", dtype="float32", attention_backend="torch", init_std=0.2, memory_utilization=0.45,
    max_model_len=512, decode_batches=(1, 4), context=64, decode_warmup=1, decode_steps=4, attn_batch=2,
    attn_context=128, attn_calls=3, prefill_image=224, prefill_text_tokens=32, prefill_reps=2, requests=4,
    request_image=112, max_tokens=8, copy_bytes=16 << 20, copy_reps=3, matmul_n=256, matmul_reps=3,
    max_num_batched_tokens=128)  # small: decode prompts prefill over several steps, as on the GPU


# ----------------------------------------------------------------------------------------------
# command line

_GPU_ONLY = ("tiny", "decode_batches", "context", "decode_steps", "requests", "max_tokens", "attn_batch",
             "attn_context", "memory_utilization", "async_scheduling")


def add_arguments(bench) -> None:
    """The `--gpu` flag and its options, on the `vlm-sdk bench` parser."""
    g = bench.add_argument_group("GPU benchmark (issue 5; see vlm_sdk/bench/gpu.py)")
    g.add_argument("--gpu", action="store_true", help="run the Qwen2.5-VL-3B GPU benchmark instead (random bf16 "
                   "weights, no download; about 3-6 minutes on an H100)")
    g.add_argument("--tiny", action="store_true", help="with --gpu: the same code path, tiny shape, on the CPU")
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


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers such as 1,8,64, got {text!r}") from None


def reject_without_gpu(args) -> None:
    """GPU options without --gpu would be silently ignored by the CPU benchmark: refuse them."""
    given = [f"--{n.replace('_', '-')}" for n in _GPU_ONLY
             if getattr(args, n, None) is not None and not (n == "tiny" and args.tiny is False)]
    if given:
        raise GpuBenchError(f"{', '.join(given)} only apply with --gpu")


def config_from_args(args) -> GpuBenchConfig:
    if getattr(args, "model", None) is not None or getattr(args, "family", "qwen2_5_vl") != "qwen2_5_vl":
        raise GpuBenchError("--gpu builds its own random Qwen2.5-VL-3B checkpoint; drop --model and --family")
    base = TINY_RUN if args.tiny else FULL_RUN
    device = torch.device(args.device or base.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GpuBenchError("--gpu needs a CUDA device and none is available; `vlm-sdk bench --gpu --tiny` runs "
                            "the same code path with a tiny model on the CPU")
    if device.type != "cuda" and not args.tiny:
        raise GpuBenchError(f"the Qwen2.5-VL-3B run needs a CUDA device, not {device}; add --tiny for the CPU run")
    names = {f.name for f in dataclasses.fields(GpuBenchConfig)}
    changes = {n: getattr(args, n) for n in _GPU_ONLY if n in names and getattr(args, n) is not None}
    config = dataclasses.replace(base, device=str(device), **changes)
    config.validate()
    return config


def run_gpu_benchmark(args, argv: list[str]) -> int:
    report = run(config_from_args(args), command=shlex.join(["vlm-sdk", *argv]))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


# ----------------------------------------------------------------------------------------------
# the run

def run(cfg: GpuBenchConfig, command: str) -> dict:
    import transformers
    from vlm_sdk import LLM
    from vlm_sdk.config import DTYPES
    from vlm_sdk.plan import plan

    t_start = time.perf_counter()
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # events and graphs use the current device
    timer = DeviceTimer(device)
    report: dict = {
        "benchmark": "vlm-sdk bench --gpu", "preset": "tiny" if cfg.shape == TINY else "qwen2.5-vl-3b",
        "command": command, "device": device_name(device), "torch": torch.__version__,
        "transformers": transformers.__version__, "triton": triton_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "config": dataclasses.asdict(cfg),
        "notes": [],
    }
    if device.type != "cuda":
        report["notes"].append("CPU run: checks that every section runs end to end; its figures are not the "
                               "issue's and its targets are not expected to pass")
    with checkpoint_dir() as ckpt:
        hf_model = build_checkpoint(Path(ckpt), cfg.shape, device=device, dtype=dtype, seed=cfg.seed,
                                    init_std=cfg.init_std)
        total = sum(p.numel() for p in hf_model.parameters())
        vision = sum(p.numel() for p in hf_model.model.visual.parameters())
        report["model"] = {"parameters": total, "vision_parameters": vision, "llm_parameters": total - vision,
                           "dtype": cfg.dtype, "weights": f"random, normal std {cfg.init_std}"}
        copy_bw = copy_bandwidth(timer, cfg.copy_bytes, cfg.copy_reps)
        mm_rate = matmul_rate(timer, cfg.matmul_n, dtype, cfg.matmul_reps)
        report["reference_rates"] = {"copy_GBps": copy_bw / 1e9, "copy_bytes": cfg.copy_bytes,
                                     "matmul_TFLOPs": mm_rate / 1e12, "matmul_n": cfg.matmul_n}
        figures = [_attention_figure(cfg, timer, dtype, copy_bw, report["notes"])]
        free_memory(device)

        planned = plan(ckpt, **plan_options(_engine_kwargs(cfg, device)))
        llm = LLM(ckpt, **_engine_kwargs(cfg, device))
        report["async_scheduling"] = llm.engine.async_scheduling
        engine = llm.engine
        report["plan_vs_engine"] = plan_vs_engine(planned, engine)
        report["engine"] = {"load_seconds": engine.load_seconds, "kv_blocks": engine.cache_config.num_blocks,
                            "kv_source": engine.cache_config.source,
                            "max_model_len": engine.scheduler_config.max_model_len,
                            "cuda_graphs": local_worker(engine).runner.graphs is not None}
        figures += [_decode_figure(engine, cfg, batch, timer, copy_bw) for batch in cfg.decode_batches]
        figures.append(_prefill_figure(engine, cfg, timer, mm_rate))
        convs = _throughput_convs(cfg)
        ours = _ours_throughput(llm, convs, cfg, timer)
        eos = sorted(engine.eos_token_ids)
        del llm, engine  # the peer gets the memory our engine held (cache and graphs included)
        free_memory(device)
        theirs = transformers_throughput(hf_model, ckpt, convs, cfg.max_tokens, timer, eos)
        del hf_model
        free_memory(device)
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    figures.append(_figure(f"throughput, {cfg.requests} concurrent {cfg.request_image}px image requests",
                           ours["tokens_per_s"], "tokens/s", theirs["tokens_per_s"], "transformers", ratio,
                           ">=", THROUGHPUT_TARGET, {"ours": ours, "transformers": theirs}))
    report["notes"].append("throughput: both sides' times include image preprocessing and tokenization")
    report["figures"] = figures
    report["seconds"] = time.perf_counter() - t_start
    return report


def _engine_kwargs(cfg: GpuBenchConfig, device: torch.device) -> dict:
    kwargs = dict(device=cfg.device, dtype=cfg.dtype, block_size=cfg.block_size, seed=cfg.seed,
                  max_model_len=cfg.engine_max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
                  max_num_seqs=max(max(cfg.decode_batches), cfg.requests), show_progress=False)
    if cfg.attention_backend is not None:
        kwargs["attention_backend"] = cfg.attention_backend
    if cfg.async_scheduling is not None:
        kwargs["async_scheduling"] = cfg.async_scheduling
    if device.type == "cuda":
        kwargs["memory_utilization"] = cfg.memory_utilization
    return kwargs


def _figure(name: str, value: float, unit: str, baseline: float, baseline_kind: str, ratio: float,
            op: str, target: float | None, details: dict) -> dict:
    passed = None if target is None else (ratio <= target if op == "<=" else ratio >= target)
    text = "none (reported only)" if target is None else f"{op} {target:g}x"
    return {"name": name, "value": value, "unit": unit, "baseline": baseline, "baseline_kind": baseline_kind,
            "ratio": ratio, "target": text, "target_ratio": target, "target_op": op, "pass": passed,
            "details": details}


def _attention_figure(cfg, timer, dtype, copy_bw, notes) -> dict:
    s = cfg.shape
    r = paged_attention_alone(timer, batch=cfg.attn_batch, context=cfg.attn_context, num_heads=s.num_heads,
                              num_kv_heads=s.num_kv_heads, head_dim=s.text_hidden_size // s.num_heads,
                              block_size=cfg.block_size, dtype=dtype, calls=cfg.attn_calls, seed=cfg.seed)
    if r["impl"] != "triton":
        notes.append(f"paged_attention_decode alone ran as {r['impl']} (no GPU): its bandwidth says nothing")
    bw = r["bytes"] / r["seconds_per_call"]
    return _figure(f"paged_attention_decode alone, {cfg.attn_batch} x {cfg.attn_context} ctx", bw / 1e9, "GB/s",
                   copy_bw / 1e9, "copy bandwidth", bw / copy_bw, ">=", ATTENTION_TARGET, r)


def _decode_figure(engine, cfg: GpuBenchConfig, batch: int, timer: DeviceTimer, copy_bw: float) -> dict:
    """`batch` text prompts of cfg.context tokens, prefilled until every one has its first token, then
    `decode_warmup` steps, then `decode_steps` timed engine steps (host scheduling and sampling included)."""
    from vlm_sdk.protocol.blocks import blocks_needed
    from vlm_sdk.multimodal.inputs import PromptInputs
    from vlm_sdk.sampling_params import SamplingParams

    steps = cfg.decode_steps
    max_tokens = cfg.decode_max_tokens(batch)
    need = batch * blocks_needed(cfg.context + max_tokens, cfg.block_size)
    if need > engine.cache_config.num_blocks:
        raise GpuBenchError(f"decode batch {batch} x {cfg.context} tokens needs {need} KV blocks but the cache has "
                            f"{engine.cache_config.num_blocks} ({engine.cache_config.source}); raise "
                            f"--memory-utilization or lower --context / --decode-batches")
    rng = random.Random(cfg.seed + batch)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(PromptInputs(token_ids=[rng.randrange(TEXT_VOCAB) for _ in range(cfg.context)]),
                               params) for _ in range(batch)]
    try:
        seqs = [engine.requests[r] for r in rids]
        for _ in range(max_tokens):  # the prefill steps decode_max_tokens allows for
            if all(s.num_output_tokens > 0 for s in seqs):
                break
            engine.step()
        else:
            raise GpuBenchError(f"decode batch {batch}: the prompts did not finish prefill in {max_tokens} steps")
        for _ in range(cfg.decode_warmup):
            engine.step()
        start_tokens = sum(s.num_tokens for s in seqs)
        preemptions = engine.scheduler.num_preemptions
        short = 0
        timer.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            short += len(engine.step()) != batch
        timer.sync()
        seconds = (time.perf_counter() - t0) / steps
    finally:
        for r in rids:
            engine.abort(r)
    if short or engine.scheduler.num_preemptions != preemptions:
        raise GpuBenchError(f"decode batch {batch}: {short} of {steps} timed steps did not decode all sequences "
                            f"({engine.scheduler.num_preemptions - preemptions} preemptions); raise "
                            f"--memory-utilization")
    # each step attends over every sequence's tokens so far, its new one included
    attended = start_tokens + batch * (steps - 1) / 2
    kv_per_token = engine.cache_config.bytes_per_block // engine.cache_config.block_size
    weight_bytes = decode_weight_bytes(local_worker(engine).model.decoder, batch)
    floor = (weight_bytes + attended * kv_per_token) / copy_bw
    details = {"steps": steps, "weight_bytes": weight_bytes, "kv_bytes": attended * kv_per_token,
               "mean_context": attended / batch, "kv_bytes_per_token": kv_per_token}
    return _figure(f"decode step, batch {batch}, {cfg.context} ctx", seconds * 1e3, "ms/step", floor * 1e3, "floor",
                   seconds / floor, "<=", DECODE_TARGETS.get(batch), details)


def _prefill_figure(engine, cfg: GpuBenchConfig, timer: DeviceTimer, mm_rate: float) -> dict:
    """Time from add_request to the first token of one image request (its prompt built beforehand:
    CPU image preprocessing is not prefill), median over `prefill_reps` after a warm-up."""
    from vlm_sdk.sampling_params import SamplingParams

    image = _images([(cfg.prefill_image, cfg.prefill_image)], seed=2)[0]
    prompt = engine.build_prompt(_conversation(image, _question(engine, cfg.prefill_text_tokens)))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def once() -> float:
        timer.sync()
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, params)
        while rid in engine.requests:
            engine.step()
        timer.sync()
        return time.perf_counter() - t0

    once()  # warm-up: Triton kernels compile for these shapes
    seconds = statistics.median(once() for _ in range(cfg.prefill_reps))
    flops = prefill_flops(engine.checkpoint.hf_config, [im.meta.grid_thw for im in prompt.images], len(prompt.token_ids))
    floor = sum(flops.values()) / mm_rate
    details = {"prompt_tokens": len(prompt.token_ids), "image_tokens": sum(prompt.image_tokens),
               "text_tokens": len(prompt.token_ids) - sum(prompt.image_tokens),
               "image_grid_thw": [list(im.meta.grid_thw) for im in prompt.images], "flops": flops, "reps": cfg.prefill_reps}
    return _figure(f"prefill, {cfg.prefill_image}x{cfg.prefill_image} image + text", seconds * 1e3, "ms",
                   floor * 1e3, "floor", seconds / floor, "<=", PREFILL_TARGET, details)


def _conversation(image, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


def _question(engine, text_tokens: int) -> str:
    """A question long enough that the prompt has at least `text_tokens` non-image tokens (template
    included), counted on a smallest image."""
    probe = _images([(56, 56)], seed=3)[0]
    words = itertools.cycle("Describe the picture in detail and name every object you can see".split())
    question = next(words)
    for _ in range(4 * text_tokens):
        prompt = engine.build_prompt(_conversation(probe, question))
        if len(prompt.token_ids) - sum(prompt.image_tokens) >= text_tokens:
            break
        question += " " + next(words)
    return question


def _throughput_convs(cfg: GpuBenchConfig) -> list[list[dict]]:
    images = _images([(cfg.request_image, cfg.request_image)] * cfg.requests, seed=1)
    return [_conversation(im, QUESTIONS[i % len(QUESTIONS)]) for i, im in enumerate(images)]


def _ours_throughput(llm, convs, cfg: GpuBenchConfig, timer: DeviceTimer) -> dict:
    from vlm_sdk.sampling_params import SamplingParams

    llm.chat(convs[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    preemptions = llm.engine.scheduler.num_preemptions
    timer.sync()
    t0 = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True))
    timer.sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    check_tokens("ours", tokens, len(convs), cfg.max_tokens)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "preemptions": llm.engine.scheduler.num_preemptions - preemptions}


def format_report(report: dict) -> str:
    m, r = report["model"], report["reference_rates"]
    lines = [
        f"{report['benchmark']} ({report['preset']}) on {report['device']}, {report['date']}",
        f"command: {report['command']}",
        f"torch {report['torch']}, transformers {report['transformers']}, triton {report['triton']}",
        f"model: Qwen2.5-VL architecture, {m['parameters']:,} parameters (LLM {m['llm_parameters']:,}, vision "
        f"{m['vision_parameters']:,}), {m['dtype']}, {m['weights']}",
        f"measured rates: device copy {r['copy_GBps']:,.1f} GB/s ({r['copy_bytes'] >> 20} MiB, read + write); "
        f"matmul {_num(r['matmul_TFLOPs'])} TFLOP/s ({r['matmul_n']}^3)",
        "",
        f"{'figure':<50} {'measured':>18} {'against':>26} {'ratio':>8}  {'target':<22} result",
    ]
    for f in report["figures"]:
        result = {True: "PASS", False: "FAIL", None: "-"}[f["pass"]]
        lines.append(f"{f['name']:<50} {_num(f['value']) + ' ' + f['unit']:>18} "
                     f"{f['baseline_kind'] + ' ' + _num(f['baseline']):>26} {f['ratio']:>7.2f}x  {f['target']:<22} "
                     f"{result}")
    pv = report.get("plan_vs_engine")
    if pv:
        lines += ["", f"vlm-sdk plan vs the engine: {pv['plan_blocks']:,} vs {pv['engine_blocks']:,} KV blocks "
                  f"({pv['blocks_difference']:+.2%}; within 3%: {'yes' if pv['within_3_percent'] else 'NO'}); "
                  f"activation peak estimated {pv['plan_activation_peak_bytes']:,} B, measured "
                  f"{pv['engine_activation_peak_bytes'] if pv['engine_activation_peak_bytes'] is not None else '-'} B"]
    lines += [""] + [f"note: {n}" for n in report["notes"]] + [f"total {report['seconds']:.1f} s"]
    return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.3g}"
