"""Choosing the attention backend of an engine (`attention_backend`: "torch" | "triton").

The Triton kernels are imported when `TritonBackend` is chosen, so TRITON_INTERPRET is read then, not
when vlm_sdk is imported."""
from __future__ import annotations

import os

import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.protocol.cache_layout import CacheLayout

ATTENTION_BACKENDS = ("torch", "triton")


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "torch"


def make_backend(backend: str | None, device: torch.device) -> AttentionBackend:
    """The attention backend for `attention_backend` on `device` (None: Triton on CUDA, torch
    elsewhere). Raises `InvalidRequestError` naming the setting when Triton cannot run there."""
    backend = backend or default_backend(device)
    if backend == "torch":
        from vlm_sdk.attention.torch_backend import TorchBackend
        return TorchBackend()
    if backend != "triton":
        raise InvalidRequestError(f"attention_backend={backend!r} is not one of {list(ATTENTION_BACKENDS)}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidRequestError(
            "attention_backend='triton' on the CPU needs the Triton interpreter: set TRITON_INTERPRET=1 in the "
            "environment before starting (slow; for testing the kernels), or use attention_backend='torch'")
    try:
        from vlm_sdk.attention.triton_backend import TritonBackend
        return TritonBackend()
    except ImportError as e:
        raise InvalidRequestError(f"attention_backend='triton' needs the triton package ({e}); install triton "
                                  f"or use attention_backend='torch'") from e


def check_layers(backend: str, layout: CacheLayout) -> None:
    """Refuse, before any cache is allocated, a model whose layers the chosen backend has no kernels for:
    the Triton set has no sliding-window attention yet (issue 44)."""
    windows = sorted({g.spec.window for g in layout.attention_groups if g.spec.window is not None})
    if backend == "triton" and windows:
        layers = [i for g in layout.attention_groups if g.spec.window is not None for i in g.layers]
        raise InvalidRequestError(
            f"attention_backend='triton' has no sliding-window kernels yet, and this model's layers "
            f"{layers[:8]}{'...' if len(layers) > 8 else ''} attend within a window of {windows} tokens: use "
            f"attention_backend='torch' (--attention-backend torch)", param="attention_backend")
