"""int4_gemm (Triton: AWQ and GPTQ int4 weights dequantized in registers) against its torch reference
(kernels/dequant_torch.py's whole weight, rounded to x's dtype, then F.linear), under the interpreter in
float32 and float16 (bfloat16 on a GPU with -m cuda): both paths (split-K for decode-sized M, tiled
above), the three ways a tile finds its groups (one group per tile, per row, GPTQ's g_idx), a partial
N tile, a bias, group -1 (one group), the zero-point conventions of both GPTQ formats, and compressed-tensors'
W4A16 read through transposed views (symmetric: no zero points; asymmetric with actorder's g_idx)."""
from __future__ import annotations

import os

import pytest
import torch

from tolerance import assert_reduction_close
from vlm_sdk.kernels.int4_gemm import SMALL_M, Config, gpu_config, int4_gemm, int4_gemm_ref
from vlm_sdk.testing.quantizer import quantize_awq, quantize_gptq, quantize_w4a16

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=CUDA_MARKS, id="cuda")]


def _need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def _dtypes(device: str):
    # float16 on the CPU: the interpreter's stand-in for bfloat16 (its bfloat16 tl.dot is wrong)
    return (torch.float32, torch.float16) if device == "cpu" else (torch.bfloat16, torch.float16, torch.float32)


def _weights(fmt: str, n: int, k: int, group: int, seed: int) -> dict:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    if fmt == "awq":
        return dict(quantize_awq(w, group), awq=True)
    if fmt.startswith("w4a16"):  # compressed-tensors' tensors are GPTQ v2's transposed: passed as views
        sym = fmt == "w4a16_sym"
        t = quantize_w4a16(w, group, sym=sym, actorder=not sym, seed=seed)
        zeros = t.get("weight_zero_point")
        return dict(qweight=t["weight_packed"].t(), qzeros=None if zeros is None else zeros.t(),
                    scales=t["weight_scale"].t(), awq=False, g_idx=t.get("weight_g_idx"), zero_offset=8 if sym else 0)
    sym, desc_act, v2 = {"gptq_sym": (True, False, False), "gptq_asym_desc_act": (False, True, False),
                         "gptq_v2": (False, False, True)}[fmt]
    t = quantize_gptq(w, group, sym=sym, desc_act=desc_act, v2=v2, seed=seed)
    return dict(qweight=t["qweight"].contiguous(), qzeros=t["qzeros"].contiguous(), scales=t["scales"], awq=False,
                g_idx=t["g_idx"] if desc_act else None, zero_offset=0 if v2 else 1)


def _close(got, ref, k, dtype):
    # K products summed in another order, then one rounding to the dtype (tests/tolerance.py); the
    # weights are rounded to the dtype identically on both sides
    assert_reduction_close(got.float(), ref.float(), k, storage=dtype, roundings=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["awq", "gptq_sym", "gptq_asym_desc_act", "gptq_v2", "w4a16_sym",
                                 "w4a16_asym_actorder"])
@pytest.mark.parametrize("m", [1, 5, 40], ids=lambda m: f"m{m}")
def test_int4_gemm_matches_reference(device, fmt, m):
    """N 72: a partial 32-wide tile and 9 int32 words of zeros; K 96 over groups of 16 (one per tile is
    impossible at BLOCK_K 32: per row) or 32 (one per tile)."""
    _need_triton(device)
    n, k = 72, 96
    for group in (16, 32):
        t = _weights(fmt, n, k, group, seed=m + group)
        for dtype in _dtypes(device):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
            bias = torch.randn(n).to(device, dtype)
            args = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in t.items()}
            got = int4_gemm(x, **args, group=group, bias=bias)
            ref = int4_gemm_ref(x, **args, group=group, bias=bias)
            assert got.shape == (m, n) and got.dtype == dtype
            _close(got, ref, k, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_and_tiled_paths_agree(device):
    """The same product through every split count and through the tiled path: only the order of the K
    sums changes."""
    _need_triton(device)
    n, k, group = 64, 256, 32
    t = _weights("awq", n, k, group, seed=3)
    args = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in t.items()}
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).to(device)
    ref = int4_gemm_ref(x, **args, group=group)
    for split in (1, 2, 4, 8):
        _close(int4_gemm(x, **args, group=group, config=Config(16, 32, 32, split, 4, 1)), ref, k, torch.float32)
    _close(int4_gemm(x, **args, group=group, config=Config(32, 32, 32, 1, 4, 1)), ref, k, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_one_group_over_the_whole_input(device):
    """group_size -1 (GPTQ): one scale row for all K inputs; K 80 is no multiple of BLOCK_K."""
    _need_triton(device)
    n, k = 32, 80
    t = _weights("gptq_sym", n, k, -1, seed=5)
    args = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in t.items()}
    assert args["scales"].shape == (1, n)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2)).to(device)
    _close(int4_gemm(x, **args, group=k), int4_gemm_ref(x, **args, group=k), k, torch.float32)


def test_reference_is_the_dequantized_product():
    """The reference is F.linear over kernels/dequant_torch.py's weight (whose layouts
    tests/kernels/test_dequant_torch.py checks element by element)."""
    from vlm_sdk.kernels.dequant_torch import dequantize_awq, dequantize_gptq
    t = _weights("awq", 16, 32, 16, 0)
    x = torch.randn(2, 32)
    w = dequantize_awq(t["qweight"], t["qzeros"], t["scales"])
    assert torch.equal(int4_gemm_ref(x, t["qweight"], t["qzeros"], t["scales"], awq=True, group=16), x @ w.t())
    g = _weights("gptq_asym_desc_act", 16, 32, 16, 0)
    w = dequantize_gptq(g["qweight"], g["qzeros"], g["scales"], g["g_idx"], 1)
    got = int4_gemm_ref(x, g["qweight"], g["qzeros"], g["scales"], awq=False, group=16, g_idx=g["g_idx"],
                        zero_offset=1)
    torch.testing.assert_close(got, x @ w.t(), rtol=0, atol=0)


def test_gpu_config_paths_and_splits():
    """On an H100 (132 SMs): Qwen2.5-VL-7B's qkv at batch 1 is 72 tiles of 64 columns, split 8 ways to
    576 programs; its gate_up (37,888 columns) is 592 tiles, no split; prefill takes 64 x 128 tiles."""
    decode = gpu_config(1, 4608, 3584, 128, 132)
    assert (decode.block_m, decode.block_n, decode.split) == (16, 64, 8) and 128 % decode.block_k == 0
    assert gpu_config(1, 37888, 3584, 128, 132).split == 1
    assert gpu_config(SMALL_M, 3584, 18944, 128, 132).split == 8  # down_proj: 56 tiles
    prefill = gpu_config(SMALL_M + 1, 4608, 3584, 128, 132)
    assert (prefill.block_m, prefill.block_n, prefill.split) == (64, 128, 1)


def test_bad_inputs_are_refused():
    t = _weights("awq", 16, 32, 16, 0)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="does not hold K"):
        int4_gemm(torch.randn(2, 40), t["qweight"], t["qzeros"], t["scales"], awq=True, group=16)
    with pytest.raises(ValueError, match="bias"):
        int4_gemm(x, t["qweight"], t["qzeros"], t["scales"], awq=True, group=16, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="int32"):
        int4_gemm(x, t["qweight"].float(), t["qzeros"], t["scales"], awq=True, group=16)
    with pytest.raises(ValueError, match="do not cover"):
        int4_gemm(x, t["qweight"], t["qzeros"], t["scales"], awq=True, group=8)
