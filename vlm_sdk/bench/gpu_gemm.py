"""`vlm-sdk bench --gpu`'s small-M section: the decoder's projections at 1-8 rows, cuBLAS (`F.linear`)
against the Triton kernel (`kernels/skinny_gemm.py`), timed in the same run on the model's shapes.

    qkv      [M, hidden] x [(H + 2 Hkv) D, hidden]^T + bias
    o        [M, H D]    x [hidden, H D]^T
    gate_up  [M, hidden] x [2 I, hidden]^T        (reported; the engine routes qkv and o only)
    down     [M, I]      x [hidden, I]^T

Each is timed as a CUDA graph of `calls` products cycling over enough weight copies to be 4x the L2
cache (so weights come from DRAM, as in a decode step), best of 5 replays; bandwidth = weight bytes /
time. The two outputs are compared (max |difference| over max |output|). The winner per projection
and row count is recorded, and `recommended` says which `small_m_gemm` setting the qkv and o rows
favour: "triton" only where it is faster at every row count. On the CPU (`--tiny`) both run (the kernel
in Triton's interpreter): the plumbing is checked, the times say nothing.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ROWS = (1, 2, 4, 8)
ROUTED = ("qkv", "o")  # what the engine's small_m_gemm setting changes


def projection_shapes(shape) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, bias) of a decoder layer of `shape` (a gpu_parts.ModelShape)."""
    d = shape.text_hidden_size // shape.num_heads
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
    return {"qkv": (qkv, shape.text_hidden_size, True), "o": (shape.text_hidden_size, shape.num_heads * d, False),
            "gate_up": (2 * shape.intermediate_size, shape.text_hidden_size, False),
            "down": (shape.text_hidden_size, shape.intermediate_size, False)}


def _time(timer, fn, calls: int) -> float:
    """Seconds per call: a CUDA graph of `calls` calls replayed (best of 5), or a wall clock on the CPU."""
    fn(0)  # warm-up: compile, pick the cuBLAS algorithm
    if timer.device.type != "cuda":
        return timer.per_call(lambda: fn(0), calls)
    timer.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    return min(timer.per_call(graph.replay) for _ in range(5)) / calls


@torch.inference_mode()
def small_m_gemm_section(shape, timer, dtype: torch.dtype, calls: int, seed: int) -> dict:
    from vlm_sdk.kernels.skinny_gemm import skinny_gemm

    device = timer.device
    gen = torch.Generator(device=device).manual_seed(seed)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) if device.type == "cuda" else 0
    rows, winners = [], {}
    for name, (n, k, bias) in projection_shapes(shape).items():
        nbytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(1, math.ceil(4 * l2 / nbytes))
        w = torch.randn(copies, n, k, generator=gen, device=device, dtype=dtype) * k ** -0.5  # [copies, N, K]
        b = torch.randn(n, generator=gen, device=device, dtype=dtype) if bias else None
        for m in ROWS:
            x = torch.randn(m, k, generator=gen, device=device, dtype=dtype)  # [M, K]

            def cublas(i, x=x, w=w, b=b):  # as the layers call it: its output allocated (in the graph's pool)
                return F.linear(x, w[i % copies], b)

            def triton(i, x=x, w=w, b=b):
                return skinny_gemm(x, w[i % copies], b)
            t_cublas, t_triton = _time(timer, cublas, calls), _time(timer, triton, calls)
            want, got = cublas(0).float(), triton(0).float()
            diff = float((want - got).abs().max()) / (float(want.abs().max()) or 1.0)
            winner = "triton" if t_triton < t_cublas else "torch"
            winners.setdefault(name, []).append(winner)
            rows.append({"projection": name, "rows": m, "n": n, "k": k, "weight_bytes": nbytes,
                         "torch_us": t_cublas * 1e6, "triton_us": t_triton * 1e6,
                         "torch_GBps": nbytes / t_cublas / 1e9, "triton_GBps": nbytes / t_triton / 1e9,
                         "winner": winner, "max_rel_diff": diff})
        del w
    routed_wins = all(wv == "triton" for name in ROUTED for wv in winners[name])
    return {"rows": rows, "calls": calls, "recommended": "triton" if routed_wins else "torch"}


def format_section(section: dict, used: str) -> list[str]:
    lines = [f"small-M projections (cuBLAS vs kernels/skinny_gemm.py, {section['calls']} calls per timing): "
             f"recommended small_m_gemm='{section['recommended']}' (this run's engine used '{used}')",
             f"  {'proj':<8} {'rows':>4} {'torch us':>9} {'triton us':>9} {'torch GB/s':>10} {'triton GB/s':>11}  winner"]
    for r in section["rows"]:
        lines.append(f"  {r['projection']:<8} {r['rows']:>4} {r['torch_us']:>9.2f} {r['triton_us']:>9.2f} "
                     f"{r['torch_GBps']:>10.1f} {r['triton_GBps']:>11.1f}  {r['winner']}")
    return lines
