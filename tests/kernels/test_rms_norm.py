"""rms_norm (Triton, with and without the fused residual add) against rms_norm_ref, and the reference
against a float64 formula and the torch backend's HF RMSNorm."""
from __future__ import annotations

import os

import pytest
import torch

from tolerance import assert_reduction_close
from vlm_sdk.kernels.rms_norm import rms_norm, rms_norm_ref

from vlm_sdk.kernels.rms_norm_torch import rms_norm as backend_rms_norm  # the torch backend's RMSNorm

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# fp16 on the CPU: the interpreter's stand-in for bf16 (numpy has no bf16, and the interpreter
# computes bf16 wrongly), so the half-precision rounding paths run in the suite
CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.float16, id="cpu-fp16")] + [
    pytest.param("cuda", dt, marks=CUDA_MARKS, id=f"cuda-{str(dt)[6:]}")
    for dt in (torch.bfloat16, torch.float16, torch.float32)]


def close(got: torch.Tensor, want: torch.Tensor, num_cols: int) -> None:
    """A sum of squares over the row in another order (tests/tolerance.py); the normalised row rounded to
    the dtype, then scaled by the weight and rounded again: two roundings whatever the width."""
    assert_reduction_close(got, want, num_cols, roundings=2)
EPS = 1e-6


def need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def strided_rows(n: int, c: int, dtype, device, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """[n, c] rows of a wider buffer: row stride c + 40, starting 3 columns in."""
    base = torch.randn(n, c + 40, generator=g) * scale
    return base.to(device, dtype)[:, 3:3 + c]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_cols", [80, 1000, 4096])
@pytest.mark.parametrize("num_rows", [1, 7])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_ref(device, dtype, num_cols, num_rows, with_residual):
    need_triton(device)
    g = torch.Generator().manual_seed(num_cols * 10 + num_rows + 100 * with_residual)
    x = strided_rows(num_rows, num_cols, dtype, device, g, scale=3.0)
    residual = strided_rows(num_rows, num_cols, dtype, device, g) if with_residual else None
    weight = (1 + 0.2 * torch.randn(num_cols, generator=g)).to(device, dtype)
    x_before = x.clone()
    out = torch.full((num_rows, num_cols), float("nan"), dtype=dtype, device=device)
    res_out = torch.full_like(out, float("nan")) if with_residual else None
    got = rms_norm(x, weight, EPS, residual=residual, out=out, residual_out=res_out)
    want = rms_norm_ref(x, weight, EPS, residual=residual)
    if with_residual:
        assert got[0] is out and got[1] is res_out
        torch.testing.assert_close(res_out, want[1], atol=0, rtol=0)  # one rounding of an fp32 sum: exact
        close(out, want[0], num_cols)
    else:
        assert got is out
        close(out, want, num_cols)
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("device,dtype", CASES)
def test_rms_norm_allocates_and_updates_residual_in_place(device, dtype):
    need_triton(device)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 80, generator=g).to(device, dtype)
    residual = torch.randn(5, 80, generator=g).to(device, dtype)
    weight = torch.randn(80, generator=g).to(device, dtype)
    want, want_sum = rms_norm_ref(x, weight, EPS, residual=residual)
    out, s = rms_norm(x, weight, EPS, residual=residual, residual_out=residual)  # the decoder's in-place stream
    assert s is residual
    torch.testing.assert_close(s, want_sum, atol=0, rtol=0)
    close(out, want, 80)
    plain = rms_norm(x, weight, EPS)
    assert plain.shape == (5, 80) and plain.dtype == dtype
    close(plain, rms_norm_ref(x, weight, EPS), 80)
    assert rms_norm(x[:0], weight, EPS).shape == (0, 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_formula_and_backend(dtype):
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(6, 1000, generator=g) * 4).to(dtype)
    residual = torch.randn(6, 1000, generator=g).to(dtype)
    weight = torch.randn(1000, generator=g).to(dtype)
    xd = x.double()
    normed = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    want = normed.double() * weight.double()
    assert_reduction_close(rms_norm_ref(x, weight, EPS).double(), want, 1000, storage=dtype, roundings=2)
    # HF semantics as the torch backend implements them (both round the normalised row to x.dtype)
    close(rms_norm_ref(x, weight, EPS), backend_rms_norm(x, weight, EPS), 1000)
    out, s = rms_norm_ref(x, weight, EPS, residual=residual)
    assert torch.equal(s, x + residual)
    close(out, backend_rms_norm(x + residual, weight, EPS), 1000)


def test_rms_norm_rejects_bad_inputs():
    x, w = torch.zeros(3, 80), torch.zeros(80)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:40], EPS)
    with pytest.raises(ValueError, match="x must be"):
        rms_norm(x[None], w, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.zeros(80, 3).t(), w, EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, EPS, residual=torch.zeros(3, 40))
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, w, EPS, out=torch.zeros(3, 80, dtype=torch.float64))
    with pytest.raises(ValueError, match="residual_out"):
        rms_norm(x, w, EPS, residual_out=torch.zeros(3, 80))
