"""fp8_block_gemm (Triton: block-wise FP8 weights dequantized in registers) against its torch reference
(kernels/dequant_torch.py's whole weight rounded to x's dtype, then F.linear), under the interpreter in
float32 and float16 (bfloat16 on a GPU with -m cuda): the split-K and tiled paths, partial last scale
blocks along N and K (the published 128 x 128 blocks over sizes that are not multiples), a bias, and both
ways of reading e4m3 (Triton's conversion, as on sm_89+, and from the bits, as on sm_80)."""
from __future__ import annotations

import os

import pytest
import torch

from tolerance import assert_reduction_close
from vlm_sdk.kernels.fp8_block_gemm import Config, fp8_block_gemm, fp8_block_gemm_ref, gpu_config
from vlm_sdk.testing.quantizer import quantize_fp8_block

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=CUDA_MARKS, id="cuda")]


def _need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def _dtypes(device: str):
    return (torch.float32, torch.float16) if device == "cpu" else (torch.bfloat16, torch.float16, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 6, 40], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("block", [(16, 16), (32, 32)], ids=["16x16", "32x32"])
def test_fp8_block_gemm_matches_reference(device, m, block):
    """N 72 and K 80: partial scale blocks along both (ceil division), a partial N tile."""
    _need_triton(device)
    n, k = 72, 80
    g = torch.Generator().manual_seed(m + block[0])
    t = quantize_fp8_block(torch.randn(n, k, generator=g) * 0.3, block)
    weight, scale = t["weight"].to(device), t["weight_scale_inv"].to(device)
    assert scale.shape == (-(-n // block[0]), -(-k // block[1]))
    for dtype in _dtypes(device):
        x = torch.randn(m, k, generator=g).to(device, dtype)
        bias = torch.randn(n, generator=g).to(device, dtype)
        ref = fp8_block_gemm_ref(x, weight, scale, block, bias)
        for hardware in (False, True):
            if hardware and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
                continue
            got = fp8_block_gemm(x, weight, scale, block, bias, fp8_hardware=hardware)
            assert got.shape == (m, n) and got.dtype == dtype
            assert_reduction_close(got.float(), ref.float(), k, storage=dtype, roundings=1,
                                   msg=f"{dtype}, hardware conversion {hardware}")


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_and_tiled_paths_agree(device):
    _need_triton(device)
    n, k, block = 64, 256, (32, 32)
    g = torch.Generator().manual_seed(9)
    t = quantize_fp8_block(torch.randn(n, k, generator=g), block)
    weight, scale = t["weight"].to(device), t["weight_scale_inv"].to(device)
    x = torch.randn(4, k, generator=g).to(device)
    ref = fp8_block_gemm_ref(x, weight, scale, block)
    for config in [Config(16, 32, 32, s, 4, 1) for s in (1, 2, 8)] + [Config(32, 32, 16, 1, 4, 1)]:
        assert_reduction_close(fp8_block_gemm(x, weight, scale, block, config=config), ref, k, torch.float32,
                               roundings=1, msg=str(config))


def test_gpu_config_and_refusals():
    c = gpu_config(1, 4096 + 2 * 1024, 4096, (128, 128), 132)  # Qwen3-VL-8B qkv at batch 1
    assert c.block_m == 16 and c.split > 1 and 128 % c.block_k == 0
    assert gpu_config(512, 4096, 4096, (128, 128), 132).split == 1
    t = quantize_fp8_block(torch.randn(16, 32), (16, 16))
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="weight_scale_inv must be"):
        fp8_block_gemm(x, t["weight"], t["weight_scale_inv"][:, :1], (16, 16))
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        fp8_block_gemm(x, t["weight"].float(), t["weight_scale_inv"], (16, 16))
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_block_gemm(x, t["weight"], torch.ones(2, 4), (8, 8))
