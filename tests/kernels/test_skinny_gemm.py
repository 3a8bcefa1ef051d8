"""skinny_gemm (Triton, a few rows times a weight) against its torch reference: float32 and float16
under the interpreter (bfloat16 on a GPU), odd sizes, a bias, the CPU's transposed weight storage."""
from __future__ import annotations

import os

import pytest
import torch

from tolerance import assert_reduction_close
from vlm_sdk.kernels.skinny_gemm import MAX_M, block_n, skinny_gemm, skinny_gemm_ref

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.float16, id="cpu-fp16")] + [
    pytest.param("cuda", dt, marks=CUDA_MARKS, id=f"cuda-{str(dt)[6:]}") for dt in (torch.bfloat16, torch.float32)]


def need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 33, 1100), (8, 70, 520), (5, 16, 512)])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("layout", ["row", "transposed"])
def test_skinny_gemm_matches_reference(device, dtype, m, n, k, bias, layout):
    need_triton(device)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = torch.randn(n, k, generator=g).to(device, dtype)
    if layout == "transposed":  # storage [K, N], logical [N, K] (models/cpu_layout.py)
        w = w.t().contiguous().t()
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)  # every element must be written
    got = skinny_gemm(x, w, b, out=out)
    ref = skinny_gemm_ref(x, w, b)
    assert got is out and not got.isnan().any()
    # K products summed in another order, then one rounding to the dtype (tests/tolerance.py)
    assert_reduction_close(got.float(), ref.float(), k, storage=dtype, roundings=1)


def test_rows_past_max_m_and_bad_shapes_are_refused():
    x, w = torch.randn(MAX_M + 1, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match=f"at most {MAX_M} rows"):
        skinny_gemm(x, w)
    with pytest.raises(ValueError, match="x must be"):
        skinny_gemm(torch.randn(2, 7), w)
    with pytest.raises(ValueError, match="b must be"):
        skinny_gemm(torch.randn(2, 8), w, torch.randn(5))
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_gemm(torch.randn(2, 8), w.half())


def test_block_n_gives_programs_enough_for_the_gpu(monkeypatch):
    from types import SimpleNamespace
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda")
    for n in (2048, 2560, 3584, 4608, 22016, 151936):
        bn = block_n(n, cuda)
        assert 2 <= bn <= 64 and bn & (bn - 1) == 0
        assert -(-n // bn) >= min(4 * 132, n // 2)  # about 4 programs per SM, or every pair of rows
    assert block_n(2560, cuda) == 4 and block_n(2048, cuda) == 2
