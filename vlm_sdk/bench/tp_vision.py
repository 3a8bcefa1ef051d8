"""`python -m vlm_sdk.bench.tp_vision`: the vision tower under tensor parallelism, sharded or replicated.

For each family's benchmark checkpoint (`vlm_sdk.testing.make_bench_checkpoint`: the real vocab and
LM widths, a small vision tower) it times `model.encode_images` on one large image (Qwen2.5-VL: 1288 x
980 pixels, resized under max_pixels 28*28*1280 to 5,084 patches, 1,271 image tokens; InternVL: 1344 x
896 at max_num 6 -> 3 x 2 tiles + thumbnail, 1,792 image tokens) on the CPU, float32, each mode in a
fresh process:

    tp=1                  one process, every core (the same machine, one rank)
    tp=1, 1 thread        one process, one core: what one rank of the TP runs below has
    tp=2 sharded          two gloo ranks (run_on_ranks), one core each; heads / MLP split, two
                          all-reduces per block and one in the projector
    tp=2 replicated       two gloo ranks, one core each, each running the whole tower (shard_vision=False)

and prints each rank's vision + projector weight bytes and the times relative to tp=1. A timing is the
median of `--reps` calls after one warm-up; under TP the slowest rank's median counts (every rank must
finish before the decoder step can use the rows). The modes are interleaved over `--rounds` rounds
and the report gives each mode's median round and its range: on a shared 2-core machine the rounds
disagree by tens of percent.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vlm_sdk.layers.parallel_state import ParallelGroups, TPGroup
from vlm_sdk.models import registry
from vlm_sdk.testing import make_bench_checkpoint
from vlm_sdk.testing.distributed import run_on_ranks

# (width, height): a multiple of 28 and of 32 pixels (Qwen2.5-VL's and Qwen3-VL's patch cells) and 3x2
# InternVL tiles; the Qwen2.5-VL figure in BENCHMARKS.md was taken at 1288x980 before it was shared
IMAGE_SIZE = (1344, 896)
MODES = (("tp1", "tp=1", 1, True, None), ("tp1_1thread", "tp=1, 1 thread", 1, True, 1),
         ("tp2_sharded", "tp=2 sharded", 2, True, 1), ("tp2_replicated", "tp=2 replicated", 2, False, 1))


def _image(width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(0)
    base = Image.fromarray(rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    noise = rng.integers(-20, 20, size=(height, width, 3))
    return Image.fromarray(np.clip(np.asarray(base, dtype=np.int64) + noise, 0, 255).astype(np.uint8))


def image_inputs(ckpt: Path) -> list:
    """The family processor's `ImageInput`s of one large image, as the engine would build them."""
    from vlm_sdk.config import EngineArgs
    from vlm_sdk.model_loader import load_tokenizer, read_checkpoint
    from vlm_sdk.models.registry import resolve

    info = read_checkpoint(ckpt)
    family = resolve([info.architecture])
    ip = family.image_processor_cls.from_preprocessor_config(info.preprocessor, info.hf_config)
    processor = family.make_processor(load_tokenizer(ckpt), ip, info.hf_config, EngineArgs())
    conv = [{"role": "user", "content": [{"type": "image", "image": _image(*IMAGE_SIZE)},
                                         {"type": "text", "text": "Describe it."}]}]
    return processor(conv).images


def time_vision(tp: TPGroup, ckpt: Path, shard_vision: bool, images: list, reps: int) -> dict:
    """On one rank: build and load the model (float32, lazily under TP), then time `encode_images`."""
    from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
    from vlm_sdk.models.registry import resolve

    info = read_checkpoint(ckpt)
    model = resolve([info.architecture]).model_cls(info.hf_config, dtype=torch.float32, device="cpu",
                                                   parallel=ParallelGroups(tp),
                                                   shard_vision=shard_vision)
    model.load_weights(iter_safetensors(ckpt, show_progress=False, lazy=tp.size > 1), source=ckpt)
    groups = model.parameter_groups()
    vision_bytes = sum(p.numel() * p.element_size() for part in ("vision", "projector") for p in groups[part])
    times = []
    with torch.inference_mode():
        rows = model.encode_images(images)  # warm-up
        for _ in range(reps):
            start = time.perf_counter()
            model.encode_images(images)
            times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "vision_bytes": vision_bytes, "rows": list(rows.shape),
            "threads": torch.get_num_threads()}


def measure(family: str, ckpt: Path, reps: int, rounds: int) -> dict:
    images = image_inputs(ckpt)
    out = {"family": family, "image": list(IMAGE_SIZE), "vision_rows": sum(im.size for im in images),
           "image_tokens": sum(im.num_tokens for im in images), "modes": {}}
    runs: dict[str, list[list[dict]]] = {key: [] for key, *_ in MODES}
    for _ in range(rounds):  # interleaved, so that a busy spell of the machine hits every mode alike
        for key, _, ranks, shard, threads in MODES:
            runs[key].append(run_on_ranks(time_vision, ranks, ckpt, shard, images, reps, timeout_s=1200,
                                          threads_per_rank=threads, spawn_one=True))
    for key, label, *_ in MODES:
        seconds = [max(r["seconds"] for r in ranks) for ranks in runs[key]]  # the slowest rank, per round
        first = runs[key][0][0]
        out["modes"][key] = {"label": label, "seconds": statistics.median(seconds), "rounds": seconds,
                             "vision_bytes": first["vision_bytes"], "threads": first["threads"]}
    base = out["modes"]["tp1"]["seconds"]
    for m in out["modes"].values():
        m["ratio_to_tp1"] = m["seconds"] / base
    return out


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def report(results: list[dict]) -> str:
    lines = [f"{'family':<11} {'mode':<16} {'threads/rank':>12} {'vision+proj/rank':>17} "
             f"{'encode_images (median, range)':>30} {'vs tp=1':>8}"]
    for r in results:
        for i, m in enumerate(r["modes"].values()):
            lo, hi = min(m["rounds"]), max(m["rounds"])
            timing = f"{m['seconds'] * 1e3:.0f} ms ({lo * 1e3:.0f}-{hi * 1e3:.0f})"
            lines.append(f"{r['family'] if i == 0 else '':<11} {m['label']:<16} {m['threads']:>12} "
                         f"{_mb(m['vision_bytes']):>17} {timing:>30} {m['ratio_to_tp1']:>8.2f}")
        lines.append(f"{'':<11} one {r['image'][0]}x{r['image'][1]} image: {r['vision_rows']} vision input rows, "
                     f"{r['image_tokens']} image tokens")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlm_sdk.bench.tp_vision", description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=registry.family_names(), action="append", help="default: all")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per run (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every mode, interleaved")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to build (or find) the benchmark checkpoints; default a temporary directory")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vlm_tp_vision_") as tmp:
        root = args.dir or Path(tmp)
        results = []
        for family in args.family or registry.family_names():
            ckpt = root / f"bench_{family}"
            if not (ckpt / "config.json").is_file():
                make_bench_checkpoint(ckpt, family=family)
            results.append(measure(family, ckpt, args.reps, args.rounds))
    print(report(results))
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
