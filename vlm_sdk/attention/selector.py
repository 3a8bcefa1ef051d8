"""Choosing the attention backend of an engine (`attention_backend`: "torch" | "triton").

The Triton kernels are imported when `TritonBackend` is chosen, so TRITON_INTERPRET is read then, not
when vlm_sdk is imported."""
from __future__ import annotations

import os

import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.errors import InvalidRequestError

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

