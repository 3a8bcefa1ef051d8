"""store_kv (Triton) against store_kv_ref, and the reference against write_kv_cache and a per-row loop."""
from __future__ import annotations

import os

import pytest
import torch

from vlm_sdk.kernels.paged_attention import write_kv_cache
from vlm_sdk.kernels.store_kv import store_kv, store_kv_ref

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# (device, k/v dtype, cache dtype): the CPU runs the interpreter in float32 and float16 (the stand-in
# for bf16 there: numpy has no bf16), also casting fp32 rows into an fp16 cache
CASES = [pytest.param("cpu", torch.float32, torch.float32, id="cpu-fp32"),
         pytest.param("cpu", torch.float16, torch.float16, id="cpu-fp16"),
         pytest.param("cpu", torch.float32, torch.float16, id="cpu-fp32-fp16")] + [
    pytest.param("cuda", src, dst, marks=CUDA_MARKS, id=f"cuda-{str(src)[6:]}-{str(dst)[6:]}")
    for src, dst in [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.float32),
                     (torch.float32, torch.bfloat16), (torch.float32, torch.float16)]]
# (num_heads, num_kv_heads, head_dim): GQA 1, 2 and 8 over head_dim 64, 80 and 128
HEADS = [(2, 2, 64), (4, 2, 80), (8, 1, 128)]
BLOCK_SIZE = 16
SENTINEL = -3.0


def need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def make_step(seq_lens: list[int], num_pad: int, num_blocks: int, g: torch.Generator) -> torch.Tensor:
    """Slot mapping of a prefill batch over shuffled blocks, with `num_pad` -1 rows spliced in at random."""
    free = torch.randperm(num_blocks, generator=g)
    slots, used = [], 0
    for n in seq_lens:
        nb = -(-n // BLOCK_SIZE)
        table = free[used:used + nb]
        used += nb
        pos = torch.arange(n)
        slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    slots = torch.cat(slots)
    for _ in range(num_pad):
        i = int(torch.randint(0, slots.numel() + 1, (1,), generator=g))
        slots = torch.cat((slots[:i], torch.tensor([-1]), slots[i:]))
    return slots


def run_both(k, v, slots, num_blocks, cache_dtype, device):
    hkv, d = k.shape[1], k.shape[2]
    caches = [torch.full((num_blocks, BLOCK_SIZE, hkv, d), SENTINEL, dtype=cache_dtype, device=device)
              for _ in range(4)]
    store_kv(k, v, caches[0], caches[1], slots)
    store_kv_ref(k, v, caches[2], caches[3], slots)
    return caches


@pytest.mark.parametrize("device,dtype,cache_dtype", CASES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_store_kv_matches_ref(device, dtype, cache_dtype, num_heads, num_kv_heads, head_dim):
    need_triton(device)
    g = torch.Generator().manual_seed(1000 * num_heads + head_dim)
    seq_lens = [21, 1, 16, 5]  # not a block multiple, a single token, exactly one block
    num_blocks = 12
    slots = make_step(seq_lens, num_pad=3, num_blocks=num_blocks, g=g).to(device)
    n = slots.numel()
    # k and v as strided views of a packed qkv, as the decoder produces them
    qkv = torch.randn(n, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(device, dtype)
    k, v = qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    kc, vc, kc_ref, vc_ref = run_both(k, v, slots, num_blocks, cache_dtype, device)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)

    keep = slots >= 0
    flat_k, flat_v = kc.view(-1, num_kv_heads, head_dim), vc.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots[keep]], k[keep].to(cache_dtype))
    assert torch.equal(flat_v[slots[keep]], v[keep].to(cache_dtype))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    assert untouched.sum() == num_blocks * BLOCK_SIZE - sum(seq_lens)
    assert (flat_k[untouched] == SENTINEL).all() and (flat_v[untouched] == SENTINEL).all()


@pytest.mark.parametrize("device,dtype,cache_dtype", CASES)
def test_store_kv_int32_slots_and_all_padding(device, dtype, cache_dtype):
    need_triton(device)
    g = torch.Generator().manual_seed(7)
    k = torch.randn(6, 2, 64, generator=g).to(device, dtype)
    v = torch.randn(6, 2, 64, generator=g).to(device, dtype)
    slots = torch.tensor([5, -1, 40, 17, -1, 0], dtype=torch.int32, device=device)
    kc, vc, kc_ref, vc_ref = run_both(k, v, slots, 3, cache_dtype, device)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert torch.equal(kc.view(-1, 2, 64)[40], k[2].to(cache_dtype))

    pad = torch.full((6,), -1, dtype=torch.int64, device=device)  # a CUDA-graph batch of padding only
    kc, vc, _, _ = run_both(k, v, pad, 3, cache_dtype, device)
    assert (kc == SENTINEL).all() and (vc == SENTINEL).all()
    store_kv(k[:0], v[:0], kc, vc, pad[:0])  # no tokens: nothing launched
    assert (kc == SENTINEL).all()


def test_ref_matches_write_kv_cache_and_loop():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 9, 4, 80, generator=g).unbind(0)
    slots = torch.randperm(5 * BLOCK_SIZE, generator=g)[:9]
    caches = [torch.full((5, BLOCK_SIZE, 4, 80), SENTINEL) for _ in range(6)]
    store_kv_ref(k, v, caches[0], caches[1], slots)
    write_kv_cache(k, v, caches[2], caches[3], slots)
    for i, s in enumerate(slots.tolist()):
        caches[4][s // BLOCK_SIZE, s % BLOCK_SIZE] = k[i]
        caches[5][s // BLOCK_SIZE, s % BLOCK_SIZE] = v[i]
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0], caches[4]) and torch.equal(caches[1], caches[5])


def test_store_kv_rejects_bad_inputs():
    k = torch.zeros(3, 2, 64)
    cache = torch.zeros(2, BLOCK_SIZE, 2, 64)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, cache, cache, slots.float())
    with pytest.raises(ValueError, match="k_cache"):
        store_kv(k, k, torch.zeros(2, BLOCK_SIZE, 4, 64), cache, slots)
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(k, k, cache.transpose(0, 1), cache.transpose(0, 1), slots)
    with pytest.raises(ValueError, match="k and v"):
        store_kv(k, k[:2], cache, cache, slots)
