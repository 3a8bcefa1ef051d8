"""The vision towers' 2-D RoPE through the Triton rotary kernel (in place on the q and k heads of a packed
qkv) against transformers' Qwen2.5-VL vision rotary (`Qwen2_5_VLVisionRotaryEmbedding` +
`apply_rotary_pos_emb_vision`, float32 math), and the torch kernel set's rotation of the same inputs:
head_dim 80 (Qwen2.5-VL's ViT) and 72 (Qwen3-VL's), float32 and float16 (the interpreter's stand-in
for bfloat16)."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (Qwen2_5_VLVisionRotaryEmbedding,
                                                                apply_rotary_pos_emb_vision)

from vlm_sdk.kernels.rotary import rotary_embedding, rotary_embedding_ref
from vlm_sdk.layers.ops import TorchOps
from vlm_sdk.layers.rotary import VisionRotaryEmbedding

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CASES = [pytest.param("cpu", dt, id=f"cpu-{str(dt)[6:]}") for dt in (torch.float32, torch.float16)] + [
    pytest.param("cuda", dt, marks=CUDA_MARKS, id=f"cuda-{str(dt)[6:]}") for dt in (torch.bfloat16, torch.float16)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
THETA = 10000.0


def need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def hf_rope(head_dim: int, heads: int, positions: torch.Tensor,  # [2, N]: patch row, column
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos, sin `[N, D]` float32 for the patches at `positions`."""
    vc = Qwen2_5_VLConfig(vision_config=dict(hidden_size=head_dim * heads, num_heads=heads)).vision_config
    rope = Qwen2_5_VLVisionRotaryEmbedding(vc)
    cos, sin = rope(torch.zeros(1), positions.t())  # transformers takes position_ids [N, 2]
    assert cos.shape == (positions.shape[1], head_dim)
    return cos, sin


def packed_qkv(n: int, heads: int, head_dim: int, dtype, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3 * heads, head_dim, generator=g).to(device, dtype)  # [N, 3H, D]: q, k, v heads


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("head_dim,heads", [(80, 2), (72, 3)])
@pytest.mark.parametrize("n", [1, 37])
def test_vision_rotary_kernel_matches_transformers(device, dtype, head_dim, heads, n):
    need_triton(device)
    g = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 64, (2, n), generator=g)  # [2, N]
    qkv = packed_qkv(n, heads, head_dim, dtype, device)
    v_before = qkv[:, 2 * heads:].clone()
    cos, sin = hf_rope(head_dim, heads, positions)  # [N, D] float32
    q_ref, k_ref = apply_rotary_pos_emb_vision(qkv[:, :heads].cpu(), qkv[:, heads:2 * heads].cpu(), cos, sin)

    rotary = VisionRotaryEmbedding(head_dim, THETA, device)
    # the tower's positions arrive as the transpose of a [N, 2] table: strided rows
    pos = positions.t().contiguous().t().to(device)  # [2, N], strides (1, 2)
    rotary_embedding(qkv[:, :heads], qkv[:, heads:2 * heads], pos, rotary.inv_freq, rotary.mrope_section)
    tol = TOL[dtype]
    torch.testing.assert_close(qkv[:, :heads].cpu(), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(qkv[:, heads:2 * heads].cpu(), k_ref, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, 2 * heads:], v_before)  # v untouched


@pytest.mark.parametrize("head_dim", [80, 72])
def test_torch_kernel_set_rotates_the_vision_heads_as_transformers(head_dim):
    """The torch set (the CPU reference the towers use): float32 angles rotate in float32 and return
    float32, exactly HF's math, for a float16 qkv too."""
    heads, n = 2, 23
    positions = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(2))
    ops, rotary = TorchOps(), VisionRotaryEmbedding(head_dim, THETA, "cpu")
    rope = ops.rotary_inputs(positions, rotary, torch.float32)
    cos, sin = hf_rope(head_dim, heads, positions)
    for dtype in (torch.float32, torch.float16):
        qkv = packed_qkv(n, heads, head_dim, dtype, "cpu")
        q_ref, k_ref = apply_rotary_pos_emb_vision(qkv[:, :heads], qkv[:, heads:2 * heads], cos, sin)
        out = ops.rotary(qkv[:, :2 * heads], heads, rope).to(dtype)  # [N, 2H, D]
        assert torch.equal(out[:, :heads], q_ref) and torch.equal(out[:, heads:], k_ref)


def test_ref_and_positions_checks():
    """The reference reads [2, N] positions too; [2, N] is refused where a third row is read."""
    heads, d, n = 2, 80, 9
    positions = torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(3))
    rotary = VisionRotaryEmbedding(d, THETA, "cpu")
    qkv = packed_qkv(n, heads, d, torch.float32, "cpu")
    q_ref, k_ref = apply_rotary_pos_emb_vision(qkv[:, :heads], qkv[:, heads:2 * heads], *hf_rope(d, heads, positions))
    rotary_embedding_ref(qkv[:, :heads], qkv[:, heads:2 * heads], positions, rotary.inv_freq, rotary.mrope_section)
    torch.testing.assert_close(qkv[:, :heads], q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qkv[:, heads:2 * heads], k_ref, atol=1e-6, rtol=1e-6)
    q, k = qkv[:, :heads], qkv[:, heads:2 * heads]
    for section, interleaved in (((10, 15, 15), False), ((14, 13, 13), True)):
        with pytest.raises(ValueError, match="positions"):
            rotary_embedding_ref(q, k, positions, rotary.inv_freq, section, interleaved)
    with pytest.raises(ValueError, match="divisible by 4"):
        VisionRotaryEmbedding(82, THETA, "cpu")
