"""`vlm-sdk bench --gpu --quantization awq|w4a16|fp8 [--kv-cache-dtype fp8]`: quantized checkpoints against bf16, in
one run on one GPU (issue 31's targets).

A Qwen2.5-VL-7B-shaped checkpoint is built with random bf16 weights (no download) and quantized by the
reference quantizer (vlm_sdk/testing/quantizer.py) into the published layout: AWQ int4, group 128,
compressed-tensors W4A16 (pack-quantized, symmetric, group 128), or the model makers' block-wise FP8,
128 x 128 blocks. Our engine then runs each variant alone on the GPU
(same settings, `memory_utilization`), one after the other:

    bf16 weights, bf16 KV            the baseline
    quantized weights, bf16 KV       decode step time at each batch vs the baseline's
    quantized weights, FP8 KV        with --kv-cache-dtype fp8: decode step time, and the cache's tokens

    figure                                 measured as                          target (issue 31, H100)
    decode step, batch b, <ctx>            ms per engine step, all b decoding    int4 >= 2.2x, FP8 >= 1.6x
                                           (baseline ms / quantized ms)          faster at batch 1; others
                                                                                 reported
    FP8 KV: decode attention alone,        paged_attention_decode, bf16 cache     >= 1.6x faster
      batch 64 x <ctx>                     time / FP8 cache time (CUDA graph)
    FP8 KV: cache tokens                   tokens per byte, FP8 / bf16            2x (bytes per token)
                                           and the engines' capacities at the     (capacity reported)
                                           same memory_utilization

`--tiny`: the same code path on the CPU (tiny shape, float32, the torch backend, the weights dequantized
before each product as the CPU path does): what the test suite runs; its figures check the plumbing.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm_sdk.bench.gpu_figures import decode_steps, decoding, figure
from vlm_sdk.bench.gpu_parts import (QWEN2_5_VL_3B, TINY, DeviceTimer, GpuBenchError, ModelShape, build_checkpoint,
                                     checkpoint_dir, device_name, free_memory, paged_attention_alone, triton_version)

DECODE_TARGETS = {"awq": 2.2, "w4a16": 2.2, "fp8": 1.6}  # speed-up at batch 1 (W4A16: AWQ's bytes, AWQ's target)
KV_ATTENTION_TARGET = 1.6
KV_TOKENS_TARGET = 2.0

# The published Qwen2.5-VL-7B-Instruct config (tests/configs/qwen2_5_vl_7b.json)
QWEN2_5_VL_7B = dataclasses.replace(
    QWEN2_5_VL_3B, text_hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944,
    vocab_size=152064, tie_word_embeddings=False)


@dataclass(frozen=True)
class QuantBenchConfig:
    shape: ModelShape
    device: str
    dtype: str
    attention_backend: str | None
    quantization: str  # one of bench.flags.QUANTIZATIONS
    kv_cache_dtype: str  # "auto" or "fp8": the third variant
    group_size: int  # AWQ's and W4A16's, in input rows (the tiny run's must divide its widths)
    block: tuple[int, int]  # block FP8's
    init_std: float
    memory_utilization: float
    decode_batches: tuple[int, ...]
    context: int
    decode_warmup: int
    decode_steps: int
    attn_batch: int
    attn_context: int
    attn_calls: int
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    seed: int = 0
    kv_cache_memory: str | None = None  # the CPU run's cache (there is no device memory to take a share of)

    def decode_max_tokens(self, batch: int) -> int:
        """As `GpuBenchConfig.decode_max_tokens`: prefill steps, warm-up and timed steps, and a margin."""
        prefill_steps = -(-batch * self.context // self.max_num_batched_tokens) + 1
        return prefill_steps + self.decode_warmup + self.decode_steps + 2

    @property
    def max_model_len(self) -> int:
        return self.context + max(map(self.decode_max_tokens, self.decode_batches))


FULL = QuantBenchConfig(
    shape=QWEN2_5_VL_7B, device="cuda", dtype="bfloat16", attention_backend=None, quantization="awq",
    kv_cache_dtype="auto", group_size=128, block=(128, 128), init_std=0.02, memory_utilization=0.85,
    decode_batches=(1, 8, 64), context=2048, decode_warmup=3, decode_steps=32, attn_batch=64, attn_context=4096,
    attn_calls=50)
TINY_RUN = QuantBenchConfig(
    shape=TINY, device="cpu", dtype="float32", attention_backend="torch", quantization="awq", kv_cache_dtype="auto",
    group_size=16, block=(16, 16), init_std=0.2, memory_utilization=0.85, decode_batches=(1, 4), context=48,
    decode_warmup=1, decode_steps=3, attn_batch=4, attn_context=128, attn_calls=2, max_num_batched_tokens=128,
    kv_cache_memory="1MiB")



def config_from_args(args) -> QuantBenchConfig:
    if getattr(args, "model", None) is not None:
        raise GpuBenchError("--gpu --quantization builds its own random Qwen2.5-VL-7B-shaped checkpoint; drop --model")
    base = TINY_RUN if args.tiny else FULL
    device = torch.device(args.device or base.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GpuBenchError("--gpu --quantization needs a CUDA device and none is available; add --tiny for the "
                            "same code path on the CPU")
    if device.type != "cuda" and not args.tiny:
        raise GpuBenchError(f"the 7B run needs a CUDA device, not {device}; add --tiny for the CPU run")
    changes = {"device": str(device), "quantization": args.quantization,
               "kv_cache_dtype": args.kv_cache_dtype or "auto"}
    for name in ("decode_batches", "context", "decode_steps", "attn_batch", "attn_context", "memory_utilization"):
        if getattr(args, name, None) is not None:
            changes[name] = getattr(args, name)
    return dataclasses.replace(base, **changes)


def reject_without_quantization(args) -> None:
    if getattr(args, "kv_cache_dtype", None) is not None and getattr(args, "quantization", None) is None:
        raise GpuBenchError("--kv-cache-dtype applies with --gpu --quantization (the engine's own setting is "
                            "kv_cache_dtype in serve, chat and plan)")


# ----------------------------------------------------------------------------------------------
# the run

def run(cfg: QuantBenchConfig, command: str) -> dict:
    from vlm_sdk.config import DTYPES
    from vlm_sdk.testing.quantizer import quantize_checkpoint

    t_start = time.perf_counter()
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    timer = DeviceTimer(device)
    method = cfg.quantization
    options = {"block": cfg.block} if method == "fp8" else {"group_size": cfg.group_size}
    report: dict = {"benchmark": "vlm-sdk bench --gpu --quantization", "command": command,
                    "preset": "tiny" if cfg.shape == TINY else "qwen2.5-vl-7b", "device": device_name(device),
                    "torch": torch.__version__, "triton": triton_version(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "config": dataclasses.asdict(cfg), "quantization": {"method": method, **options}, "notes": []}
    if device.type != "cuda":
        report["notes"].append("CPU run: the quantized weights are dequantized before each product (the CPU "
                               "path): its figures check that every section runs, not the issue's targets")
    with checkpoint_dir() as root:
        base, quantized = Path(root) / "bf16", Path(root) / method
        model = build_checkpoint(base, cfg.shape, device=device, dtype=dtype, seed=cfg.seed, init_std=cfg.init_std)
        del model
        free_memory(device)
        t0 = time.perf_counter()
        quantize_checkpoint(base, quantized, method, device=device, **options)
        report["quantize_seconds"] = time.perf_counter() - t0
        float_name = {"bfloat16": "bf16", "float16": "fp16"}.get(cfg.dtype, cfg.dtype)  # the tiny run's float32
        variants = [(f"{float_name} weights", base, "auto"), (f"{method} weights", quantized, "auto")]
        if cfg.kv_cache_dtype == "fp8":
            variants.append((f"{method} weights, fp8 KV", quantized, "fp8"))
        runs = [_measure(name, path, kv, cfg, timer) for name, path, kv in variants]
    report["variants"] = runs
    figures = _decode_figures(runs, cfg)
    if cfg.kv_cache_dtype == "fp8":
        figures += _kv_figures(runs[1], runs[2], cfg, timer, dtype)
    report["figures"] = figures
    report["seconds"] = time.perf_counter() - t_start
    return report


def _measure(name: str, path: Path, kv_cache_dtype: str, cfg: QuantBenchConfig, timer: DeviceTimer) -> dict:
    """Our engine on one variant, alone on the device: ms per decode step at each batch, its cache."""
    from vlm_sdk import LLM

    kwargs = dict(device=cfg.device, dtype=cfg.dtype, block_size=cfg.block_size, seed=cfg.seed,
                  max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
                  max_num_seqs=max(cfg.decode_batches), show_progress=False, enable_prefix_caching=False,
                  kv_cache_dtype=kv_cache_dtype, allow_unfit_images=True)
    if cfg.attention_backend is not None:
        kwargs["attention_backend"] = cfg.attention_backend
    if torch.device(cfg.device).type == "cuda":
        kwargs["memory_utilization"] = cfg.memory_utilization
    else:
        kwargs["kv_cache_memory"] = cfg.kv_cache_memory
    llm = LLM(str(path), **kwargs)
    engine = llm.engine
    stats = engine.stats()
    out = {"name": name, "kv_cache_dtype": stats["kv_cache_dtype"], "weight_format": stats["weight_format"],
           "weights_bytes": engine.memory_report.weights_bytes, "kv_capacity_tokens": stats["kv_capacity_tokens"],
           "kv_bytes_per_block": stats["kv_bytes_per_block"], "decode_ms": {}}
    for batch in cfg.decode_batches:
        with decoding(engine, cfg, batch):
            timer.sync()
            t0 = time.perf_counter()
            decode_steps(engine, batch, cfg.decode_steps)
            timer.sync()
            out["decode_ms"][batch] = (time.perf_counter() - t0) / cfg.decode_steps * 1e3
    del llm, engine
    free_memory(timer.device)
    return out


def _decode_figures(runs: list[dict], cfg: QuantBenchConfig) -> list[dict]:
    """Each quantized variant's decode step time against the bf16 baseline's (ratio: the speed-up)."""
    base, figures = runs[0], []
    for run_ in runs[1:]:
        for batch in cfg.decode_batches:
            ms, base_ms = run_["decode_ms"][batch], base["decode_ms"][batch]
            target = DECODE_TARGETS[cfg.quantization] if batch == 1 and run_["kv_cache_dtype"] != "float8_e4m3fn" \
                else None
            figures.append(figure(f"decode step, {run_['name']}, batch {batch}, {cfg.context} ctx", ms, "ms/step",
                                  base_ms, f"{base['name']} ms/step", base_ms / ms, ">=", target,
                                  {"weights_bytes": run_["weights_bytes"], "bf16_weights_bytes": base["weights_bytes"]}))
    return figures


def _kv_figures(bf16_kv: dict, fp8_kv: dict, cfg: QuantBenchConfig, timer: DeviceTimer, dtype: torch.dtype) -> list:
    """The decode attention kernel alone over a bf16 and an FP8 cache, and the cache's tokens."""
    s = cfg.shape
    times = {}
    for name, kv_dtype in (("bf16", dtype), ("fp8", torch.float8_e4m3fn)):
        times[name] = paged_attention_alone(
            timer, batch=cfg.attn_batch, context=cfg.attn_context, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
            head_dim=s.text_hidden_size // s.num_heads, block_size=cfg.block_size, dtype=dtype,
            calls=cfg.attn_calls, seed=cfg.seed, kv_dtype=kv_dtype)
    a, b = times["bf16"]["seconds_per_call"], times["fp8"]["seconds_per_call"]
    per_token = bf16_kv["kv_bytes_per_block"] / fp8_kv["kv_bytes_per_block"]
    capacity = fp8_kv["kv_capacity_tokens"] / bf16_kv["kv_capacity_tokens"]
    return [
        figure(f"FP8 KV: decode attention alone, batch {cfg.attn_batch} x {cfg.attn_context} ctx", b * 1e6, "us/call",
               a * 1e6, "bf16 cache us/call", a / b, ">=", KV_ATTENTION_TARGET, times),
        figure("FP8 KV: cache tokens per byte", 1.0 / fp8_kv["kv_bytes_per_block"], "blocks/B",
               1.0 / bf16_kv["kv_bytes_per_block"], "bf16 cache", per_token, ">=", KV_TOKENS_TARGET,
               {"fp8_capacity_tokens": fp8_kv["kv_capacity_tokens"],
                "bf16_capacity_tokens": bf16_kv["kv_capacity_tokens"], "capacity_ratio": capacity,
                "memory_utilization": cfg.memory_utilization}),
    ]


def format_report(report: dict) -> str:
    lines = [f"{report['benchmark']} ({report['preset']}) on {report['device']}, {report['date']}",
             f"command: {report['command']}", f"torch {report['torch']}, triton {report['triton']}; quantization "
             f"{report['quantization']}; quantized in {report['quantize_seconds']:.1f} s", ""]
    for v in report["variants"]:
        decode = ", ".join(f"b{b}: {ms:.2f} ms" for b, ms in v["decode_ms"].items())
        lines.append(f"{v['name']}: weights {v['weights_bytes'] / 2 ** 20:,.2f} MiB, KV {v['kv_cache_dtype']} "
                     f"({v['kv_capacity_tokens']:,} tokens); decode {decode}")
    width = max(len(f["name"]) for f in report["figures"])
    lines += ["", f"{'figure':<{width}} {'measured':>20} {'against':>30} {'ratio':>8}  {'target':<12} result"]
    for f in report["figures"]:
        result = {True: "PASS", False: "FAIL", None: "-"}[f["pass"]]
        lines.append(f"{f['name']:<{width}} {f['value']:>12.4g} {f['unit']:<7} {f['baseline_kind']:>20} "
                     f"{f['baseline']:>9.4g} {f['ratio']:>7.2f}x  {f['target']:<12} {result}")
    return "\n".join(lines + [f"notes: {n}" for n in report["notes"]] + [f"{report['seconds']:.0f} s in all"])
