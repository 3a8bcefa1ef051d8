"""Test fixtures: tiny Hugging Face checkpoints with random weights (tests and benchmarks run without a
model hub) and, in `vlm_sdk.testing.reference`, transformers as the oracle.

Each family builds its own checkpoint (`FamilyFixtures.make_tiny_checkpoint`, in
`models/<family>/fixtures.py`); these dispatch through vlm_sdk/testing/families.py. transformers loads every
directory written here, and its model on the same directory is the correctness oracle.
"""
from __future__ import annotations

from pathlib import Path

from vlm_sdk.models import registry
from vlm_sdk.testing.families import fixtures

__all__ = ["make_tiny_checkpoint", "make_bench_checkpoint", "fixtures", "SUPPORTED_FAMILIES"]

SUPPORTED_FAMILIES = registry.family_names()


def make_tiny_checkpoint(path, family: str = SUPPORTED_FAMILIES[0], seed: int = 0, **overrides) -> Path:
    """Write a complete HF-format checkpoint of `family` (a registered family name, default the first:
    Qwen2.5-VL) with random
    weights to `path` and return it. Same arguments give byte-identical files; the overrides are the
    family builder's (`models/<family>/tiny_checkpoint.py`; an unknown one raises TypeError)."""
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"unknown family {family!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}")
    return fixtures(family).make_tiny_checkpoint(Path(path), seed, **overrides)


def make_bench_checkpoint(path, seed: int = 0, *, family: str = SUPPORTED_FAMILIES[0], **overrides) -> Path:
    """A ~100M-parameter random checkpoint of `family` for benchmarks (bfloat16 weights)."""
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"unknown family {family!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}")
    return fixtures(family).make_bench_checkpoint(Path(path), seed, **overrides)
