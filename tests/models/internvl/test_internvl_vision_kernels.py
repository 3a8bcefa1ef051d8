"""InternViT's RMSNorm variant (InternViT-6B: rms_norm blocks and q/k norms over the full hidden size)
through the kernel set: the Triton set (the interpreter on the CPU) equals the torch set, and every
RMSNorm goes through the set's `rms_norm`. What else there is has no kernel of the set (LayerNorm,
ungated GELU, the layer scale before each residual add, no RoPE)."""
from __future__ import annotations

import os

import pytest
import torch

from vlm_sdk.layers.ops import make_ops
from vlm_sdk.models.internvl.vision import InternVisionConfig, InternVLVisionTower


def config(norm_type: str) -> InternVisionConfig:
    return InternVisionConfig(
        layout="original", hidden_size=32, num_heads=4, intermediate_size=64, num_layers=2, layers_used=2,
        norm_type=norm_type, norm_eps=1e-6, qkv_bias=False, qk_norm=True, qk_norm_eps=1e-6, image_size=16,
        patch_size=4, hidden_act="gelu", final_norm=False, final_norm_used=False, downsample_ratio=0.5,
        text_hidden_size=24, projector_act="gelu", tile_size=16)


def tower(backend: str, norm_type: str, dtype=torch.float32) -> InternVLVisionTower:
    t = InternVLVisionTower(config(norm_type), dtype=dtype, ops=make_ops(backend, torch.device("cpu")))
    g = torch.Generator().manual_seed(0)
    for name, p in sorted(t.named_parameters()):  # random weights, the same for every tower
        p.copy_((1 + 0.2 * torch.randn(p.shape, generator=g)) if name.endswith("norm.weight") or ".norm" in name
                else 0.3 * torch.randn(p.shape, generator=g))
    return t.eval()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)], ids=["fp32", "fp16"])
def test_rms_norm_tower_on_the_triton_set_equals_the_torch_set(dtype, tol):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    ref, ours = tower("torch", "rms_norm", dtype), tower("triton", "rms_norm", dtype)
    calls = []
    real = ours.layers[0].norm1.ops.rms_norm
    ours.layers[0].norm1.ops.rms_norm = lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        want, got = ref(pixels), ours(pixels)
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)
    # per layer norm1, q_norm, k_norm, norm2, over all [tiles * (1 + 16)] rows
    assert len(calls) == 4 * 2 and all(shape[0] == 2 * 17 for shape in calls)
