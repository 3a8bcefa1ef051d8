"""rotary_store_kv (one Triton launch) against the two launches it replaces (rotary_embedding, then
store_kv: bit-equal, the same arithmetic) and against its torch reference, with CUDA-graph padding rows
(slot -1) that must write no cache row."""
from __future__ import annotations

import pytest
import torch

from test_rotary import CUDA_MARKS, TOL, inv_freq_for, make_positions, need_triton, norm_weights, section_for
from vlm_sdk.kernels.rotary import rotary_embedding
from vlm_sdk.kernels.rotary_store_kv import rotary_store_kv, rotary_store_kv_ref
from vlm_sdk.kernels.store_kv import store_kv

CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.float16, id="cpu-fp16")] + [
    pytest.param("cuda", dt, marks=CUDA_MARKS, id=f"cuda-{str(dt)[6:]}") for dt in (torch.bfloat16, torch.float32)]
BLOCK_SIZE = 16
SENTINEL = -3.0


def _step(num_tokens: int, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    """Distinct shuffled slots, every third row padding (-1)."""
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:num_tokens]
    slots[::3] = -1
    return slots


def _run(fn, qkv, h, hkv, slots, positions, inv_freq, section, interleaved, norm, num_blocks, cache_dtype):
    qkv = qkv.clone()
    shape = (num_blocks, BLOCK_SIZE, hkv, qkv.shape[-1])
    k_cache = torch.full(shape, SENTINEL, dtype=cache_dtype, device=qkv.device)
    v_cache = torch.full(shape, SENTINEL, dtype=cache_dtype, device=qkv.device)
    fn(qkv[:, :h], qkv[:, h:h + hkv], qkv[:, h + hkv:], k_cache, v_cache, slots, positions, inv_freq, section,
       interleaved, **norm)
    return qkv, k_cache, v_cache


def _unfused(q, k, v, k_cache, v_cache, slots, positions, inv_freq, section, interleaved, **norm):
    rotary_embedding(q, k, positions, inv_freq, section, interleaved, **norm)
    store_kv(k, v, k_cache, v_cache, slots)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (8, 1, 128), (4, 4, 80)])
@pytest.mark.parametrize("mode,qk_norm", [("plain", False), ("mrope", False), ("interleaved", True)])
def test_fused_equals_the_two_launches_and_the_reference(device, dtype, num_heads, num_kv_heads, head_dim, mode,
                                                          qk_norm):
    need_triton(device)
    g = torch.Generator().manual_seed(100 * num_heads + head_dim + len(mode))
    n, num_blocks, h, hkv = 19, 4, num_heads, num_kv_heads
    positions = make_positions(mode, n, g).to(device)
    inv_freq = inv_freq_for(head_dim).to(device)
    section = section_for(mode, head_dim)
    norm = norm_weights(head_dim, g, device, dtype) if qk_norm else {}
    qkv = torch.randn(n, h + 2 * hkv, head_dim, generator=g).to(device, dtype)  # [N, H+2Hkv, D]
    slots = _step(n, num_blocks, g).to(device)
    args = (qkv, h, hkv, slots, positions, inv_freq, section, mode == "interleaved", norm, num_blocks, dtype)
    fused = _run(rotary_store_kv, *args)
    two = _run(_unfused, *args)
    ref = _run(rotary_store_kv_ref, *args)
    for a, b in zip(fused, two):
        assert torch.equal(a, b)  # the same arithmetic in one launch
    tol = TOL[dtype]
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    # what was stored is the rotated k and the untouched v; padding rows wrote nothing
    out, k_cache, v_cache = fused
    live = slots >= 0
    flat_k, flat_v = k_cache.view(-1, hkv, head_dim), v_cache.view(-1, hkv, head_dim)
    assert torch.equal(flat_k[slots[live]], out[live, h:h + hkv])
    assert torch.equal(flat_v[slots[live]], qkv[live, h + hkv:])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool, device=device)
    written[slots[live]] = True
    assert (flat_k[~written] == SENTINEL).all() and (flat_v[~written] == SENTINEL).all()
    assert not torch.equal(out[:, :h + hkv], qkv[:, :h + hkv])  # q and k were rotated in place


def test_fused_casts_into_a_narrower_cache():
    need_triton("cpu")
    g = torch.Generator().manual_seed(5)
    n, h, hkv, d = 7, 4, 2, 64
    positions, inv_freq = make_positions("plain", n, g), inv_freq_for(d)
    qkv = torch.randn(n, h + 2 * hkv, d, generator=g)
    slots = _step(n, 2, g)
    fused = _run(rotary_store_kv, qkv, h, hkv, slots, positions, inv_freq, None, False, {}, 2, torch.float16)
    two = _run(_unfused, qkv, h, hkv, slots, positions, inv_freq, None, False, {}, 2, torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(fused, two)) and fused[1].dtype == torch.float16


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_writes_an_fp8_cache_as_store_kv_does(device, dtype):
    """kv_cache_dtype='fp8': the rotated k and v go into an e4m3 cache divided by the layer's scales, the
    same bytes as rotary_embedding then store_kv, and as the reference (fp32 input: the same float32
    value / scale, rounded once)."""
    need_triton(device)
    g = torch.Generator().manual_seed(11)
    n, h, hkv, d = 19, 8, 2, 128
    positions, inv_freq = make_positions("mrope", n, g).to(device), inv_freq_for(d).to(device)
    qkv = (torch.randn(n, h + 2 * hkv, d, generator=g) * 2).to(device, dtype)  # within 448 x the scales
    slots = _step(n, 3, g).to(device)
    scales = {"k_scale": torch.tensor(0.05, device=device), "v_scale": torch.tensor(0.03, device=device)}
    args = (qkv, h, hkv, slots, positions, inv_freq, section_for("mrope", d), False, scales, 3,
            torch.float8_e4m3fn)
    fused, two = _run(rotary_store_kv, *args), _run(_unfused_scaled, *args)
    assert torch.equal(fused[0], two[0])
    for a, b in zip(fused[1:], two[1:]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if dtype == torch.float32:  # the reference's rotation rounds like the kernel's within float32's ulp
        ref = _run(rotary_store_kv_ref, *args)
        differ = (fused[1].view(torch.uint8) != ref[1].view(torch.uint8)).float().mean()
        assert differ < 0.01  # a value at a rounding boundary may go either way
        assert torch.equal(fused[2].view(torch.uint8), ref[2].view(torch.uint8))  # v is not rotated
    live = slots >= 0
    stored_v = fused[2].view(-1, hkv, d)[slots[live]].float() * 0.03
    torch.testing.assert_close(stored_v, qkv[live, h + hkv:].float(), atol=0.03 * 2 ** -10, rtol=2 ** -4)


def _unfused_scaled(q, k, v, k_cache, v_cache, slots, positions, inv_freq, section, interleaved, k_scale, v_scale):
    rotary_embedding(q, k, positions, inv_freq, section, interleaved)
    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)


def test_fused_rejects_what_either_kernel_rejects():
    q = torch.randn(3, 4, 64)
    k = v = torch.randn(3, 2, 64)
    cache = torch.zeros(2, BLOCK_SIZE, 2, 64)
    slots = torch.zeros(3, dtype=torch.long)
    pos, inv = torch.zeros(3, dtype=torch.long), inv_freq_for(64)
    with pytest.raises(ValueError, match="k_cache and v_cache must be"):
        rotary_store_kv(q, k, v, torch.zeros(2, BLOCK_SIZE, 2, 32), cache, slots, pos, inv)
    with pytest.raises(ValueError, match="positions must be"):
        rotary_store_kv(q, k, v, cache, cache.clone(), slots, torch.zeros(4, dtype=torch.long), inv)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        rotary_store_kv(q, k, v, cache, cache.clone(), slots[:2], pos, inv)
