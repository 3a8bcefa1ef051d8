"""`vlm-sdk bench --cpu-gemm`: the CPU's float32 products, each path timed on the same weights in one run.

For a checkpoint's shapes (the LM head `vocab x hidden` and the decoder's fused q | k | v, o_proj and,
for a dense MLP, gate | up and down of one rank), at the row counts of decode (1, 16), a larger decode batch (64) and a
prefill chunk (512), it times:

    F.linear, row-major         what transformers runs (MKL's sgemm)
    F.linear, column-major      the engine's decoder layout before oneDNN (models/cpu_layout.py)
    MKL packed                  the LM head without oneDNN (`PackedLMHead`: up to 16 rows padded to 16,
                                more rows through F.linear)
    oneDNN                      `layers/cpu_gemm.onednn_linear` on the row-major weight: the engine now

Each cell is the median of `--gemm-repeats` calls after one warm-up; the paths of a cell run
interleaved so that a machine whose load changes during the run shifts them alike. The ratio column is
F.linear row-major / oneDNN.
"""
from __future__ import annotations

import json
import statistics
import time

import torch
import torch.nn.functional as F

from vlm_sdk.layers.cpu_gemm import onednn_available, onednn_linear

ROWS = (1, 16, 64, 512)


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """(out, in) of the LM head and the decoder's attention products, and its dense MLP's where it has one,
    from the checkpoint's text config."""
    from vlm_sdk.model_loader import read_checkpoint
    text = read_checkpoint(model_dir).text_config
    h = text.hidden_size
    heads, kv = text.num_attention_heads, getattr(text, "num_key_value_heads", text.num_attention_heads)
    d = getattr(text, "head_dim", None) or h // heads
    shapes = {"lm_head": (text.vocab_size, h), "qkv": ((heads + 2 * kv) * d, h), "o_proj": (h, heads * d)}
    inter = getattr(text, "intermediate_size", None)  # an MoE's experts are not these products: none then
    if inter is not None:
        shapes.update(gate_up=(2 * inter, h), down=(h, inter))
    return shapes


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _paths(weight: torch.Tensor) -> dict[str, object]:
    from vlm_sdk.models.cpu_layout import PackedLMHead, column_major
    col = column_major(weight)
    paths = {"F.linear row-major": lambda x: F.linear(x, weight), "F.linear column-major": lambda x: F.linear(x, col)}
    packed = PackedLMHead.create(weight)
    if packed is not None:
        paths["MKL packed"] = packed
    if onednn_available():
        paths["oneDNN"] = lambda x: onednn_linear(x, weight)
    return paths


@torch.inference_mode()
def run(shapes: dict[str, tuple[int, int]], repeats: int, rows=ROWS) -> list[dict]:
    out = []
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, generator=g) * k ** -0.5  # [out, in]
        paths = _paths(weight)
        for m in rows:
            x = torch.randn(m, k, generator=g)  # [m, in]
            cell = {p: [] for p in paths}
            for _ in range(3):  # interleaved thirds
                for p, fn in paths.items():
                    cell[p].append(_median_ms(lambda: fn(x), max(1, repeats // 3)))
            row = {"product": name, "shape": [n, k], "rows": m, **{p: min(v) for p, v in cell.items()}}
            if "oneDNN" in row:
                row["ratio"] = row["F.linear row-major"] / row["oneDNN"]
            out.append(row)
    return out


def main(args) -> int:
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    model_dir = args.model or str(tiny_model_dir("bench", args.family))
    shapes = checkpoint_shapes(model_dir)
    rows = run(shapes, args.gemm_repeats)
    if args.json:
        print(json.dumps({"model": model_dir, "threads": torch.get_num_threads(), "rows": rows}, indent=2))
        return 0
    print(f"CPU float32 products of {model_dir} ({torch.get_num_threads()} threads), ms (median):")
    paths = [p for p in rows[0] if p not in ("product", "shape", "rows", "ratio")]
    print(f"  {'product':<22} {'rows':>5} " + " ".join(f"{p:>22}" for p in paths) + "   F.linear / oneDNN")
    for r in rows:
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        print(f"  {r['product'] + ' ' + 'x'.join(map(str, r['shape'])):<22} {r['rows']:>5} "
              + " ".join(f"{r[p]:>22.3f}" for p in paths) + f"   {ratio:>8}")
    return 0
