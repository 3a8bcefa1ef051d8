"""`vlm-sdk bench --sampler`: the sampler before issue 19 vs now, same logits, same process (issue 19,
point 4). Times one `sample` call at 64 rows x 151,936 vocabulary (Qwen2.5-VL's) for top-p, top-k,
seeded rows and penalties, and the peak memory above the call's inputs (the process's peak resident
set, reset before each call: Linux only).

"before" is `sample_before_issue_19` below: the full-vocabulary sort (`filtered_probs_reference`),
a vocabulary of exponentials drawn on the host per seeded row (then copied to the logits' device)
and the per-row penalty loop (`apply_penalties_reference`). "now" is `Sampler.sample`.

Logits come in two shapes: "peaked" (Zipf-like, exponent 1.2: a language model's usual next-token
distribution, whose top-p 0.9 nucleus lies within the 1,024 candidates) and "flat" (standard normal:
the worst case, where every top-p row's nucleus is most of the vocabulary and takes the full sort).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

from vlm_sdk.bench.flags import SamplerBenchConfig
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.sample.penalties import apply_penalties_reference, needs_edit
from vlm_sdk.sample.sampler import Sampler
from vlm_sdk.sample.top_k_top_p import CANDIDATES, filtered_probs, filtered_probs_reference




def sample_before_issue_19(sampler: Sampler, logits: torch.Tensor,  # [rows, vocab] float32
                           params: list[SamplingParams], histories) -> list[int]:
    """The sampling path as it was (tokens only): per-row penalties, full sort, host draws."""
    if any(needs_edit(p, len(h[0]) - h[1]) for p, h in zip(params, histories)):
        logits = logits.float().clone()  # [rows, vocab]
        apply_penalties_reference(logits, params, histories)
    dev = logits.device
    probs = filtered_probs_reference(logits.float(), params)  # [rows, vocab]
    q = torch.empty_like(probs)  # [rows, vocab]
    shared = [j for j, p in enumerate(params) if p.seed is None]
    if shared:
        q[torch.tensor(shared, device=dev)] = torch.empty(len(shared), probs.shape[1], device=dev).exponential_(
            1.0, generator=sampler._generator(sampler.generators, dev))
    for j, p in enumerate(params):
        if p.seed is not None:  # the request's own CPU generator drew a whole vocabulary on the host
            own = torch.Generator().manual_seed(p.seed)
            q[j] = torch.empty(probs.shape[1]).exponential_(1.0, generator=own).to(dev)  # [vocab]
    return (probs / q).argmax(dim=-1).tolist()


def bench_logits(shape: str, rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if shape == "flat":
        return torch.randn(rows, vocab, generator=g)  # [rows, vocab]
    ranks = torch.stack([torch.randperm(vocab, generator=g) for _ in range(rows)]).float()  # [rows, vocab]
    return -1.2 * torch.log1p(ranks) + 0.1 * torch.randn(rows, vocab, generator=g)


def scenarios(cfg: SamplerBenchConfig):
    """(name, params per row, histories or None)."""
    n = cfg.rows
    hist = [(list(range(1, cfg.prompt_tokens + 1)) + [(7 * t) % 5000 for t in range(cfg.output_tokens)],
             cfg.prompt_tokens, (2,))] * n
    return [
        ("top-p 0.9", [SamplingParams(temperature=0.8, top_p=0.9)] * n, None),
        ("top-p 0.9, every row seeded", [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(n)], None),
        ("top-k 50 + top-p 0.95, half seeded",
         [SamplingParams(temperature=0.7, top_k=50, top_p=0.95, seed=i if i % 2 else None) for i in range(n)], None),
        ("temperature 1, every row seeded", [SamplingParams(temperature=1.0, seed=i) for i in range(n)], None),
        (f"penalties (history {cfg.prompt_tokens}+{cfg.output_tokens}) + top-p 0.95",
         [SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.5,
                         frequency_penalty=0.2)] * n, hist),
    ]


def _peak_bytes(fn) -> int | None:
    """Peak resident memory above the current one while `fn` runs (None where Linux cannot say)."""
    try:
        # glibc serves large blocks with mmap and returns them at free, so the resident peak sees
        # every temporary; a fixed threshold stops it from raising that limit after the first frees,
        # and trimming returns what earlier frees left resident in the heap
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD, 64 KiB
        libc.malloc_trim(0)  # free heap pages leave the resident set: reusing them counts again
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set
    except (OSError, AttributeError):
        return None
    base = _status("VmRSS")
    fn()
    return max(0, _status("VmHWM") - base)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_sampler_bench(cfg: SamplerBenchConfig) -> list[dict]:
    rows = []
    for shape in ("peaked", "flat"):
        logits = bench_logits(shape, cfg.rows, cfg.vocab)
        for name, params, hist in scenarios(cfg):
            histories = hist if hist is not None else [([1, 2], 1, ())] * cfg.rows  # one output token so far
            sampler = Sampler(0)
            old = lambda: sample_before_issue_19(sampler, logits, params, histories)  # noqa: E731
            new = lambda: sampler.sample(logits, params, histories)  # noqa: E731
            t_old, t_new = _timed(old, cfg.repeats), _timed(new, cfg.repeats)
            m_old, m_new = _peak_bytes(old), _peak_bytes(new)
            kept = (filtered_probs(logits, params) > 0).sum(dim=-1).tolist()  # [rows]
            past = sum(1 for p, k in zip(params, kept) if p.top_p < 1.0 and k > CANDIDATES)  # took the full sort
            rows.append(dict(shape=shape, scenario=name, before_ms=t_old * 1e3, now_ms=t_new * 1e3,
                             speedup=t_old / t_new, before_peak_mib=None if m_old is None else m_old / 2 ** 20,
                             now_peak_mib=None if m_new is None else m_new / 2 ** 20,
                             rows_past_candidates=past))
    return rows


def main(args: argparse.Namespace) -> int:
    cfg = SamplerBenchConfig(rows=args.sampler_rows, vocab=args.sampler_vocab, repeats=args.sampler_repeats)
    results = run_sampler_bench(cfg)
    if args.json:
        print(json.dumps(dict(rows=cfg.rows, vocab=cfg.vocab, threads=torch.get_num_threads(), results=results)))
        return 0
    print(f"sampler, {cfg.rows} rows x {cfg.vocab} vocabulary, float32 on the CPU, {torch.get_num_threads()} "
          f"threads, median of {cfg.repeats}; peak = process peak resident memory above the inputs")
    print(f"| logits | scenario | before | now | speed-up | peak before | peak now | rows past {CANDIDATES} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        peak = ("n/a", "n/a") if r["before_peak_mib"] is None else \
            (f"{r['before_peak_mib']:.0f} MiB", f"{r['now_peak_mib']:.0f} MiB")
        print(f"| {r['shape']} | {r['scenario']} | {r['before_ms']:.1f} ms | {r['now_ms']:.1f} ms | "
              f"{r['speedup']:.2f}x | {peak[0]} | {peak[1]} | {r['rows_past_candidates']} |")
    return 0
