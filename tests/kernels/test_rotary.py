"""rotary_embedding (Triton) against rotary_embedding_ref, and the reference against the decoder's
MRotaryEmbedding + apply_rotary, a naive per-frequency formula and transformers' Qwen3-VL (interleaved
M-RoPE after the per-head q/k RMSNorm)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from vlm_sdk.kernels.rotary import rotary_embedding, rotary_embedding_ref
from vlm_sdk.kernels.rotary_torch import apply_rotary  # the torch backend's rotation
from vlm_sdk.layers.rotary import MRotaryEmbedding

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# fp16 on the CPU: the interpreter's stand-in for bf16 (numpy has no bf16, and the interpreter
# computes bf16 wrongly), so the half-precision rounding paths run in the suite
CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.float16, id="cpu-fp16")] + [
    pytest.param("cuda", dt, marks=CUDA_MARKS, id=f"cuda-{str(dt)[6:]}")
    for dt in (torch.bfloat16, torch.float16, torch.float32)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# (num_heads, num_kv_heads, head_dim): GQA 1, 2 and 8 over head_dim 64, 80 and 128
HEADS = [(4, 4, 64), (4, 2, 80), (8, 1, 128)]
SECTIONS = {64: (8, 12, 12), 80: (8, 16, 16), 128: (16, 24, 24), 16: (2, 3, 3)}
INTERLEAVED = {64: (12, 10, 10), 80: (14, 13, 13), 128: (24, 20, 20), 16: (3, 3, 2)}  # Qwen3-VL's split at 128
# plain: [N] positions; mrope: [3, N] with distinct t/h/w rows; interleaved: the same, Qwen3-VL's layout;
# text: [3, N] without a section (row 0)
MODES = ["plain", "mrope", "interleaved", "text"]


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
    return {"mrope": SECTIONS, "interleaved": INTERLEAVED}[mode][head_dim] if mode in ("mrope", "interleaved") else None


def norm_weights(head_dim: int, g: torch.Generator, device="cpu", dtype=torch.float32) -> dict:
    """The q/k RMSNorm keywords of `rotary_embedding`: weights [D] each."""
    q, k = (1 + 0.3 * torch.randn(head_dim, generator=g) for _ in range(2))
    return dict(q_norm_weight=q.to(device, dtype), k_norm_weight=k.to(device, dtype), norm_eps=1e-6)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_tokens", [1, 19])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk_norm"])
def test_rotary_matches_ref(device, dtype, num_heads, num_kv_heads, head_dim, mode, num_tokens, qk_norm):
    need_triton(device)
    g = torch.Generator().manual_seed(1000 * num_heads + 10 * head_dim + MODES.index(mode) + 7 * num_tokens)
    positions = make_positions(mode, num_tokens, g).to(device)
    inv_freq = inv_freq_for(head_dim).to(device)
    section = section_for(mode, head_dim)
    norm = norm_weights(head_dim, g, device, dtype) if qk_norm else {}
    h, hkv = num_heads, num_kv_heads
    qkv = torch.randn(num_tokens, h + 2 * hkv, head_dim, generator=g).to(device, dtype)  # [N, H+2Hkv, D]
    if qk_norm:  # heads of different scales: the norm must undo each one's own
        qkv *= torch.logspace(-1, 1, h + 2 * hkv, dtype=torch.float32)[:, None].to(device, dtype)
    ours, ref = qkv.clone(), qkv.clone()
    interleaved = mode == "interleaved"
    rotary_embedding(ours[:, :h], ours[:, h:h + hkv], positions, inv_freq, section, interleaved, **norm)
    rotary_embedding_ref(ref[:, :h], ref[:, h:h + hkv], positions, inv_freq, section, interleaved, **norm)
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


@pytest.mark.parametrize("head_dim,layout,positions_rows", [
    (128, None, 1), (128, "mrope", 3), (128, "mrope", 1), (128, None, 3), (16, None, 1), (16, "mrope", 3),
    (64, "mrope", 3), (80, "mrope", 3), (128, "interleaved", 3), (128, "interleaved", 1), (16, "interleaved", 3),
    (64, "interleaved", 3), (80, "interleaved", 3)])
def test_ref_matches_decoder_rotary(head_dim, layout, positions_rows):
    """The reference is what the torch backend runs: it must agree with MRotaryEmbedding + apply_rotary
    for plain RoPE, M-RoPE (contiguous and interleaved), [N] positions given to an M-RoPE model and
    [3, N] positions without a section."""
    g = torch.Generator().manual_seed(head_dim + 2 * (layout is not None) + positions_rows)
    n, h, hkv = 13, 4, 2
    section, interleaved = section_for(layout, head_dim) if layout else None, layout == "interleaved"
    positions = make_positions("plain" if positions_rows == 1 else "mrope", n, g)
    rope = MRotaryEmbedding(head_dim, 1e6, section, "cpu", interleaved=interleaved)
    cos, sin = rope(positions, torch.float32)  # [N, 1, D/2]
    qkv = torch.randn(n, h + 2 * hkv, head_dim, generator=g)  # [N, H+2Hkv, D]
    expected = apply_rotary(qkv[:, :h + hkv], cos, sin)
    ours = qkv.clone()
    rotary_embedding_ref(ours[:, :h], ours[:, h:h + hkv], positions, rope.inv_freq, section, interleaved)
    torch.testing.assert_close(ours[:, :h + hkv], expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(ours[:, h + hkv:], qkv[:, h + hkv:])
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():  # and so must the kernel
        dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
        kern = qkv.clone().to(dev)
        rotary_embedding(kern[:, :h], kern[:, h:h + hkv], positions.to(dev), rope.inv_freq.to(dev), section,
                         interleaved)
        torch.testing.assert_close(kern[:, :h + hkv].cpu(), expected, atol=1e-5, rtol=1e-5)


# the position row of each of 8 frequencies, written out: contiguous (2, 3, 3) and Qwen3-VL's interleaved (3, 3, 2)
NAIVE_LAYOUTS = {"contiguous": ((2, 3, 3), False, [0, 0, 1, 1, 1, 2, 2, 2]),
                 "interleaved": ((3, 3, 2), True, [0, 1, 2, 0, 1, 2, 0, 1])}


@pytest.mark.parametrize("layout", list(NAIVE_LAYOUTS))
def test_ref_matches_naive_formula(layout):
    g = torch.Generator().manual_seed(5)
    n, h, d = 7, 3, 16
    section, interleaved, row_of = NAIVE_LAYOUTS[layout]
    positions = make_positions("mrope", n, g)
    inv_freq = inv_freq_for(d, 1e4)
    q, k = torch.randn(n, h, d, generator=g), torch.randn(n, 1, d, generator=g)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(q_ref, k_ref, positions, inv_freq, section, interleaved)
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


@pytest.mark.parametrize("head_dim,section", [(128, (24, 20, 20)), (16, (3, 3, 2))])
def test_matches_transformers_qwen3_vl(head_dim, section):
    """Qwen3-VL's per-head q/k RMSNorm then interleaved M-RoPE as transformers computes them (float32):
    MRotaryEmbedding's angles, the reference and the kernel."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (Qwen3VLTextRMSNorm, Qwen3VLTextRotaryEmbedding,
                                                                apply_rotary_pos_emb)
    g = torch.Generator().manual_seed(head_dim)
    n, h, hkv, d, theta = 11, 4, 2, head_dim, 5e6
    cfg = Qwen3VLTextConfig(hidden_size=4 * d, num_attention_heads=h, num_key_value_heads=hkv, head_dim=d,
                            rope_parameters={"rope_type": "default", "rope_theta": theta,
                                             "mrope_section": list(section), "mrope_interleaved": True})
    positions = make_positions("mrope", n, g)  # [3, N]
    q, k = torch.randn(1, h, n, d, generator=g) * 3, torch.randn(1, hkv, n, d, generator=g) * 0.2  # HF [B, H, N, D]
    norm = norm_weights(d, g)
    q_norm, k_norm = Qwen3VLTextRMSNorm(d, norm["norm_eps"]), Qwen3VLTextRMSNorm(d, norm["norm_eps"])
    with torch.no_grad():
        q_norm.weight.copy_(norm["q_norm_weight"])
        k_norm.weight.copy_(norm["k_norm_weight"])
        cos, sin = Qwen3VLTextRotaryEmbedding(cfg)(q, positions[:, None])  # [1, N, D]
        want_q, want_k = (x[0].transpose(0, 1) for x in apply_rotary_pos_emb(q_norm(q), k_norm(k), cos, sin))
    rope = MRotaryEmbedding(d, theta, section, "cpu", interleaved=True)
    ours_cos, ours_sin = rope(positions, torch.float32)  # [N, 1, D/2]
    torch.testing.assert_close(torch.cat((ours_cos, ours_cos), -1)[:, 0], cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat((ours_sin, ours_sin), -1)[:, 0], sin[0], atol=1e-6, rtol=0)
    kernels = [rotary_embedding_ref] + ([rotary_embedding] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    for kernel in kernels:
        ours_q, ours_k = q[0].transpose(0, 1).clone(), k[0].transpose(0, 1).clone()  # [N, H, D]
        kernel(ours_q, ours_k, positions, rope.inv_freq, section, True, **norm)
        torch.testing.assert_close(ours_q, want_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours_k, want_k, atol=1e-5, rtol=1e-5)


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
    with pytest.raises(ValueError, match=r"interleaved mrope_section \(2, 4, 2\)"):  # h would need frequency 10 of 8
        rotary_embedding(q, k, pos[None].expand(3, -1), inv, (2, 4, 2), True)
    norm = norm_weights(16, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="go together"):
        rotary_embedding(q, k, pos, inv, q_norm_weight=norm["q_norm_weight"])
    with pytest.raises(ValueError, match="q's dtype"):
        rotary_embedding(q, k, pos, inv, **{**norm, "k_norm_weight": norm["k_norm_weight"].half()})
    with pytest.raises(ValueError, match=r"q_norm_weight must be a contiguous \[16\]"):
        rotary_embedding(q, k, pos, inv, **{**norm, "q_norm_weight": norm["q_norm_weight"][:8]})


@pytest.mark.parametrize("device,dtype", [pytest.param("cpu", torch.float32, id="cpu-fp32"),
                                          pytest.param("cuda", torch.float32, marks=CUDA_MARKS, id="cuda-fp32")])
def test_large_positions_match_float64_cos_sin_of_the_float32_angle(device, dtype):
    """The kernel's own cos/sin (a float64 quadrant reduction and polynomials, no libdevice cosf: its
    huge-argument path spilled registers on sm_90) against float64 cos/sin of the same float32 angle
    HF computes, at positions up to 1e6 (angles up to 1e6 rad): no further from them than twice torch's
    own float32 cos/sin (+1e-7)."""
    need_triton(device)
    heads, d = 2, 64
    positions = torch.tensor([0, 1, 7, 4095, 32768, 100_003, 262_144, 524_287, 999_999], device=device)
    n = positions.numel()
    inv_freq = inv_freq_for(d).to(device)
    q = torch.randn(n, heads, d, device=device, dtype=dtype)
    k = torch.randn(n, 1, d, device=device, dtype=dtype)
    angle = (positions[:, None].float() * inv_freq[None, :]).double()  # [n, d/2]: HF's float32 angle, exactly
    expected_q = apply_rotary(q.double(), angle.cos()[:, None, :], angle.sin()[:, None, :])
    expected_k = apply_rotary(k.double(), angle.cos()[:, None, :], angle.sin()[:, None, :])
    torch_q = apply_rotary(q, angle.float().cos()[:, None, :], angle.float().sin()[:, None, :])  # float32 torch
    torch_err = (torch_q.double() - expected_q).abs().max().item()  # ~2e-7 on randn inputs
    rotary_embedding(q, k, positions, inv_freq)
    assert (q.double() - expected_q).abs().max().item() <= 2 * torch_err + 1e-7  # measured: 2.1e-7 vs 2.1e-7
    assert (k.double() - expected_k).abs().max().item() <= 2 * torch_err + 1e-7
