"""Shared fixtures: tiny Qwen2.5-VL checkpoints with random weights, built once per test session."""
from __future__ import annotations

from pathlib import Path

import pytest

from vlm_sdk.testing import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """Default tiny checkpoint: transformers 5 layout, one safetensors file, float32."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))


@pytest.fixture(scope="session")
def tiny_ckpt_flat(tmp_path_factory) -> Path:
    """Same weights (same seed) in the published layout: flat config.json with rope_scaling mrope,
    min_pixels/max_pixels preprocessor config, safetensors sharded into several files + index.json."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt_flat"), config_layout="flat",
                                preprocessor_layout="flat", max_shard_size="200KB")
