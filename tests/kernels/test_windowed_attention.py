"""The paged attention kernels' sliding window and bidirectional spans (Gemma 3's local layers and image
tokens): Triton decode and prefill against their torch references under the interpreter (fp32, fp16), and
the references against a float64 formula written from transformers' mask (query p sees keys p - W < k <=
p, and an image token every key of its image in the chunk: AND(window, OR(causal, span))).

The blocks wholly before every query's window are freed as the engine frees them: their table entries are
-1 and the blocks themselves NaN, so a kernel that reads one shows NaN (or faults)."""
from __future__ import annotations

import os

import pytest
import torch

from tolerance import assert_reduction_close, attention_terms
from vlm_sdk.kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_ref
from vlm_sdk.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

CPU_DTYPES = [torch.float32, torch.float16]  # fp16: the interpreter's stand-in for bf16
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 16


def _skip_without_triton() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def _cache(seq_lens: list[int], window: int | None, seed: int):
    """A NaN-filled cache holding each sequence's K/V at shuffled blocks; with a window, the blocks wholly
    before the first key its earliest query reads (`firsts`) are let go: table -1, block NaN."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // BLOCK) for n in seq_lens]
    total = sum(per_seq) + 2
    perm = torch.randperm(total, generator=g)
    width = max(per_seq) + 1
    tables = torch.full((len(seq_lens), width), int(perm[-1]), dtype=torch.int32)  # padding: a NaN block
    k_cache = torch.full((total, BLOCK, KV_HEADS, HEAD_DIM), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for b, (n, nb) in enumerate(zip(seq_lens, per_seq)):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
        pos = torch.arange(n)
        k_cache[tables[b, pos // BLOCK].long(), pos % BLOCK] = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
        v_cache[tables[b, pos // BLOCK].long(), pos % BLOCK] = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
    return k_cache, v_cache, tables


def _free_before(k_cache, v_cache, tables, b: int, first_key: int, mark: int = -1) -> None:
    """Let go of sequence b's blocks wholly before key `first_key`, as the sliding-window manager does: the
    blocks NaN, their entries `mark` (-1, or a NaN block's id: a read of it shows as NaN for sure)."""
    for j in range(first_key // BLOCK):
        k_cache[tables[b, j].long()] = float("nan")
        v_cache[tables[b, j].long()] = float("nan")
        tables[b, j] = mark


def _naive(q, k_cache, v_cache, tables, q_lens, seq_lens, scale, window, limits):
    """Query by query, head by head, in float64, from the mask's definition."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // KV_HEADS
    row = 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for j in range(q_len):
            p = seq_len - q_len + j
            last = p if limits is None else max(p, int(limits[row]))
            keys = [k for k in range(last + 1) if window is None or k > p - window]
            pages = [int(tables[b, k // BLOCK]) for k in keys]
            for h in range(q.shape[1]):
                kk = torch.stack([k_cache[pg, k % BLOCK, h // group] for pg, k in zip(pages, keys)]).double()
                vv = torch.stack([v_cache[pg, k % BLOCK, h // group] for pg, k in zip(pages, keys)]).double()
                w = torch.softmax(kk @ q[row, h].double() * scale, 0)
                out[row, h] = w @ vv
            row += 1
    return out


# (seq_lens, window): shorter than the window, exactly it, longer (the window cutting a block and not)
DECODE = [([5, 16, 40, 77, 130], 16), ([9, 33, 64, 100], 20), ([1, 2, 300], 7), ([64, 128], 64)]


@pytest.mark.parametrize("seq_lens, window", DECODE)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_decode_window_equals_the_reference(seq_lens, window, splits, dtype):
    _skip_without_triton()
    k_cache, v_cache, tables = _cache(seq_lens, window, seed=len(seq_lens) + window)
    mark = -1 if splits == 1 else int(tables[0, -1])  # the padding block: NaN
    for b, n in enumerate(seq_lens):
        _free_before(k_cache, v_cache, tables, b, max(0, n - window), mark)
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    scale = HEAD_DIM ** -0.5
    args = (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, torch.tensor(seq_lens, dtype=torch.int32), scale)
    ref = paged_attention_decode_ref(*args, window=window)
    assert not ref.isnan().any()
    naive = _naive(q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, scale, window, None)
    assert_reduction_close(ref.double(), naive, attention_terms(HEAD_DIM, window), storage=dtype, roundings=2)
    got = paged_attention_decode(*args, num_splits=splits, window=window)
    assert_reduction_close(got.float(), ref.float(), attention_terms(HEAD_DIM, window), storage=dtype, roundings=2)


def _prefill_case(q_lens, seq_lens, window, spans, dtype, seed, mark=-1):
    """q packed over the chunks; `spans` [(first, last)]: packed rows first..last are one image."""
    k_cache, v_cache, tables = _cache(seq_lens, window, seed)
    if window is not None:
        mark = mark if mark == -1 else int(tables[0, -1])
        for b, (ql, n) in enumerate(zip(q_lens, seq_lens)):
            _free_before(k_cache, v_cache, tables, b, max(0, n - ql - window + 1), mark)
    num = sum(q_lens)
    q = torch.randn(num, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1))
    limits = None
    if spans is not None:
        positions = torch.cat([torch.arange(n - ql, n) for ql, n in zip(q_lens, seq_lens)])
        limits = positions.clone()
        for first, last in spans:
            limits[first:last + 1] = positions[last]
        limits = limits.to(torch.int32)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_cache, v_cache, tables, cu, limits


# (q_lens, seq_lens, window, image spans as packed (first, last) rows)
PREFILL = {
    "whole_prompts": ([40, 9, 77], [40, 9, 77], 16, None),
    "chunks_past_the_window": ([20, 33, 5], [52, 140, 64], 12, None),
    "window_wider_than_everything": ([20, 6], [30, 6], 512, None),
    "images_no_window": ([30, 20], [30, 45], None, [(3, 12), (30 + 4, 30 + 19)]),
    "images_and_window": ([40, 25], [40, 70], 12, [(2, 17), (20, 35), (40 + 0, 40 + 15)]),
    "image_longer_than_the_window": ([50], [90], 8, [(10, 29)]),
    "mixed_decode_rows": ([1, 30, 1], [50, 30, 9], 10, [(1 + 5, 1 + 24)]),
}


@pytest.mark.parametrize("name", list(PREFILL))
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_prefill_window_and_spans_equal_the_reference(name, dtype):
    _skip_without_triton()
    q_lens, seq_lens, window, spans = PREFILL[name]
    mark = -1 if dtype == torch.float32 else "nan_block"
    q, k_cache, v_cache, tables, cu, limits = _prefill_case(q_lens, seq_lens, window, spans, dtype, len(name), mark)
    scale = HEAD_DIM ** -0.5
    args = (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables, cu, torch.tensor(seq_lens, dtype=torch.int32),
            max(q_lens), scale)
    ref = paged_prefill_attention_ref(*args, window=window, key_limits=limits)
    assert not ref.isnan().any()
    naive = _naive(q, k_cache, v_cache, tables, q_lens, seq_lens, scale, window, limits)
    terms = attention_terms(HEAD_DIM, max(seq_lens))
    assert_reduction_close(ref.double(), naive, terms, storage=dtype, roundings=2)
    got = paged_prefill_attention(*args, window=window, key_limits=limits)
    assert_reduction_close(got.float(), ref.float(), terms, storage=dtype, roundings=2)


def test_spans_change_the_image_rows_only():
    """The span mask is not a no-op: image rows differ from causal attention, text rows do not."""
    _skip_without_triton()
    q_lens, seq_lens, window, spans = PREFILL["images_and_window"]
    q, k_cache, v_cache, tables, cu, limits = _prefill_case(q_lens, seq_lens, window, spans, torch.float32, 3)
    args = (q, k_cache, v_cache, tables, cu, torch.tensor(seq_lens, dtype=torch.int32), max(q_lens), HEAD_DIM ** -0.5)
    causal = paged_prefill_attention(*args, window=window)
    both = paged_prefill_attention(*args, window=window, key_limits=limits)
    differs = (both - causal).abs().amax((1, 2)) > 1e-4  # [N]
    last_rows = {last for _, last in spans}
    image_rows = {r for first, last in spans for r in range(first, last)}  # an image's last row sees nothing new
    assert {int(r) for r in differs.nonzero()} == image_rows and not (last_rows & image_rows)


def test_bad_windows_and_limits_are_refused():
    q = torch.zeros(3, HEADS, HEAD_DIM)
    k_cache, v_cache, tables = _cache([3], None, 0)
    args = (q, k_cache, v_cache, tables, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 3, 1.0)
    with pytest.raises(ValueError, match="window must be a positive"):
        paged_prefill_attention_ref(*args, window=0)
    with pytest.raises(ValueError, match="key_limits must be contiguous int32"):
        paged_prefill_attention_ref(*args, key_limits=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="window must be a positive"):
        paged_attention_decode(q[:1], k_cache, v_cache, tables, torch.tensor([3], dtype=torch.int32), 1.0, window=-1)
