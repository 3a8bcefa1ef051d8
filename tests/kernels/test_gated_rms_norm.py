"""Gated DeltaNet's output norm: the torch set's op and the Triton op (kernels/gated_rms_norm.py, under the
interpreter in fp32 and fp16) against transformers' `Qwen3_5RMSNormGated`; the zero-centred RMSNorm
(Qwen3.5's `Qwen3_5RMSNorm`) of the torch set against transformers', the Triton one against it."""
from __future__ import annotations

import os

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from tolerance import assert_reduction_close
from vlm_sdk.kernels.rms_norm_torch import gated_rms_norm, rms_norm_zero_centered

EPS = 1e-6


def _rows(n: int, d: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, d + 16, generator=g) * 3).to(dtype)[:, 5:5 + d]  # strided rows
    z = torch.randn(n, d, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    return x, z, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_gated_norm_equals_transformers(dtype):
    x, z, w = _rows(37, 128, dtype, seed=1)
    hf = Qwen3_5RMSNormGated(128, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        want = hf(x, z)
    # the sum of squares in another order; then transformers' roundings, which ours repeats
    assert_reduction_close(gated_rms_norm(x, z, w, EPS), want, 128, roundings=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_zero_centered_norm_equals_transformers(dtype):
    x, _, w = _rows(9, 256, dtype, seed=2)
    hf = Qwen3_5RMSNorm(256, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w - 1)
        want = hf(x)
    assert_reduction_close(rms_norm_zero_centered(x, hf.weight, EPS), want, 256, roundings=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_gated_norm_equals_the_torch_op(dtype):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    from vlm_sdk.kernels.gated_rms_norm import gated_rms_norm as triton_gated
    for n, d in ((37, 128), (3, 80)):
        x, z, w = _rows(n, d, dtype, seed=n)
        hf = Qwen3_5RMSNormGated(d, eps=EPS).to(dtype)
        with torch.no_grad():
            hf.weight.copy_(w)
            want = hf(x, z)
        assert_reduction_close(triton_gated(x, z, w, EPS), want, d, roundings=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_zero_centered_norm_equals_the_torch_op(dtype, with_residual):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    from vlm_sdk.kernels.rms_norm import rms_norm
    x, r, w = _rows(7, 256, dtype, seed=3)
    got = rms_norm(x, w, EPS, residual=r if with_residual else None, zero_centered=True)
    s = (x.float() + r.float()).to(dtype) if with_residual else x
    want = rms_norm_zero_centered(s, w, EPS)
    if with_residual:
        torch.testing.assert_close(got[1], s, rtol=0, atol=0)
        got = got[0]
    assert_reduction_close(got, want, 256, roundings=1)
