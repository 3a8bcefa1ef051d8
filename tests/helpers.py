"""Shared test data: deterministic images and the four conversations the parity tests use."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
from PIL import Image

TESTS = Path(__file__).resolve().parent  # tests/ (test modules sit in folders below it, by layer)
REPO = TESTS.parent
SAMPLE_IMAGE = REPO / "samples" / "shapes.png"


def image(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth colour blobs plus noise, so resizing and patches are exercised."""
    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)).resize((width, height),
                                                                                         Image.BICUBIC)
    noise = rng.integers(-25, 25, size=(height, width, 3))
    return Image.fromarray(np.clip(np.asarray(base, dtype=np.int64) + noise, 0, 255).astype(np.uint8))


def conversations() -> dict[str, list[dict]]:
    a, b, c = image(300, 200, 1), image(120, 260, 2), image(200, 200, 3)
    return {
        "text": [{"role": "user", "content": "Tell me a short story about the sea."}],
        "one_image": [{"role": "user", "content": [
            {"type": "image", "image": a}, {"type": "text", "text": "What is in this image?"}]}],
        "two_images": [{"role": "system", "content": "You compare pictures."},
                       {"role": "user", "content": [
                           {"type": "text", "text": "Compare"}, {"type": "image", "image": b},
                           {"type": "text", "text": "with"}, {"type": "image", "image": c}]}],
        "multi_turn": [{"role": "user", "content": [
                           {"type": "image", "image": c}, {"type": "text", "text": "Describe it."}]},
                       {"role": "assistant", "content": "A colourful square."},
                       {"role": "user", "content": "Which colour is most common?"}],
    }


def internvl_conversations() -> dict[str, list[dict]]:
    """Several tiles per image, kept short with per-image max_num (transformers gets it as max_patches)."""
    a, b, c = image(400, 200, 1), image(120, 260, 2), image(200, 200, 3)
    return {
        "text": [{"role": "user", "content": "Tell me a short story about the sea."}],
        "one_image": [{"role": "user", "content": [  # 2x1 grid (1 row, 2 cols) + thumbnail = 3 tiles
            {"type": "image", "image": a, "max_num": 2}, {"type": "text", "text": "What is in this image?"}]}],
        "two_images": [{"role": "system", "content": "You compare pictures."},
                       {"role": "user", "content": [
                           {"type": "text", "text": "Compare"}, {"type": "image", "image": b, "max_num": 2},
                           {"type": "text", "text": "with"}, {"type": "image", "image": c, "max_num": 1}]}],
    }


def start_server(cmd: list[str], timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """Run a server command (its own process group, killed with it on failure) until it prints the URL
    it serves at; (process, "http://127.0.0.1:PORT")."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        match = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        if match:
            return proc, match.group(1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"server did not start: {proc.stderr.read()[-3000:]}")


def plan_cache(args, per_block, device, max_position_embeddings, peak, image_setting=None, weights=15 * 2**30):
    """The engine's CUDA sizing of one rank (vlm_sdk/memory/startup.py `size_rank_caches`): the budget from the
    device's total and in-use bytes (torch.cuda.mem_get_info, mocked here) minus the activation peak and the
    encoder cache, sized and checked by vlm_sdk/memory/kv.py; `weights`: this engine's own weights."""
    import torch
    from vlm_sdk.memory.kv import DeviceBudget, check_cache, size_cache
    free, total = torch.cuda.mem_get_info(device)
    budget = DeviceBudget(total, total - free, peak or 0, args.encoder_cache_memory)
    cache = size_cache(args, per_block, max_position_embeddings, budget)
    check_cache(cache, args, weights, image_setting)
    return cache


def process_table() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every process (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # ended meanwhile
            continue
        out.append((int(stat.parent.name), int(fields[1]), int(fields[2])))
    return out


def process_alive(pid: int) -> bool:
    """Whether process `pid` still runs (Linux /proc): a zombie has ended, only its parent has not reaped it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def full_attention_cache(num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
    """The engine's cache coordinator over one full-attention group (every existing family's layout)."""
    from vlm_sdk.engine.core.cache_coordinator import CacheCoordinator
    from vlm_sdk.protocol.cache_layout import CacheLayout
    from vlm_sdk.protocol.cache_spec import AttentionSpec
    return CacheCoordinator(CacheLayout.uniform(2, AttentionSpec(1, 4, "float32")), num_blocks, block_size,
                            enable_prefix_caching)


def chunk_budget(llm, smallest: int = 13) -> int:
    """The step budget the tests chunk prefill with: `smallest` tokens, or one image's for a family that
    computes each image in one chunk (`FamilySpec.whole_images`: its engine refuses a smaller budget)."""
    engine = llm.engine
    if not engine.cache.whole_images:
        return smallest
    return max(smallest, engine.inputs.processor.largest_image().num_tokens)
