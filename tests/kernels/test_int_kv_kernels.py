"""The int8 / int4 KV cache (kernels/kv_int.py, LMDeploy's quant_policy 8 / 4) against torch references:
the quantize / dequantize round trip against an independent float64 reference and its error bound; the
Triton store against the torch store (codes equal but for rounding ties, every read within the bound);
decode and paged prefill over an int cache against their references over the dequantized cache; the torch
backend's `paged_attention` too. Under TRITON_INTERPRET=1 on the CPU (fp32 and fp16), compiled on CUDA
with `-m cuda`.

Values are offset and scaled per head (mean 3, spread up to 8) so that a kernel that dropped the zero
point, or used one head's scale for another, is off by the offset, far outside the bounds."""
from __future__ import annotations

import os

import pytest
import torch

from tolerance import assert_reduction_close, attention_terms
from vlm_sdk.kernels import kv_int
from vlm_sdk.kernels.paged_attention import paged_attention
from vlm_sdk.kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_ref
from vlm_sdk.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from vlm_sdk.kernels.store_kv import store_kv, store_kv_ref

devices = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
BLOCK_SIZE = 16
BITS = [8, 4]


def _need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def _dtypes(device: str) -> list[torch.dtype]:
    # fp16 on the CPU: the interpreter's stand-in for bf16 (its bf16 tl.dot is wrong: numpy has no bf16)
    return [torch.float32, torch.float16] if device == "cpu" else [torch.bfloat16, torch.float16, torch.float32]


def _values(shape, g: torch.Generator) -> torch.Tensor:
    """Rows [..., D] like a model's keys: per-row offset and spread."""
    offset = 3 + torch.randn(*shape[:-1], 1, generator=g)
    spread = torch.rand(*shape[:-1], 1, generator=g) * 8 + 0.1
    return offset + spread * torch.randn(shape, generator=g)


def _reference_round_trip(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LMDeploy's formulas in float64, written out apart from kv_int: (read back, scale) per row."""
    q = 2 ** bits - 1
    x = x.double()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / q
    zero = -lo / scale
    code = torch.floor(x / scale + zero + 0.5).clamp(0, q)
    return (code - zero) * scale, scale[..., 0]


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_within_half_a_step(bits):
    """Every value reads back within scale / 2 (round to nearest, min and max representable), matching
    the float64 reference up to float32 rounding; int4 packs element d low and d + D/2 high."""
    g = torch.Generator().manual_seed(bits)
    x = _values((64, 4, 128), g)
    codes, sz = kv_int.quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 4, kv_int.code_dim(128, bits)) and sz.shape == (64, 4, 2)
    read = kv_int.dequantize(codes, sz, bits, torch.float32)
    err = (read - x).abs().amax(-1)  # [64, 4]
    # float32 arithmetic on x / scale + zero (|x / scale| up to ~Q * |x| / range) adds a few ulps
    slack = 4 * torch.finfo(torch.float32).eps * (x.abs().amax(-1) + sz[..., 0] * 2 ** bits)
    assert (err <= kv_int.error_bound(sz) + slack).all()
    assert (err > kv_int.error_bound(sz) / 4).all()  # the bound is tight, not vacuous
    ref, ref_scale = _reference_round_trip(x, bits)
    assert torch.allclose(sz[..., 0].double(), ref_scale, rtol=1e-6)
    mismatched = (read.double() - ref).abs() > 1e-4 * (1 + x.abs().double())
    assert mismatched.float().mean() < 1e-3  # only rounding ties may fall the other way
    if bits == 4:
        full = torch.floor(x / sz[..., :1] + sz[..., 1:] + 0.5).clamp(0, 15).to(torch.uint8)
        assert torch.equal(codes & 0xF, full[..., :64]) and torch.equal(codes >> 4, full[..., 64:])
    assert kv_int.round_trip(x, 0) is x
    constant = torch.full((2, 1, 16), 2.5)  # no range: read back exactly
    assert torch.equal(kv_int.round_trip(constant, bits), constant)


def _int_cache(lens: list[int], num_kv_heads: int, head_dim: int, bits: int, device, g: torch.Generator,
               fill: int = 0xFF):
    """Block tables over shuffled blocks and K/V code pages of quantized values; the slots no sequence owns
    hold `fill` codes with NaN scales (reading one poisons the result)."""
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lens), max(blocks) + 1), int(perm[-1]), dtype=torch.int32)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, kv_int.code_dim(head_dim, bits))
    caches = [torch.full(shape, fill, dtype=torch.uint8) for _ in range(2)]
    sz = [torch.full((*shape[:3], 2), float("nan")) for _ in range(2)]
    used = 0
    for b, (n, nb) in enumerate(zip(lens, blocks)):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
        pos = torch.arange(n)
        slots = tables[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        for cache, s in zip(caches, sz):
            kv_int.write_slots(cache, s, slots, _values((n, num_kv_heads, head_dim), g), bits)
    return [c.to(device) for c in caches], [s.to(device) for s in sz], tables.to(device)


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(2, 2, 64), (4, 2, 80), (8, 1, 128)])
def test_store_kv_int_matches_ref(device, bits, num_heads, num_kv_heads, head_dim):
    _need_triton(device)
    g = torch.Generator().manual_seed(num_heads * head_dim + bits)
    slots = torch.cat([torch.randperm(6 * BLOCK_SIZE, generator=g)[:30], torch.tensor([-1, -1])])
    slots = slots[torch.randperm(32, generator=g)].to(device)
    keep = slots >= 0
    width = kv_int.code_dim(head_dim, bits)
    for dtype in _dtypes(device):
        qkv = _values((32, num_heads + 2 * num_kv_heads, head_dim), g).to(device, dtype)
        k, v = qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
        caches = [torch.full((6, BLOCK_SIZE, num_kv_heads, width), 7, dtype=torch.uint8, device=device)
                  for _ in range(4)]
        sz = [torch.full((6, BLOCK_SIZE, num_kv_heads, 2), -1.0, device=device) for _ in range(4)]
        store_kv(k, v, caches[0], caches[1], slots, k_sz=sz[0], v_sz=sz[1])
        store_kv_ref(k, v, caches[2], caches[3], slots, k_sz=sz[2], v_sz=sz[3])
        for i, x in ((0, k), (1, v)):
            got, ref = caches[i], caches[i + 2]
            assert torch.allclose(sz[i], sz[i + 2], rtol=1e-6, atol=0), dtype  # scales and zeros
            got_read = kv_int.dequantize(got.view(-1, num_kv_heads, width)[slots[keep]],
                                         sz[i].view(-1, num_kv_heads, 2)[slots[keep]], bits, torch.float32)
            bound = kv_int.error_bound(sz[i].view(-1, num_kv_heads, 2)[slots[keep]])[..., None]
            err = (got_read - x[keep].float()).abs()
            assert (err <= bound * (1 + 1e-4) + 1e-5 * x[keep].float().abs()).all(), dtype
            # codes equal but where x / scale + zero falls on a rounding tie (float32 on both sides)
            assert (got != ref).float().mean() < 0.01, dtype
            untouched = torch.ones(6 * BLOCK_SIZE, dtype=torch.bool, device=device)
            untouched[slots[keep]] = False
            assert (got.view(-1, num_kv_heads, width)[untouched] == 7).all()  # slot -1 and the others: unwritten


def test_int_cache_refusals():
    k = torch.zeros(2, 1, 16)
    cache = torch.zeros(2, BLOCK_SIZE, 1, 8, dtype=torch.uint8)
    sz = torch.zeros(2, BLOCK_SIZE, 1, 2)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="neither"):  # width 8 of head_dim 16 is int4; 5 is nothing
        kv_int.bits_of(torch.zeros(2, BLOCK_SIZE, 1, 5, dtype=torch.uint8), sz, 16)
    with pytest.raises(ValueError, match="float32"):
        store_kv_ref(k, k, cache, cache, slots, k_sz=sz.half(), v_sz=sz.half())
    with pytest.raises(ValueError, match="both"):
        store_kv_ref(k, k, cache, cache, slots, k_sz=sz)
    assert kv_int.bits_of(cache, sz, 16) == 4 and kv_int.bits_of(cache, sz, 8) == 8


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group,num_kv_heads,head_dim,num_splits", [(1, 2, 64, 1), (8, 1, 128, 3), (2, 1, 80, 8)])
def test_decode_over_int_cache_matches_ref(device, bits, group, num_kv_heads, head_dim, num_splits):
    _need_triton(device)
    g = torch.Generator().manual_seed(group * head_dim + num_splits + bits)
    lens = [37, 1, 0, 150]
    (k_cache, v_cache), (k_sz, v_sz), tables = _int_cache(lens, num_kv_heads, head_dim, bits, device, g)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    for dtype in _dtypes(device):
        q = torch.randn(len(lens), group * num_kv_heads, head_dim, generator=g).to(device, dtype)
        got = paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5, num_splits=num_splits,
                                     k_sz=k_sz, v_sz=v_sz)
        ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5, k_sz=k_sz, v_sz=v_sz)
        assert torch.isfinite(ref).all() and ref.abs().max() > 1.0  # the zero point applied: values ~3
        # the tile is dequantized into q's dtype before the dots: one more rounding of K and V
        assert_reduction_close(got.float(), ref.float(), attention_terms(head_dim, max(lens)), storage=dtype,
                               roundings=3, msg=f"{dtype}")
        assert (got[lens.index(0)] == 0).all()


@pytest.mark.parametrize("device", devices)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 80), (8, 1, 128)])
def test_prefill_over_int_cache_matches_ref(device, bits, num_heads, num_kv_heads, head_dim):
    """Whole prompts, a chunk after a cached context, a decode row and an empty row, in one step; and a
    sliding window."""
    _need_triton(device)
    g = torch.Generator().manual_seed(num_heads + head_dim + bits)
    q_lens, lens = [37, 20, 1, 0], [37, 52, 29, 10]
    (k_cache, v_cache), (k_sz, v_sz), tables = _int_cache(lens, num_kv_heads, head_dim, bits, device, g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    for dtype, window in [(d, w) for d in _dtypes(device) for w in (None, 9)]:
        q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(device, dtype)
        args = (q, k_cache, v_cache, tables, cu, seq_lens, max(q_lens), head_dim ** -0.5)
        got = paged_prefill_attention(*args, k_sz=k_sz, v_sz=v_sz, window=window)
        ref = paged_prefill_attention_ref(*args, k_sz=k_sz, v_sz=v_sz, window=window)
        assert torch.isfinite(ref).all() and ref.abs().max() > 1.0
        assert_reduction_close(got.float(), ref.float(), attention_terms(head_dim, max(lens)), storage=dtype,
                               roundings=3, msg=f"{dtype}, window {window}")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("lens,q_lens", [([37, 1, 150], [1, 1, 1]), ([37, 52], [37, 20])],
                         ids=["batched_decode", "prompt_and_chunk"])
def test_torch_paged_attention_over_int_cache(bits, lens, q_lens):
    """The torch backend's path (batched decode groups, the per-sequence gather, and the whole-prompt path
    that attends over this step's K/V round-tripped through the quantization) equals the kernels'
    references. Free slots hold zero codes and scales, as the engine's zeroed cache does."""
    g = torch.Generator().manual_seed(len(lens) + bits)
    (k_cache, v_cache), (k_sz, v_sz), tables = _int_cache(lens, 2, 64, bits, "cpu", g, fill=0)
    k_sz.nan_to_num_(0.0), v_sz.nan_to_num_(0.0)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(sum(q_lens), 4, 64, generator=g)
    new = torch.cat([tables[b, torch.arange(n - ql, n) // BLOCK_SIZE].long() * BLOCK_SIZE
                     + torch.arange(n - ql, n) % BLOCK_SIZE for b, (n, ql) in enumerate(zip(lens, q_lens))])
    width = kv_int.code_dim(64, bits)
    k = kv_int.dequantize(k_cache.view(-1, 2, width)[new], k_sz.view(-1, 2, 2)[new], bits, torch.float32)
    v = kv_int.dequantize(v_cache.view(-1, 2, width)[new], v_sz.view(-1, 2, 2)[new], bits, torch.float32)
    got = paged_attention(q, k_cache, v_cache, tables, seq_lens, q_lens, lens, 0.125, k, v, k_sz=k_sz, v_sz=v_sz)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, seq_lens, max(q_lens), 0.125, k_sz=k_sz,
                                      v_sz=v_sz)
    # the whole prompt re-quantizes values already on the grid: the same codes up to float32 rounding
    assert_reduction_close(got, ref, attention_terms(64, max(lens)), storage=torch.float32, roundings=4)
