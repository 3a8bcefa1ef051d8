"""`vlm-sdk bench --gpu --profile PATH`: where the time of a decode step and of a cold prefill goes.

torch.profiler records `profile_steps` decode steps at the smallest and the largest decode batch (after
the same prefill and warm-up as the timed figure, so CUDA graphs replay as they do when serving) and
one cold prefill (a new image: the vision tower and the LLM's prefill both run). Each section's table
lists every device kernel by name with its calls and time per step (per request for the prefill),
sorted by time, and a sum by kind (GEMM, attention, norms, ...). On the CPU (`--tiny`) the rows are
the host's torch operators, self time: the path and the file are checked, not a device's kernels.
PATH gets the tables as text; the JSON report keeps each section's totals, kinds and first rows.
"""
from __future__ import annotations

import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from vlm_sdk.bench.gpu_figures import ColdPrefill, decode_steps, decoding

# kernel name -> kind, first match wins (cuBLAS names its GEMMs nvjet_* / *gemm* / sm90_xmma_*)
KINDS = (("gemm", r"nvjet|gemm|cutlass|xmma|splitKreduce|aten::(mm|addmm|bmm|linear|matmul)"),
         ("attention", r"attention|_decode_split|_decode_merge|_paged_prefill|_varlen|flash|sdpa"),
         ("rms_norm", r"rms_norm"), ("rotary", r"rotary"), ("store_kv", r"store_kv"),
         ("silu_and_mul", r"silu"),
         ("sampler", r"argmax|topk|top_p|exponential|sort|softmax|_race"),
         ("copies", r"Memcpy|Memset|copy|index|gather|scatter|cat|elementwise|fill"))
SHOWN_ROWS = 12  # rows of each table kept in the JSON report (PATH has them all)


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, name, re.I)), "other")


def kernel_table(prof, per: int, device_type: str) -> list[dict]:
    """Rows of `prof`'s averages on `device_type` ("CUDA" or "CPU"): name, calls and microseconds
    per step (`per` steps were recorded), the kind; by time, largest first."""
    rows = []
    for e in prof.key_averages():
        if e.device_type.name != device_type:
            continue
        us = e.self_device_time_total if device_type == "CUDA" else e.self_cpu_time_total
        if us <= 0:
            continue
        rows.append({"name": e.key, "calls_per_step": e.count / per, "us_per_step": us / per, "kind": kind_of(e.key)})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def _section(title: str, prof, per: int, device_type: str, wall_s: float) -> dict:
    rows = kernel_table(prof, per, device_type)
    kinds: dict[str, float] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0.0) + r["us_per_step"]
    return {"title": title, "steps": per, "wall_ms_per_step": wall_s * 1e3,
            "recorded_ms_per_step": sum(r["us_per_step"] for r in rows) / 1e3,
            "device_rows": device_type, "kinds_us_per_step": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "rows": rows}


def _activities(device: torch.device) -> tuple[list, str]:
    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA], "CUDA"
    return [ProfilerActivity.CPU], "CPU"


def profile_run(engine, cfg, timer) -> dict:
    """The sections above, as a dict; `format_profile` turns it into PATH's text."""
    activities, rows_on = _activities(torch.device(cfg.device))
    sections = []
    steps = cfg.profile_steps
    for batch in sorted({min(cfg.decode_batches), max(cfg.decode_batches)}):
        with decoding(engine, cfg, batch):
            timer.sync()
            t0 = time.perf_counter()
            decode_steps(engine, batch, steps)  # unprofiled: the wall time beside the table
            timer.sync()
            wall = (time.perf_counter() - t0) / steps
            with profile(activities=activities) as prof:
                decode_steps(engine, batch, steps)
                timer.sync()
        sections.append(_section(f"decode, batch {batch}, {cfg.context} ctx: per step", prof, steps, rows_on, wall))
    prefill = ColdPrefill(engine, cfg)
    prefill.first_token(prefill.prompt(-1), timer)  # compiled for this size
    wall = prefill.first_token(prefill.prompt(-2), timer)
    with profile(activities=activities) as prof:
        prefill.first_token(prefill.prompt(-3), timer)
    sections.append(_section(f"cold prefill, {cfg.prefill_image}x{cfg.prefill_image} image + text: per request",
                             prof, 1, rows_on, wall))
    return {"activities": [a.name for a in activities], "sections": sections}


def summary(result: dict) -> dict:
    """What the JSON report keeps: every section without its long tail of rows."""
    return {**result, "sections": [{**s, "rows": s["rows"][:SHOWN_ROWS], "rows_total": len(s["rows"])}
                                   for s in result["sections"]]}


def format_profile(result: dict, header: str) -> str:
    lines = [header, ""]
    for s in result["sections"]:
        lines += [f"=== {s['title']} ({s['steps']} recorded): wall {s['wall_ms_per_step']:.3f} ms, "
                  f"{s['device_rows']} time recorded {s['recorded_ms_per_step']:.3f} ms",
                  "by kind (us): " + ", ".join(f"{k} {v:,.1f}" for k, v in s["kinds_us_per_step"].items()),
                  f"{'us/step':>10} {'calls/step':>10}  {'kind':<12} name"]
        lines += [f"{r['us_per_step']:>10.1f} {r['calls_per_step']:>10.1f}  {r['kind']:<12} {r['name']}"
                  for r in s["rows"]]
        lines.append("")
    return "\n".join(lines)
