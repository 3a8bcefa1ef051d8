"""silu_and_mul (Triton) against silu_and_mul_ref, and the reference against a float64 formula."""
from __future__ import annotations

import os

import pytest
import torch

from vlm_sdk.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# fp16 on the CPU: the interpreter's stand-in for bf16 (numpy has no bf16, and the interpreter
# computes bf16 wrongly), so the half-precision rounding paths run in the suite
CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.float16, id="cpu-fp16")] + [
    pytest.param("cuda", dt, marks=CUDA_MARKS, id=f"cuda-{str(dt)[6:]}")
    for dt in (torch.bfloat16, torch.float16, torch.float32)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("inter", [1, 37, 1500])  # odd; 1500 spans two column blocks, the second partial
@pytest.mark.parametrize("num_rows", [1, 9])
def test_silu_and_mul_matches_ref(device, dtype, inter, num_rows):
    need_triton(device)
    g = torch.Generator().manual_seed(inter * 10 + num_rows)
    base = (torch.randn(num_rows, 2 * inter + 24, generator=g) * 4).to(device, dtype)
    x = base[:, 5:5 + 2 * inter]  # strided rows
    x_before = x.clone()
    out = torch.full((num_rows, inter), float("nan"), dtype=dtype, device=device)
    assert silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(x, x_before)
    fresh = silu_and_mul(x)
    assert fresh.shape == (num_rows, inter) and fresh.dtype == dtype
    torch.testing.assert_close(fresh, out, atol=0, rtol=0)


def test_ref_matches_formula():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 2 * 99, generator=g) * 6
    gate, up = x.double()[:, :99], x.double()[:, 99:]
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul_ref(x).double(), want, atol=1e-5, rtol=1e-5)
    out = torch.full((5, 99), float("nan"))
    assert silu_and_mul_ref(x, out=out) is out and not out.isnan().any()
    assert silu_and_mul(x[:0]).shape == (0, 99)


def test_silu_and_mul_rejects_bad_inputs():
    with pytest.raises(ValueError, match="2 \\* I"):
        silu_and_mul(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="out"):
        silu_and_mul(torch.zeros(3, 8), out=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="contiguous"):
        silu_and_mul(torch.zeros(8, 3).t())
    with pytest.raises(ValueError, match="dtype"):
        silu_and_mul(torch.zeros(3, 8, dtype=torch.float64))
