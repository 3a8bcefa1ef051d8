"""paged_attention_decode (Triton split-context decode) against its torch reference, and the reference
against a naive per-sequence softmax. CPU runs fp32 under TRITON_INTERPRET=1 (slow: small shapes)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from tolerance import assert_reduction_close, attention_terms
from vlm_sdk.kernels.paged_attention_decode import (choose_num_splits, paged_attention_decode,
                                                    paged_attention_decode_ref)

devices = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
# fp16 on the CPU: the interpreter's stand-in for bf16 (its bf16 tl.dot is wrong: numpy has no bf16)
CPU_DTYPES = [torch.float32, torch.float16]
CUDA_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# 0: a CUDA-graph padding row; 1: a single key; 32: ends exactly on a block boundary (8, 16, 32);
# 37, 150: end mid-block and mid-tile, 150 spans three 64-key tiles
SEQ_LENS = [37, 1, 0, 32, 150]
# (group, num_kv_heads, head_dim, block_size, num_splits): GQA 1/2/8, head_dim 64/80/128, block
# 16/8/32/5, splits 1 (direct write), 3 (merge), 8 (more splits than the short rows have tiles)
CASES = [
    (1, 2, 64, 16, 1),
    (2, 2, 80, 8, 3),
    (8, 1, 128, 16, 3),
    (1, 1, 128, 32, 8),
    (2, 1, 80, 5, 1),  # odd block size: tiles straddle many pages
]


def _skip_unless_runnable(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def _close(got: torch.Tensor, ref: torch.Tensor, head_dim: int, seq_lens, dtype: torch.dtype) -> None:
    """The kernel's reduction orders against the reference's (tests/tolerance.py); values stored in dtype."""
    assert_reduction_close(got.float(), ref.float(), attention_terms(head_dim, max(seq_lens)), storage=dtype,
                           roundings=2)


def _make_inputs(seq_lens, group, num_kv_heads, head_dim, block_size, dtype, device, seed,
                 table_dtype=torch.int32):
    """Shuffled non-contiguous blocks; every slot no sequence owns (tails of last blocks, spare blocks,
    the table's padding) holds NaN so reading one poisons the result. q is a strided view of a packed
    qkv tensor."""
    g = torch.Generator().manual_seed(seed)
    num_heads = group * num_kv_heads
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 2  # padded tables
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks, never referenced by live positions
    perm = torch.randperm(num_blocks, generator=g)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    nan_block = int(perm[-1])
    tables = torch.full((len(seq_lens), max_blocks), nan_block, dtype=torch.int64)
    used = 0
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        ids = perm[used:used + nb]
        used += nb
        tables[b, :nb] = ids
        pos = torch.arange(n)
        k_cache[ids[pos // block_size], pos % block_size] = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v_cache[ids[pos // block_size], pos % block_size] = torch.randn(n, num_kv_heads, head_dim, generator=g)
    qkv = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, head_dim, generator=g)
    q = qkv.to(dtype=dtype, device=device)[:, :num_heads]  # [B, H, D] view, row stride (H + 2Hkv) * D
    assert not q.is_contiguous()
    return (q, k_cache.to(dtype=dtype, device=device), v_cache.to(dtype=dtype, device=device),
            tables.to(dtype=table_dtype, device=device),
            torch.tensor(seq_lens, dtype=table_dtype, device=device))


def _naive(q, k_cache, v_cache, tables, seq_lens, scale):
    """Per sequence, per head: gather the keys in order, softmax(q.k * scale) @ v, in float64."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(batch, num_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        pos = torch.arange(n)
        blocks = tables[b].long()[pos // block_size]
        k = k_cache[blocks, pos % block_size].double()  # [n, Hkv, D]
        v = v_cache[blocks, pos % block_size].double()
        for h in range(num_heads):
            kv_h = h // (num_heads // num_kv_heads)
            w = torch.softmax(k[:, kv_h] @ q[b, h].double() * scale, dim=0)  # [n]
            out[b, h] = w @ v[:, kv_h]
    return out


@pytest.mark.parametrize("group,num_kv_heads,head_dim,block_size,num_splits", CASES)
@pytest.mark.parametrize("device", devices)
def test_decode_matches_reference(device, group, num_kv_heads, head_dim, block_size, num_splits):
    _skip_unless_runnable(device)
    dtypes = CPU_DTYPES if device == "cpu" else CUDA_DTYPES
    for i, dtype in enumerate(dtypes):
        q, k_cache, v_cache, tables, seq_lens = _make_inputs(
            SEQ_LENS, group, num_kv_heads, head_dim, block_size, dtype, device,
            seed=hash((group, num_kv_heads, head_dim, block_size, num_splits, i)) % 2**31)
        scale = head_dim ** -0.5
        out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
        got = paged_attention_decode(q, k_cache, v_cache, tables, seq_lens, scale, num_splits=num_splits,
                                     max_seq_len=max(SEQ_LENS), out=out)
        assert got is out
        ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, seq_lens, scale)
        assert torch.isfinite(ref).all()
        _close(got, ref, head_dim, SEQ_LENS, dtype)
        assert (got[SEQ_LENS.index(0)] == 0).all()  # padding row written with zeros


@pytest.mark.parametrize("device", devices)
def test_split_count_does_not_change_the_result(device):
    """Many more splits than a short row has tiles (empty splits must weigh nothing), int64 tables,
    out=None, and num_splits chosen by the launcher from max_seq_len or the table width."""
    _skip_unless_runnable(device)
    dtype = torch.float32
    seq_lens = [3, 0, 200]
    q, k_cache, v_cache, tables, lens = _make_inputs(seq_lens, 2, 1, 64, 16, dtype, device, seed=7,
                                                     table_dtype=torch.int64)
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, 0.125)
    for num_splits in (1, 2, 5, 16, None):
        got = paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.125, num_splits=num_splits)
        assert got.shape == q.shape and got.dtype == dtype
        _close(got, ref, 64, seq_lens, dtype)
        assert (got[1] == 0).all()


@pytest.mark.parametrize("device", devices)
def test_all_rows_empty_write_zeros(device):
    _skip_unless_runnable(device)
    q, k_cache, v_cache, tables, lens = _make_inputs([0, 0], 2, 1, 64, 16, torch.float32, device, seed=3)
    for num_splits in (1, 4):
        out = torch.full(q.shape, float("nan"), device=device)
        paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.1, num_splits=num_splits, out=out)
        assert (out == 0).all()


@pytest.mark.parametrize("group,num_kv_heads,block_size", [(1, 2, 16), (2, 2, 8), (8, 1, 32), (3, 2, 5)])
def test_reference_matches_naive_softmax(group, num_kv_heads, block_size):
    seq_lens = [37, 1, 0, 32, 150, 64]
    q, k_cache, v_cache, tables, lens = _make_inputs(seq_lens, group, num_kv_heads, 80, block_size,
                                                     torch.float32, "cpu", seed=block_size * 10 + group)
    scale = 80 ** -0.5
    expect = _naive(q, k_cache, v_cache, tables, lens, scale)
    for max_seq_len in (None, max(seq_lens)):
        ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale, max_seq_len=max_seq_len)
        assert_reduction_close(ref.double(), expect, attention_terms(80, max(seq_lens)), torch.float32, roundings=2)
    out = torch.full(q.shape, float("nan"))
    assert paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale, out=out) is out
    assert_reduction_close(out.double(), expect, attention_terms(80, max(seq_lens)), torch.float32, roundings=2)


def test_choose_num_splits_is_a_sane_host_int():
    assert choose_num_splits(4, 2, 1, "cpu") == 1
    assert choose_num_splits(4, 2, 300, "cpu") == 1
    for max_seq_len in (1, 100, 1000, 5000, 100_000):
        n = choose_num_splits(2, 2, max_seq_len, torch.device("cpu"))
        assert isinstance(n, int) and 1 <= n <= 8


def test_split_count_follows_occupancy_on_cuda(monkeypatch):
    """The CUDA rule without a GPU (an H100's 132 SMs): few sequences get many splits, many get few,
    every split has keys, and the programs fill the GPU whenever the context has keys enough."""
    from types import SimpleNamespace

    import vlm_sdk.kernels.paged_attention_decode as pad
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda")
    # Qwen2.5-VL-3B (2 KV heads), graphs captured at max_model_len 4096
    assert [choose_num_splits(b, 2, 4096, cuda) for b in (1, 8, 64)] == [64, 32, 5]
    for batch in (1, 2, 3, 8, 16, 64, 256):
        for kv_heads in (1, 2, 4, 8):
            for max_len in (1, 15, 16, 100, 2048, 4096, 32768, 128000):
                n = choose_num_splits(batch, kv_heads, max_len, cuda)
                pieces = -(-max_len // pad.SPLIT_ALIGN)
                assert 1 <= n <= min(pad._MAX_SPLITS, pieces)
                # no split is left empty by the longest sequence
                assert (n - 1) * -(-pieces // n) < pieces
                programs = batch * kv_heads * n
                if n < min(pad._MAX_SPLITS, pieces) // 2:  # not capped: enough programs for the GPU
                    assert programs >= pad.PROGRAMS_PER_SM * 132 // 2, (batch, kv_heads, max_len, n)


def test_launcher_rejects_bad_inputs():
    q = torch.randn(2, 4, 64)
    cache = torch.randn(4, 16, 2, 64)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    bad = [
        dict(q=torch.randn(2, 3, 64)),  # 3 heads over 2 KV heads
        dict(q=torch.randn(2, 4, 32)),  # head_dim mismatch
        dict(q=torch.randn(2, 4, 128)[..., ::2]),  # last dim not contiguous
        dict(v_cache=torch.randn(4, 16, 2, 64, dtype=torch.float16)),
        dict(block_tables=torch.zeros(3, 3, dtype=torch.int32)),
        dict(block_tables=torch.zeros(2, 3)),  # float table
        dict(seq_lens=torch.ones(3, dtype=torch.int32)),
        dict(out=torch.empty(2, 4, 64, dtype=torch.float16)),
        dict(num_splits=0),
    ]
    for override in bad:
        args = dict(q=q, k_cache=cache, v_cache=cache, block_tables=tables, seq_lens=lens, scale=0.1)
        args.update(override)
        with pytest.raises(ValueError):
            paged_attention_decode(**args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_qwen_shape_and_graph_capture(dtype):
    """Qwen2.5-VL-3B decode shape (H 16, Hkv 2, D 128) at long context, then the launcher captured in a
    CUDA graph with a fixed num_splits and replayed for other lengths (no host sync allowed)."""
    seq_lens = [4096, 4000, 17, 1, 0, 2048, 3333, 64] * 2
    q, k_cache, v_cache, tables, lens = _make_inputs(seq_lens, 8, 2, 128, 16, dtype, "cuda", seed=11)
    q = q.contiguous()  # graph inputs must stay at fixed addresses: own a plain buffer
    scale = 128 ** -0.5
    num_splits = choose_num_splits(len(seq_lens), 2, 4096, "cuda")
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale)
    got = paged_attention_decode(q, k_cache, v_cache, tables, lens, scale, num_splits=num_splits)
    _close(got, ref, 128, seq_lens, dtype)

    out = torch.full_like(q, float("nan"))
    paged_attention_decode(q, k_cache, v_cache, tables, lens, scale, num_splits=num_splits, out=out)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention_decode(q, k_cache, v_cache, tables, lens, scale, num_splits=num_splits, out=out)
    lens.copy_(torch.tensor([n // 3 for n in seq_lens], dtype=lens.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale)
    _close(out, ref, 128, seq_lens, dtype)
