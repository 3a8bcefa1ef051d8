"""The plan as a picture: `vlm-sdk plan --html FILE` / `--svg FILE`, and the server's /plan page (server/plan_page.py).

Drawn from a plan's JSON (`MemoryPlan.to_dict()`, or the engine's `StartupMemory.to_dict()`: the same keys),
so the running engine's page and the offline plan are one drawing:

    memory bar      the device's memory stacked: weights by part, the activation peak, the encoder cache, each
                    cache group's KV (the pool split as one max_model_len sequence splits it), the state slots,
                    what others hold, headroom (the rest of the device); each segment an SVG rect whose
                    `data-bytes` is its bytes and whose width is its share of the bar
    at once         requests at once against context length: min(max_num_seqs, blocks // blocks per request)
    workload        with --workload: the share of requests by tokens, beside the longest request

Self-contained: inline SVG and CSS, no script, nothing fetched (the server's page adds a script of its own).
"""
from __future__ import annotations

import html
import math
from typing import Callable

from vlm_sdk.memory.report import format_bytes

BAR_WIDTH = 900.0  # px: the memory bar's full width is the device's memory
COLORS = {"weights": "#4e79a7", "vision": "#76b7b2", "projector": "#2b5d8a", "activation": "#f28e2b",
          "encoder": "#b07aa1", "kv": "#59a14f",
          "state": "#edc948", "others": "#9c755f", "headroom": "#d3d3d3"}
_KV_SHADES = ("#59a14f", "#8cd17d", "#3d7a34", "#b6e3a8", "#2f5e28", "#a0cf92", "#6aa85d")


def memory_segments(d: dict) -> list[tuple[str, str, int]]:
    """(name, kind, bytes) of each part of the device's memory, in the bar's order; zero-byte parts left out."""
    parts = [("weights: language model", "weights", d["weights_language_model_bytes"]),
             ("weights: vision tower", "vision", d["weights_vision_bytes"]),
             ("weights: projector", "projector", d["weights_projector_bytes"]),
             ("weights: draft", "projector", d.get("weights_draft_bytes") or 0),
             ("activation peak", "activation", d.get("activation_peak_bytes") or 0),
             ("encoder cache", "encoder", d["encoder_cache_bytes"])]
    kv = d["kv_cache_bytes"]
    groups = [g for g in d.get("cache_groups") or () if g["kind"] != "state"]
    if groups:  # the shared pool as one max_model_len sequence splits it: each group's share of its blocks
        per = [g["blocks_per_sequence"] for g in groups]
        shares = [kv * b // sum(per) for b in per]
        shares[-1] += kv - sum(shares)  # whole bytes that add up to the pool
        for i, (g, b) in enumerate(zip(groups, shares)):
            what = "full attention" if g["kind"] == "full" else f"sliding window {g['window']}"
            parts.append((f"KV: group {i} ({what})", "kv", b))
    else:
        parts.append(("KV cache", "kv", kv))
    parts.append(("state slots", "state", d.get("state_bytes") or 0))
    total = d.get("device_memory_bytes") or d.get("host_memory_bytes")
    used = sum(b for _, _, b in parts)
    others = d.get("device_in_use_bytes") or 0
    if "weights_allocated_bytes" in d and others:  # the engine's in-use count includes its own weights
        others = max(0, others - d["weights_language_model_bytes"] - d["weights_vision_bytes"]
                     - d["weights_projector_bytes"] - (d.get("weights_draft_bytes") or 0))
    parts.append(("in use by others", "others", others))
    if total:
        parts.append(("headroom", "headroom", max(0, total - used - others)))
    return [p for p in parts if p[2] > 0]


def memory_bar_svg(d: dict) -> str:
    segments = memory_segments(d)
    total = sum(b for _, _, b in segments)
    x, rects, legend = 0.0, [], []
    shade = iter(_KV_SHADES * 8)
    for i, (name, kind, size) in enumerate(segments):
        width = size / total * BAR_WIDTH
        color = next(shade) if kind == "kv" else COLORS[kind]
        title = f"{name}: {format_bytes(size)} ({size / total:.1%})"
        rects.append(f'<rect class="segment" data-name="{html.escape(name)}" data-kind="{kind}" data-bytes="{size}" '
                     f'x="{x:.6f}" y="0" width="{width:.6f}" height="40" fill="{color}"><title>{html.escape(title)}'
                     f'</title></rect>')
        y = 60 + 18 * i
        legend.append(f'<rect x="0" y="{y - 11}" width="12" height="12" fill="{color}"/>'
                      f'<text x="18" y="{y}">{html.escape(title)}</text>')
        x += width
    height = 60 + 18 * len(segments)
    return (f'<svg id="memory-bar" xmlns="http://www.w3.org/2000/svg" width="{BAR_WIDTH:.0f}" height="{height}" '
            f'data-total-bytes="{total}" font-family="sans-serif" font-size="12">{"".join(rects)}'
            f'{"".join(legend)}</svg>')


def at_once_curve(max_num_seqs: int, num_blocks: int, blocks_for: Callable[[int], int], longest: int,
                  points: int = 48) -> list[tuple[int, int]]:
    """(context length, requests of that length the blocks hold at once) from 128 tokens to `longest`, log-spaced."""
    if longest < 1:
        return []
    lo = min(128, longest)
    lengths = sorted({int(round(lo * (longest / lo) ** (i / (points - 1)))) for i in range(points)} | {longest})
    return [(n, min(max_num_seqs, num_blocks // max(blocks_for(n), 1))) for n in lengths]


def group_blocks_for(cache_groups, block_size: int, chunk_tokens: int) -> Callable[[int], int]:
    """Blocks one sequence of n tokens holds over the report's attention groups (CacheLayout.blocks_for_tokens'
    rule); one full-attention group when `cache_groups` is empty."""
    groups = [g for g in cache_groups or () if g["kind"] != "state"] or [{"kind": "full", "window": None}]

    def blocks_for(n: int) -> int:
        full = -(-n // block_size)
        return sum(full if g["window"] is None else
                   min(full, (g["window"] - 1 + min(chunk_tokens, n) - 1) // block_size + 2) for g in groups)
    return blocks_for


def _axes(width: int, height: int, xlabel: str, ylabel: str) -> str:
    return (f'<line x1="50" y1="{height - 30}" x2="{width - 10}" y2="{height - 30}" stroke="#333"/>'
            f'<line x1="50" y1="10" x2="50" y2="{height - 30}" stroke="#333"/>'
            f'<text x="{width // 2}" y="{height - 5}" text-anchor="middle">{xlabel}</text>'
            f'<text x="12" y="{height // 2}" transform="rotate(-90 12 {height // 2})" text-anchor="middle">{ylabel}</text>')


def at_once_svg(curve: list[tuple[int, int]], width: int = 900, height: int = 260) -> str:
    """Requests at once against context length (log x)."""
    if not curve:
        return ""
    lo, hi = math.log(curve[0][0]), math.log(max(curve[-1][0], curve[0][0] + 1))
    top = max(c for _, c in curve) or 1

    def px(n: int, c: int) -> tuple[float, float]:
        return (50 + (math.log(n) - lo) / (hi - lo or 1) * (width - 60), height - 30 - c / top * (height - 45))
    path = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(px(n, c) for n, c in curve))
    dots = "".join(f'<circle class="point" data-tokens="{n}" data-at-once="{c}" cx="{x:.1f}" cy="{y:.1f}" r="2.5">'
                   f'<title>{n:,} tokens: {c} at once</title></circle>' for n, c in curve for x, y in [px(n, c)])
    ticks = "".join(f'<text x="{px(n, 0)[0]:.1f}" y="{height - 18}" text-anchor="middle">{_short(n)}</text>'
                    for n, _ in curve[::max(1, len(curve) // 8)])
    return (f'<svg id="at-once" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="11">{_axes(width, height, "tokens per request (log)", "at once")}'
            f'<text x="46" y="16" text-anchor="end">{top}</text><path d="{path}" fill="none" stroke="#4e79a7" '
            f'stroke-width="2"/>{dots}{ticks}</svg>')


def workload_svg(w: dict, width: int = 900, height: int = 240) -> str:
    """The workload's requests by tokens (bars: share of the weight), the longest request a red line."""
    bins = w.get("histogram") or []
    if not bins:
        return ""
    limit = w["longest_request_tokens"]
    hi = max(b[1] for b in bins) * 1.1
    beyond = limit > hi * 1.5  # far past the workload: named at the right edge, not drawn to scale
    hi = hi if beyond else max(hi, limit * 1.05)
    top = max(b[2] for b in bins) or 1

    def x(n: float) -> float:
        return 50 + n / hi * (width - 60)
    bars = "".join(f'<rect class="bin" data-lo="{lo}" data-hi="{up}" data-share="{share:.6f}" x="{x(lo):.1f}" '
                   f'y="{height - 30 - share / top * (height - 45):.1f}" width="{max(x(up) - x(lo), 1):.1f}" '
                   f'height="{share / top * (height - 45):.1f}" fill="#59a14f"><title>{lo:,}-{up:,} tokens: '
                   f'{share:.1%}</title></rect>' for lo, up, share in bins)
    ticks = "".join(f'<text x="{x(n):.1f}" y="{height - 18}" text-anchor="middle">{_short(int(n))}</text>'
                    for n in (hi * i / 5 for i in range(6)))
    if beyond:
        line = (f'<text id="longest" data-tokens="{limit}" x="{width - 12}" y="40" text-anchor="end" '
                f'fill="#e15759">longest request {limit:,} tokens &#8594;</text>')
    else:
        line = (f'<line id="longest" data-tokens="{limit}" x1="{x(limit):.1f}" y1="10" x2="{x(limit):.1f}" '
                f'y2="{height - 30}" stroke="#e15759" stroke-width="2"/><text x="{x(limit) - 4:.1f}" y="22" '
                f'text-anchor="end" fill="#e15759">longest request {limit:,}</text>')
    line += f'<text x="46" y="16" text-anchor="end">{top:.0%}</text>{ticks}'
    return (f'<svg id="workload" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="11">{_axes(width, height, "tokens per request", "share")}{bars}'
            f'{line}</svg>')


def _short(n: int) -> str:
    if n >= 10_000:
        return f"{n / 1000:.0f}k"
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


_CSS = ("body{font-family:sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:28px}"
        "table{border-collapse:collapse;font-size:13px}td{padding:2px 12px 2px 0;vertical-align:top}"
        ".problem{color:#b00}")


def page(d: dict, curve: list[tuple[int, int]], title: str, extra: str = "", script: str = "") -> str:
    """The whole page: the three pictures and the plan's key numbers; `extra` / `script`: the server's live part."""
    w = d.get("workload")
    rows = [("model", d.get("architecture") or d.get("device", "")), ("device", d.get("device", "")),
            ("KV blocks", f"{d['num_blocks']:,} x {d['block_size']} tokens, {format_bytes(d['kv_cache_bytes'])}"),
            ("longest request", f"{d.get('longest_request_tokens') or d.get('max_model_len'):,} tokens"),
            ("max_num_seqs", str(d.get("max_num_seqs", "")))]
    problems = "".join(f'<p class="problem">{html.escape(p["message"])}</p>' for p in d.get("problems") or ())
    table = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    parts = [f"<h1>{html.escape(title)}</h1><table>{table}</table>{problems}",
             f'<h2>Device memory</h2>{memory_bar_svg(d)}', extra,
             f"<h2>Requests at once by context length</h2>{at_once_svg(curve)}"]
    if w:
        parts.append(f"<h2>Workload: requests by tokens against capacity ({w['fit_share']:.1%} fit)</h2>"
                     f"{workload_svg(w)}<p>to serve 99%: <code>{html.escape(w['serve_99_flags'] or 'nothing to change')}"
                     f"</code></p>")
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">'
            f'<title>{html.escape(title)}</title>'
            f'<style>{_CSS}</style></head><body>{"".join(parts)}{script}</body></html>')


def standalone_svg(d: dict, curve: list[tuple[int, int]]) -> str:
    """The pictures stacked in one SVG file (--svg)."""
    pieces = [memory_bar_svg(d), at_once_svg(curve)] + ([workload_svg(d["workload"])] if d.get("workload") else [])
    y, inner = 0, []
    for piece in pieces:
        h = int(piece.split('height="', 1)[1].split('"', 1)[0])
        inner.append(f'<g transform="translate(0,{y})">{piece}</g>')
        y += h + 20
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{BAR_WIDTH:.0f}" height="{y}">{"".join(inner)}</svg>'
