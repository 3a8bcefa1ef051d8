"""`vlm-sdk bench --gpu`: the Qwen2.5-VL-3B figures of issue 5, measured in one run on one GPU.

The full Qwen2.5-VL-3B architecture (3.75B parameters) is built on the GPU with random bf16 weights
and saved to a temporary checkpoint (under $VLM_SDK_CACHE when set); our engine loads it with
`memory_utilization` 0.45 while the transformers model that wrote it stays on the GPU as the peer.
The engine runs without prefix caching (no figure here reuses a prompt, and the prefill must be cold),
with the image setting the bench's shapes need (`vlm-sdk plan`'s fix when the checkpoint's largest
image would not fit max_model_len; the report says what was set). Every floor uses rates measured in
the same run:

    copy bandwidth  a 2 GiB device-to-device copy, (bytes read + bytes written) / time, best of 10
    matmul rate     an 8192^3 bf16 torch.matmul, 2 n^3 / time, best of 10

    figure                            measured as                       against                target
    decode, batch 1/8/64, 2048 ctx    ms per llm.engine.step()          (LLM weight bytes + KV   1.25x (b=1)
                                      (32 steps, all sequences decoding) bytes attended) / copy  1.5x (b=64)
    paged_attention_decode alone      K+V+q+out bytes / time per call   copy bandwidth          >= 70%
      (16 x 4096, H16/Hkv2/D128)      (CUDA graph of 50 calls, best of 5)
    prefill: 1024x1024 image + 32     add_request -> first token, a new matmul FLOPs (vision     2x
      text tokens, cold               image each time (median of 5)     tower + LLM) / rate
      vision tower alone              encode_images on those images     vision FLOPs / rate     reported
      language model alone            each request again, its image     LLM FLOPs / rate        reported
                                      from the encoder cache
    64 concurrent 448x448 requests,   LLM.chat on all at once           transformers generate   >= 5x
      128 tokens each (ignore_eos)                                      (sdpa, bf16, batch 64)

`--profile PATH`: torch.profiler's kernel table (name, calls and time per step) of decode at the
smallest and largest batch and of one cold prefill, written to PATH (`gpu_profile.py`).

Runtime on one H100 (2026-11-26): 44-67 s for the figures, transformers' peer included. Smaller runs:
`--decode-batches 1,8 --requests 16`. `--tiny`: the same code path on the CPU with `vlm_sdk.testing`'s
tiny shape and small sizes (what the smoke test runs, well under a minute); its figures check the
plumbing, not the targets.
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm_sdk.bench.gpu_figures import (ATTENTION_TARGET, DECODE_TARGETS, PREFILL_TARGET, THROUGHPUT_TARGET,
                                       attention_figure, decode_figure, figure, ours_throughput, prefill_figures,
                                       throughput_convs)
from vlm_sdk.bench.gpu_gemm import format_section, small_m_gemm_section
from vlm_sdk.bench.gpu_parts import (QWEN2_5_VL_3B, TINY, DeviceTimer, GpuBenchError, ModelShape, build_checkpoint,
                                     checkpoint_dir, copy_bandwidth, device_name, free_memory, image_setting_fix,
                                     matmul_rate, plan_options, plan_vs_engine, transformers_throughput,
                                     triton_version)
from vlm_sdk.testing.hooks import local_worker

__all__ = ["GpuBenchConfig", "GpuBenchError", "FULL_RUN", "TINY_RUN", "config_from_args",
           "format_report", "reject_without_gpu", "run", "run_gpu_benchmark"]


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
    profile: str | None = None  # a path: write the kernel tables there (gpu_profile.py)
    profile_steps: int = 20  # decode steps each profiled batch records
    small_m_gemm: str = "torch"  # our engine's setting; the small-M section times both anyway
    piecewise_cuda_graphs: bool | None = None  # None: the engine's default (off)
    gemm_calls: int = 50  # products per small-M timing

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
                     "prefill_reps", "requests", "request_image", "max_tokens", "profile_steps"):
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
    max_num_batched_tokens=128, profile_steps=3, gemm_calls=2)  # small: decode prompts prefill over several steps, as on the GPU


# ----------------------------------------------------------------------------------------------
# command line

_GPU_ONLY = ("tiny", "decode_batches", "context", "decode_steps", "requests", "max_tokens", "attn_batch",
             "attn_context", "memory_utilization", "async_scheduling", "profile", "small_m_gemm",
             "piecewise_cuda_graphs", "quantization", "kv_cache_dtype")



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
    command = shlex.join(["vlm-sdk", *argv])
    if args.quantization is not None:  # quantized weights (and KV) against bf16: vlm_sdk/bench/quantized.py
        from vlm_sdk.bench import quantized
        others = [f"--{n.replace('_', '-')}" for n in ("requests", "max_tokens", "async_scheduling", "profile",
                                                       "small_m_gemm", "piecewise_cuda_graphs")
                  if getattr(args, n, None) is not None]
        if others:
            raise GpuBenchError(f"{', '.join(others)} do not apply with --quantization")
        report = quantized.run(quantized.config_from_args(args), command)
        print(json.dumps(report, indent=2) if args.json else quantized.format_report(report))
        return 0
    from vlm_sdk.bench.quantized import reject_without_quantization
    reject_without_quantization(args)
    report = run(config_from_args(args), command=command)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


# ----------------------------------------------------------------------------------------------
# the run

def run(cfg: GpuBenchConfig, command: str) -> dict:
    import transformers
    from vlm_sdk.config import DTYPES

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
        figures = [attention_figure(cfg, timer, dtype, copy_bw, report["notes"])]
        report["small_m_gemm"] = small_m_gemm_section(cfg.shape, timer, dtype, cfg.gemm_calls, cfg.seed)
        free_memory(device)

        llm = _start_engine(ckpt, cfg, device, report)
        engine = llm.engine
        figures += [decode_figure(engine, cfg, batch, timer, copy_bw) for batch in cfg.decode_batches]
        figures += prefill_figures(engine, cfg, timer, mm_rate)
        if cfg.profile:
            report["profile"] = _profile(engine, cfg, timer, report)
        convs = throughput_convs(cfg)
        ours = ours_throughput(llm, convs, cfg, timer)
        eos = sorted(engine.eos_token_ids)
        del llm, engine  # the peer gets the memory our engine held (cache and graphs included)
        free_memory(device)
        theirs = transformers_throughput(hf_model, ckpt, convs, cfg.max_tokens, timer, eos)
        del hf_model
        free_memory(device)
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    figures.append(figure(f"throughput, {cfg.requests} concurrent {cfg.request_image}px image requests",
                          ours["tokens_per_s"], "tokens/s", theirs["tokens_per_s"], "transformers", ratio,
                          ">=", THROUGHPUT_TARGET, {"ours": ours, "transformers": theirs}))
    report["notes"].append("throughput: both sides' times include image preprocessing and tokenization")
    report["figures"] = figures
    report["seconds"] = time.perf_counter() - t_start
    return report


def _start_engine(ckpt: str, cfg: GpuBenchConfig, device: torch.device, report: dict):
    """Our engine on the checkpoint, with the image setting `vlm-sdk plan` says the bench's
    max_model_len needs (the report notes it); the plan made beside it is compared with the engine."""
    from vlm_sdk import LLM
    from vlm_sdk.plan import plan

    kwargs = _engine_kwargs(cfg, device)
    planned = plan(ckpt, **plan_options(kwargs))
    fix = image_setting_fix(planned)
    if fix:
        kwargs.update(fix)
        planned = plan(ckpt, **plan_options(kwargs))
        report["notes"].append(
            f"set {', '.join(f'{k}={v}' for k, v in fix.items())}: the checkpoint's largest allowed image does not "
            f"fit max_model_len={kwargs['max_model_len']} (the engine would refuse to start); the bench's own "
            f"images ({cfg.prefill_image}px, {cfg.request_image}px) are below it")
    report["engine_settings"] = {k: v for k, v in kwargs.items() if k != "show_progress"}
    llm = LLM(ckpt, **kwargs)
    engine = llm.engine
    report["async_scheduling"] = engine.async_scheduling
    report["plan_vs_engine"] = plan_vs_engine(planned, engine)
    report["engine"] = {"load_seconds": engine.load_seconds, "kv_blocks": engine.cache_config.num_blocks,
                        "kv_source": engine.cache_config.source,
                        "max_model_len": engine.scheduler_config.max_model_len,
                        "cuda_graphs": local_worker(engine).runner.graphs is not None}
    return llm


def _profile(engine, cfg: GpuBenchConfig, timer: DeviceTimer, report: dict) -> dict:
    from vlm_sdk.bench.gpu_profile import format_profile, profile_run, summary

    result = profile_run(engine, cfg, timer)
    header = (f"vlm-sdk bench --gpu --profile ({report['preset']}) on {report['device']}, {report['date']}; torch "
              f"{report['torch']}, triton {report['triton']}; command: {report['command']}")
    Path(cfg.profile).write_text(format_profile(result, header))
    return {"path": cfg.profile, **summary(result)}


def _engine_kwargs(cfg: GpuBenchConfig, device: torch.device) -> dict:
    # no prefix caching: no figure reuses a prompt, and the prefill figure must be cold
    kwargs = dict(device=cfg.device, dtype=cfg.dtype, block_size=cfg.block_size, seed=cfg.seed,
                  max_model_len=cfg.engine_max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
                  max_num_seqs=max(max(cfg.decode_batches), cfg.requests), show_progress=False,
                  enable_prefix_caching=False, small_m_gemm=cfg.small_m_gemm)
    if cfg.attention_backend is not None:
        kwargs["attention_backend"] = cfg.attention_backend
    if cfg.async_scheduling is not None:
        kwargs["async_scheduling"] = cfg.async_scheduling
    if cfg.piecewise_cuda_graphs is not None:
        kwargs["piecewise_cuda_graphs"] = cfg.piecewise_cuda_graphs
    if device.type == "cuda":
        kwargs["memory_utilization"] = cfg.memory_utilization
    return kwargs


def format_report(report: dict) -> str:
    m, r = report["model"], report["reference_rates"]
    width = max(len(f["name"]) for f in report["figures"])
    lines = [
        f"{report['benchmark']} ({report['preset']}) on {report['device']}, {report['date']}",
        f"command: {report['command']}",
        f"torch {report['torch']}, transformers {report['transformers']}, triton {report['triton']}",
        f"model: Qwen2.5-VL architecture, {m['parameters']:,} parameters (LLM {m['llm_parameters']:,}, vision "
        f"{m['vision_parameters']:,}), {m['dtype']}, {m['weights']}",
        f"measured rates: device copy {r['copy_GBps']:,.1f} GB/s ({r['copy_bytes'] >> 20} MiB, read + write); "
        f"matmul {_num(r['matmul_TFLOPs'])} TFLOP/s ({r['matmul_n']}^3)",
        "",
        f"{'figure':<{width}} {'measured':>18} {'against':>26} {'ratio':>8}  {'target':<22} result",
    ]
    for f in report["figures"]:
        result = {True: "PASS", False: "FAIL", None: "-"}[f["pass"]]
        lines.append(f"{f['name']:<{width}} {_num(f['value']) + ' ' + f['unit']:>18} "
                     f"{f['baseline_kind'] + ' ' + _num(f['baseline']):>26} {f['ratio']:>7.2f}x  {f['target']:<22} "
                     f"{result}")
    pv = report.get("plan_vs_engine")
    if pv:
        lines += ["", f"vlm-sdk plan vs the engine: {pv['plan_blocks']:,} vs {pv['engine_blocks']:,} KV blocks "
                  f"({pv['blocks_difference']:+.2%}; within 3%: {'yes' if pv['within_3_percent'] else 'NO'}); "
                  f"activation peak estimated {pv['plan_activation_peak_bytes']:,} B, measured "
                  f"{pv['engine_activation_peak_bytes'] if pv['engine_activation_peak_bytes'] is not None else '-'} B"]
    if report.get("small_m_gemm"):
        lines += [""] + format_section(report["small_m_gemm"], report["config"]["small_m_gemm"])
    lines += [""] + [f"note: {n}" for n in report["notes"]] + [f"total {report['seconds']:.1f} s"]
    return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.3g}"
