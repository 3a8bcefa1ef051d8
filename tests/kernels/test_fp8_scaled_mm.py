"""fp8_scaled_mm (W8A8 through torch._scaled_mm, compressed-tensors' per-channel FP8 with dynamic per-token
activations) against its reference, on the CPU (torch runs _scaled_mm there too) and on CUDA sm_90 with
-m cuda (sm_90); the per-token quantization against its definition; where it is supported."""
from __future__ import annotations

import pytest
import torch

from tolerance import assert_reduction_close
from vlm_sdk.kernels.fp8_scaled_mm import fp8_scaled_mm, fp8_scaled_mm_ref, quantize_per_token, supported
from vlm_sdk.testing.quantizer import quantize_fp8_channel

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs CUDA sm_90")])]


def test_per_token_quantization():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1.0, -896.0]])
    q, s = quantize_per_token(x)
    assert s[:, 0].tolist() == pytest.approx([2 / 448, 1e-12, 896 / 448])
    assert q[0].float().tolist() == [224.0, -448.0, 112.0] and (q[1].float() == 0).all()
    assert q[2].float().tolist() == [144.0, 0.5, -448.0]  # 150 rounds to 144 (e4m3: 16 apart above 128)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_scaled_mm_matches_reference(device, dtype):
    g = torch.Generator().manual_seed(1)
    n, k = 48, 96
    t = quantize_fp8_channel(torch.randn(n, k, generator=g))
    weight, scale = t["weight"].to(device), t["weight_scale"].to(device)
    x = torch.randn(5, k, generator=g).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype)
    got = fp8_scaled_mm(x, weight, scale, bias)
    ref = fp8_scaled_mm_ref(x, weight, scale, bias)
    assert got.dtype == dtype and got.shape == (5, n)
    # the same exact products of e4m3 values summed in another order, one rounding to the dtype; the
    # bias added before (torch) or after (here) the scaling: one more rounding at most
    assert_reduction_close(got.float(), ref.float(), k + 1, storage=dtype, roundings=2)
    # and the W8A8 product is near the float one: per-token e4m3 costs a relative ~2**-4 per value
    w = weight.float() * scale.float()
    exact = x.float() @ w.t() + bias.float()
    assert (got.float() - exact).abs().max() < 0.1 * exact.abs().max()


def test_supported_only_on_sm90_and_aligned_sizes(monkeypatch):
    assert not supported(torch.device("cpu"), 64, 64)
    for capability in ((8, 0), (8, 9), (10, 0), (12, 0)):  # no row-wise scaled FP8 product in torch there
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        assert not supported(torch.device("cuda"), 64, 64), capability
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert supported(torch.device("cuda"), 64, 64) and not supported(torch.device("cuda"), 64, 72 + 1)
