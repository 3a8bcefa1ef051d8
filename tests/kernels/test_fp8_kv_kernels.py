"""The FP8 KV cache's kernels against their torch references (kernels/kv_quant.py): the store writes the
same bytes as the reference; decode and paged prefill over an FP8 cache equal their references over the
dequantized cache, through both of their read paths (e4m3 converted by Triton, as on sm_89+, and from its
bits, as on sm_80: kernels/fp8_bits.py); the torch backend's `paged_attention` equals them too. Under
TRITON_INTERPRET=1 on the CPU, and compiled on CUDA with `-m cuda`.

What the interpreter does with float8 (checked here, first): it loads e4m3 and converts it to float16 /
float32 as torch does for every finite code (its NaN codes come out as +-480), but its float32 -> e4m3
conversion drops the carry of a round-up into the exponent (125.9 becomes 64, not 128), which is one
reason the store encodes the bits itself (the other: sm_80 has no float8 type in Triton).

Scales are not 1 (0.037 and 5.5), so a kernel that forgot to apply one, or applied k's to v, is off by a
factor, far outside the bounds; values spread over [-8, 8] x scale, some beyond 448 x scale to check the
saturation."""
from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from tolerance import assert_reduction_close, attention_terms
from vlm_sdk.kernels import fp8_bits, kv_quant
from vlm_sdk.kernels.paged_attention import paged_attention
from vlm_sdk.kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_ref
from vlm_sdk.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from vlm_sdk.kernels.store_kv import store_kv, store_kv_ref

FP8 = kv_quant.KV_FP8
devices = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
BLOCK_SIZE = 16


def _need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def _dtypes(device: str) -> list[torch.dtype]:
    # fp16 on the CPU: the interpreter's stand-in for bf16 (its bf16 tl.dot is wrong: numpy has no bf16)
    return [torch.float32, torch.float16] if device == "cpu" else [torch.bfloat16, torch.float16, torch.float32]


def _scales(device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(0.037, device=device), torch.tensor(5.5, device=device))


def test_quantize_saturates_and_round_trips():
    scale = torch.tensor(0.5)
    x = torch.tensor([1.0, -3.3, 300.0, -1000.0, 1e-6])
    stored = kv_quant.quantize(x, scale, FP8)
    assert stored.dtype == FP8
    # x / 0.5 = 2, -6.6 -> -6.5 (e4m3 has 3 mantissa bits), 600 and -2000 saturate to +-448, tiny -> 0
    assert stored.float().tolist() == [2.0, -6.5, 448.0, -448.0, 0.0]
    assert kv_quant.dequantize(stored, scale, torch.float32).tolist() == [1.0, -3.25, 224.0, -224.0, 0.0]
    assert torch.equal(kv_quant.round_trip(x, scale, FP8), kv_quant.dequantize(stored, scale, torch.float32))
    assert kv_quant.round_trip(x, scale, torch.float32) is x  # a float cache: nothing to round
    with pytest.raises(ValueError, match="scale"):
        kv_quant.quantize(x, None, FP8)


def test_write_slots_writes_fp8_rows_on_the_cpu():
    """index_copy_ has no float8 kernel on the CPU: the write goes through uint8 views of the same bytes."""
    cache = torch.zeros(3, BLOCK_SIZE, 2, 8, dtype=FP8)
    rows = torch.randn(4, 2, 8).to(FP8)
    slots = torch.tensor([0, 17, 40, 5])
    kv_quant.write_slots(cache, slots, rows)
    flat = cache.view(-1, 2, 8)
    assert torch.equal(flat[slots].view(torch.uint8), rows.view(torch.uint8))
    assert flat.float().abs().sum() == rows.float().abs().sum()  # nothing else written


@triton.jit
def _convert_kernel(x_ptr, bits_ptr, read_ptr, half_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(bits_ptr + offs, fp8_bits.f32_to_e4m3_bits(tl.load(x_ptr + offs)))
    tl.store(read_ptr + offs, tl.load(half_ptr + offs).to(tl.float32))  # Triton's own e4m3 -> float32
    tl.store(x_ptr + offs, fp8_bits.e4m3_bits_to_f16(tl.load(bits_ptr + offs)).to(tl.float32))


@pytest.mark.parametrize("device", devices)
def test_e4m3_conversions_match_torch(device):
    """Every finite e4m3 value, every midpoint between neighbours (ties go to the even code), points just
    off each midpoint, the subnormals, and values past 448 (saturated) and below the smallest subnormal:
    encoded as torch rounds them; every code decoded as torch reads it (through bits: / 256), and through
    Triton's own load of float8 (the interpreter's and the GPU's)."""
    _need_triton(device)
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(FP8).float()
    finite = values[values.isfinite()].unique()  # [253] sorted, -448 .. 448, one zero
    mids = (finite[1:] + finite[:-1]) / 2
    x = torch.cat([finite, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20), torch.tensor(
        [449.0, -460.0, 1e4, -1e30, 2.0 ** -10, -(2.0 ** -11), 1e-30, 125.9, -31.5, 0.0])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(device)
    bits = torch.empty(n, dtype=torch.uint8, device=device)
    read = torch.empty(n, device=device)
    stored = torch.cat([codes, codes.new_zeros(n - 256)]).view(FP8).to(device)
    expected_bits = fp8_bits.f32_to_e4m3_bits_ref(x)
    _convert_kernel[(1,)](x, bits, read, stored, N=n)
    assert torch.equal(bits, expected_bits), (x[bits != expected_bits][:8], bits[bits != expected_bits][:8])
    decoded = fp8_bits.e4m3_bits_to_f16_ref(bits).float()
    assert torch.equal(x, decoded)  # the kernel overwrote x with its decode of the bits
    ok = values.isfinite().to(device)
    assert torch.equal(read[:256][ok], values.to(device)[ok])


def test_store_fixes_the_interpreters_round_up():
    """The interpreter's own float32 -> e4m3 cast loses a round-up's carry; the store's encoding does not."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's behaviour")
    k = torch.full((1, 1, 16), 125.9)
    cache = torch.zeros(1, BLOCK_SIZE, 1, 16, dtype=FP8)
    store_kv(k, k, cache, cache, torch.tensor([0]), torch.tensor(1.0), torch.tensor(1.0))
    assert cache[0, 0, 0, 0].float() == 128.0


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 2, 64), (4, 2, 80), (8, 1, 128)])
def test_store_kv_fp8_matches_ref(device, num_heads, num_kv_heads, head_dim):
    _need_triton(device)
    g = torch.Generator().manual_seed(num_heads * head_dim)
    ks, vs = _scales(device)
    slots = torch.cat([torch.randperm(6 * BLOCK_SIZE, generator=g)[:30], torch.tensor([-1, -1])])
    slots = slots[torch.randperm(32, generator=g)].to(device)
    for dtype in _dtypes(device):
        qkv = (torch.randn(32, num_heads + 2 * num_kv_heads, head_dim, generator=g) * 8).to(device, dtype)
        k, v = qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
        caches = [torch.full((6, BLOCK_SIZE, num_kv_heads, head_dim), -3.0, device=device).to(FP8)
                  for _ in range(4)]
        store_kv(k, v, caches[0], caches[1], slots, ks, vs)
        store_kv_ref(k, v, caches[2], caches[3], slots, ks, vs)
        for got, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), dtype
        keep = slots >= 0
        stored_k = caches[0].view(-1, num_kv_heads, head_dim)[slots[keep]]
        assert torch.equal(stored_k.view(torch.uint8), kv_quant.quantize(k[keep], ks, FP8).view(torch.uint8))


def test_fp8_cache_needs_its_scales():
    k = torch.zeros(2, 1, 16)
    cache = torch.zeros(2, BLOCK_SIZE, 1, 16, dtype=FP8)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="k_scale"):
        store_kv_ref(k, k, cache, cache, slots)
    with pytest.raises(ValueError, match="v_scale"):
        store_kv_ref(k, k, cache, cache, slots, torch.tensor(1.0), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="float32"):
        paged_attention_decode(k, cache, cache, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                               0.25, k_scale=torch.tensor(1.0, dtype=torch.float64), v_scale=torch.tensor(1.0))


def _fp8_cache(lens: list[int], num_kv_heads: int, head_dim: int, device, g: torch.Generator, ks, vs,
               fill: float = float("nan")):
    """Block tables over shuffled blocks, and K/V caches quantized from values spread like a model's
    keys (up to ~8 x the scale); the slots no sequence owns hold `fill` (FP8 NaN, 0x7F: reading one
    poisons the result)."""
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), max(blocks) + 1), int(perm[-1]), dtype=torch.int32)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.full(shape, fill).to(FP8)
    v_cache = torch.full(shape, fill).to(FP8)
    used = 0
    for b, (n, nb) in enumerate(zip(lens, blocks)):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
        pos = torch.arange(n)
        slots = tables[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        for cache, scale in ((k_cache, ks), (v_cache, vs)):
            values = torch.randn(n, num_kv_heads, head_dim, generator=g) * 3 * float(scale)
            kv_quant.write_slots(cache, slots, kv_quant.quantize(values, scale.cpu(), FP8))
    return k_cache.to(device), v_cache.to(device), tables.to(device)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("group,num_kv_heads,head_dim,num_splits", [(1, 2, 64, 1), (8, 1, 128, 3), (2, 1, 80, 8)])
def test_decode_over_fp8_cache_matches_ref(device, group, num_kv_heads, head_dim, num_splits):
    _need_triton(device)
    g = torch.Generator().manual_seed(group * head_dim + num_splits)
    ks, vs = _scales(device)
    lens = [37, 1, 0, 150]
    k_cache, v_cache, tables = _fp8_cache(lens, num_kv_heads, head_dim, device, g, ks, vs)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    for dtype, hardware in [(d, h) for d in _dtypes(device) for h in (False, True)]:
        q = torch.randn(len(lens), group * num_kv_heads, head_dim, generator=g).to(device, dtype)
        if hardware and device == "cuda" and not fp8_bits.hardware_fp8(q.device):
            continue
        got = paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5, num_splits=num_splits,
                                     k_scale=ks, v_scale=vs, fp8_hardware=hardware)
        ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5, k_scale=ks,
                                         v_scale=vs)
        assert torch.isfinite(ref).all() and ref.abs().max() > 1.0  # v_scale applied: values ~5.5 x 3
        assert_reduction_close(got.float(), ref.float(), attention_terms(head_dim, max(lens)), storage=dtype,
                               roundings=2, msg=f"{dtype}, hardware conversion {hardware}")
        assert (got[lens.index(0)] == 0).all()


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 80), (8, 1, 128)])
def test_prefill_over_fp8_cache_matches_ref(device, num_heads, num_kv_heads, head_dim):
    """Whole prompts, chunks after a cached context, a decode row and an empty row, in one step."""
    _need_triton(device)
    g = torch.Generator().manual_seed(num_heads + head_dim)
    ks, vs = _scales(device)
    q_lens, lens = [37, 20, 1, 0], [37, 52, 29, 10]
    k_cache, v_cache, tables = _fp8_cache(lens, num_kv_heads, head_dim, device, g, ks, vs)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    for dtype, hardware in [(d, h) for d in _dtypes(device) for h in (False, True)]:
        q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(device, dtype)
        if hardware and device == "cuda" and not fp8_bits.hardware_fp8(q.device):
            continue
        args = (q, k_cache, v_cache, tables, cu, seq_lens, max(q_lens), head_dim ** -0.5)
        got = paged_prefill_attention(*args, k_scale=ks, v_scale=vs, fp8_hardware=hardware)
        ref = paged_prefill_attention_ref(*args, k_scale=ks, v_scale=vs)
        assert torch.isfinite(ref).all() and ref.abs().max() > 1.0
        assert_reduction_close(got.float(), ref.float(), attention_terms(head_dim, max(lens)), storage=dtype,
                               roundings=2, msg=f"{dtype}, hardware conversion {hardware}")


@pytest.mark.parametrize("lens,q_lens", [([37, 1, 150], [1, 1, 1]), ([37, 52], [37, 20])],
                         ids=["batched_decode", "prompt_and_chunk"])
def test_torch_paged_attention_over_fp8_cache(lens, q_lens):
    """The torch backend's path (its batched decode groups, the per-sequence gather, and the whole-prompt
    path that attends over this step's K/V round-tripped through FP8) equals the kernels' references. The
    free slots hold zeros, as the engine's cache does (its batched decode reads masked padding)."""
    g = torch.Generator().manual_seed(len(lens))
    ks, vs = _scales("cpu")
    k_cache, v_cache, tables = _fp8_cache(lens, 2, 64, "cpu", g, ks, vs, fill=0.0)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(sum(q_lens), 4, 64, generator=g)
    # this step's own K/V as the backend hands them over: the whole prompt reads them, not the cache
    flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
    new = torch.cat([tables[b, torch.arange(n - ql, n) // BLOCK_SIZE].long() * BLOCK_SIZE
                     + torch.arange(n - ql, n) % BLOCK_SIZE for b, (n, ql) in enumerate(zip(lens, q_lens))])
    k, v = kv_quant.dequantize(flat_k[new], ks, torch.float32), kv_quant.dequantize(flat_v[new], vs, torch.float32)
    k, v = k * (1 + 1e-3 * torch.randn(k.shape, generator=g)), v  # not exactly on the FP8 grid: rounds back
    got = paged_attention(q, k_cache, v_cache, tables, seq_lens, q_lens, lens, 0.125, k, v, k_scale=ks, v_scale=vs)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq_lens, max(q_lens), 0.125, k_scale=ks,
                                      v_scale=vs)
    assert_reduction_close(got, ref, attention_terms(64, max(lens)), storage=torch.float32, roundings=2)
