"""rotary_embedding (Triton) against rotary_embedding_ref, and the reference against the decoder's
MRotaryEmbedding + apply_rotary and a naive per-frequency formula."""
from __future__ import annotations

import math
import os

import pytest
import torch

from vlm_sdk.kernels.rotary import rotary_embedding, rotary_embedding_ref
from vlm_sdk.kernels.rotary_torch import apply_rotary  # the torch backend's rotation
from vlm_sdk.layers.rotary import MRotaryEmbedding

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32")] + [
    pytest.param("cuda", dt, marks=CUDA_MARKS, id=f"cuda-{str(dt)[6:]}")
    for dt in (torch.bfloat16, torch.float16, torch.float32)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# (num_heads, num_kv_heads, head_dim): GQA 1, 2 and 8 over head_dim 64, 80 and 128
HEADS = [(4, 4, 64), (4, 2, 80), (8, 1, 128)]
SECTIONS = {64: (8, 12, 12), 80: (8, 16, 16), 128: (16, 24, 24), 16: (2, 3, 3)}
# plain: [N] positions; mrope: [3, N] with distinct t/h/w rows; text: [3, N] without a section (row 0)
MODES = ["plain", "mrope", "text"]


def need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def inv_freq_for(head_dim: int, theta: float = 1e6) -> torch.Tensor:  # [D/2]
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def make_positions(mode: str, n: int, g: torch.Generator) -> torch.Tensor:
    if mode == "plain":
        return torch.randint(0, 30000, (n,), generator=g)
    t = torch.randint(0, 4000, (n,), generator=g)
    return torch.stack((t, t + torch.randint(1, 50, (n,), generator=g), t + torch.randint(50, 99, (n,), generator=g)))


def section_for(mode: str, head_dim: int) -> tuple[int, ...] | None:
    return SECTIONS[head_dim] if mode == "mrope" else None


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_tokens", [1, 19])
def test_rotary_matches_ref(device, dtype, num_heads, num_kv_heads, head_dim, mode, num_tokens):
    need_triton(device)
    g = torch.Generator().manual_seed(1000 * num_heads + 10 * head_dim + MODES.index(mode) + 7 * num_tokens)
    positions = make_positions(mode, num_tokens, g).to(device)
    inv_freq = inv_freq_for(head_dim).to(device)
    section = section_for(mode, head_dim)
    h, hkv = num_heads, num_kv_heads
    qkv = torch.randn(num_tokens, h + 2 * hkv, head_dim, generator=g).to(device, dtype)  # [N, H+2Hkv, D]
    ours, ref = qkv.clone(), qkv.clone()
    rotary_embedding(ours[:, :h], ours[:, h:h + hkv], positions, inv_freq, section)
    rotary_embedding_ref(ref[:, :h], ref[:, h:h + hkv], positions, inv_freq, section)
    tol = TOL[dtype]
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    assert torch.equal(ours[:, h + hkv:], qkv[:, h + hkv:])  # v untouched
    assert not torch.equal(ours[:, :h + hkv], qkv[:, :h + hkv])


@pytest.mark.parametrize("device,dtype", CASES)
def test_rotary_int32_and_transposed_positions(device, dtype):
    need_triton(device)
    g = torch.Generator().manual_seed(11)
    n, h, hkv, d = 9, 2, 1, 16
    positions = make_positions("mrope", n, g).t().contiguous().t().to(device, torch.int32)  # [3, N], strides (1, 3)
    inv_freq = inv_freq_for(d).to(device)
    qkv = torch.randn(n, h + 2 * hkv, d, generator=g).to(device, dtype)
    ours, ref = qkv.clone(), qkv.clone()
    rotary_embedding(ours[:, :h], ours[:, h:h + hkv], positions, inv_freq, (2, 3, 3))
    rotary_embedding_ref(ref[:, :h], ref[:, h:h + hkv], positions.long().contiguous(), inv_freq, (2, 3, 3))
    torch.testing.assert_close(ours, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("head_dim,mrope,positions_rows", [
    (128, False, 1), (128, True, 3), (128, True, 1), (128, False, 3),
    (16, False, 1), (16, True, 3), (64, True, 3), (80, True, 3)])
def test_ref_matches_decoder_rotary(head_dim, mrope, positions_rows):
    """The reference is what the torch backend runs: it must agree with MRotaryEmbedding + apply_rotary
    for plain RoPE, M-RoPE, [N] positions given to an M-RoPE model and [3, N] positions without a section."""
    g = torch.Generator().manual_seed(head_dim + 2 * mrope + positions_rows)
    n, h, hkv = 13, 4, 2
    section = SECTIONS[head_dim] if mrope else None
    positions = make_positions("plain" if positions_rows == 1 else "mrope", n, g)
    rope = MRotaryEmbedding(head_dim, 1e6, section, "cpu")
    cos, sin = rope(positions, torch.float32)  # [N, 1, D/2]
    qkv = torch.randn(n, h + 2 * hkv, head_dim, generator=g)  # [N, H+2Hkv, D]
    expected = apply_rotary(qkv[:, :h + hkv], cos, sin)
    ours = qkv.clone()
    rotary_embedding_ref(ours[:, :h], ours[:, h:h + hkv], positions, rope.inv_freq, section)
    torch.testing.assert_close(ours[:, :h + hkv], expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(ours[:, h + hkv:], qkv[:, h + hkv:])
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():  # and so must the kernel
        dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
        kern = qkv.clone().to(dev)
        rotary_embedding(kern[:, :h], kern[:, h:h + hkv], positions.to(dev), rope.inv_freq.to(dev), section)
        torch.testing.assert_close(kern[:, :h + hkv].cpu(), expected, atol=1e-5, rtol=1e-5)


def test_ref_matches_naive_formula():
    g = torch.Generator().manual_seed(5)
    n, h, d = 7, 3, 16
    section = (2, 3, 3)
    positions = make_positions("mrope", n, g)
    inv_freq = inv_freq_for(d, 1e4)
    q, k = torch.randn(n, h, d, generator=g), torch.randn(n, 1, d, generator=g)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(q_ref, k_ref, positions, inv_freq, section)
    row_of = [s % 3 for s, size in enumerate(section) for _ in range(size)]
    for x, got in ((q, q_ref), (k, k_ref)):
        want = torch.empty_like(x, dtype=torch.float64)
        for t in range(n):
            for i in range(d // 2):
                angle = float(positions[row_of[i], t].float() * inv_freq[i])  # the angle in float32, as specified
                c, s = math.cos(angle), math.sin(angle)
                x1, x2 = x[t, :, i].double(), x[t, :, i + d // 2].double()
                want[t, :, i] = x1 * c - x2 * s
                want[t, :, i + d // 2] = x2 * c + x1 * s
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_rotary_rejects_bad_inputs():
    q, k = torch.zeros(4, 2, 16), torch.zeros(4, 1, 16)
    pos, inv = torch.zeros(4, dtype=torch.int64), inv_freq_for(16)
    with pytest.raises(ValueError, match="mrope_section"):
        rotary_embedding(q, k, pos[None].expand(3, -1), inv, (2, 2, 2))
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(q, k, pos[:3], inv)
    with pytest.raises(ValueError, match="inv_freq"):
        rotary_embedding(q, k, pos, inv[:4])
    with pytest.raises(ValueError, match="dtype"):
        rotary_embedding(q, k.double(), pos, inv)
