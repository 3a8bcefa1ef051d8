"""The random-weight checkpoint that `vlm-sdk chat`, `serve`, the benches and the samples use when no
model is given: built once under `$VLM_SDK_CACHE` (default `~/.cache/vlm_sdk`) with
`vlm_sdk.testing`, then reused."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("VLM_SDK_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vlm_sdk")
    return Path(root)


def tiny_model_dir(kind: str = "tiny", family: str | None = None) -> Path:
    """The random-weight checkpoint used when no model is given ("tiny", or "bench" ~100M), made once.
    `family` defaults to the first registered one. Built in a temporary directory and renamed into place,
    so a half-written one is never used."""
    from vlm_sdk.models import registry
    from vlm_sdk.testing import make_bench_checkpoint, make_tiny_checkpoint
    family = family or registry.family_names()[0]
    path = cache_dir() / f"{kind}-{family}"
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        (make_bench_checkpoint if kind == "bench" else make_tiny_checkpoint)(tmp, family=family)
        tmp.rename(path)
    return path
