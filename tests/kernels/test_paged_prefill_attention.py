"""paged_prefill_attention (Triton) against its torch reference, and the reference against a naive formula.

The cache is filled with NaN before this test's K/V are written into it (plain torch indexing), block-table
padding points at NaN-only blocks, and `out` is NaN-poisoned: reading a key past seq_len, a wrong page, or leaving
an output element unwritten all show up as NaN."""
import math
import os

import pytest
import torch

from tolerance import assert_reduction_close, attention_terms
from vlm_sdk.kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

devices = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                              pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device")])]

# fp16 on the CPU: the interpreter's stand-in for bf16 (its bf16 tl.dot is wrong: numpy has no bf16)
CPU_DTYPES = [torch.float32, torch.float16]
# (q_lens, seq_lens): each chunk is the tail of its sequence
CASES = {
    # whole prompts: not a block multiple, a single token, ending exactly on a block boundary
    "whole_prompts": ([37, 1, 16, 48], [37, 1, 16, 48]),
    # chunked prefill / prefix hits: context ends on a block boundary, mid-block, and chunk ends on one
    "chunked": ([20, 33, 17], [52, 80, 64]),
    # decode rows (q_len 1) beside a prompt, a chunk and a q_len 0 row
    "mixed_decode": ([1, 40, 0, 1, 7], [29, 40, 10, 64, 90]),
    "single_token": ([1], [1]),
}
# (num_heads, num_kv_heads, head_dim, block_size): GQA 1/2/8, head_dim 64/80/128, block size 16 and others
CONFIGS = [(4, 4, 64, 16), (4, 2, 80, 16), (8, 1, 128, 16), (4, 2, 128, 32), (2, 1, 80, 8)]
EXTRA_BLOCKS = 3  # unassigned, NaN-only blocks: the block-table padding points at them


def _skip_without_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def _make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed):
    """Packed strided q, a NaN-poisoned paged cache holding each sequence's K/V at shuffled blocks, and the
    metadata."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + EXTRA_BLOCKS
    perm = torch.randperm(num_blocks, generator=g)  # non-contiguous, out-of-order pages
    spare = perm[sum(blocks_per_seq):]
    width = max(blocks_per_seq) + 2
    block_tables = spare[torch.randint(0, EXTRA_BLOCKS, (len(seq_lens), width), generator=g)]
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[b, :nb] = perm[used:used + nb]
        used += nb
        pos = torch.arange(n)
        blocks, offsets = block_tables[b, pos // block_size], pos % block_size
        k_cache[blocks, offsets] = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v_cache[blocks, offsets] = torch.randn(n, num_kv_heads, head_dim, generator=g)
    num_tokens = sum(q_lens)
    # q as a view of a packed qkv projection, as the model hands it over
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g)
    q = qkv.to(device=device, dtype=dtype)[:, :num_heads]  # [N, H, D], row stride (H + 2Hkv) * D
    cu_seqlens_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return (q, k_cache.to(device=device, dtype=dtype), v_cache.to(device=device, dtype=dtype),
            block_tables.to(device=device, dtype=torch.int32), cu_seqlens_q,
            torch.tensor(seq_lens, dtype=torch.int32, device=device))


def _naive(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale):
    """Token by token, head by head, in float64: softmax(q . k_p * scale) over p <= position, times v."""
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_len = cu[b + 1] - cu[b]
        for j in range(q_len):
            position = seq_len - q_len + j
            pages = [int(block_tables[b, p // block_size]) for p in range(position + 1)]
            for h in range(q.shape[1]):
                keys = torch.stack([k_cache[pages[p], p % block_size, h // group] for p in range(position + 1)])
                values = torch.stack([v_cache[pages[p], p % block_size, h // group] for p in range(position + 1)])
                weights = torch.softmax(keys.double() @ q[cu[b] + j, h].double() * scale, 0)  # [position + 1]
                out[cu[b] + j, h] = weights @ values.double()
    return out


@pytest.mark.parametrize("case", ["whole_prompts", "chunked", "mixed_decode"])
def test_reference_matches_naive_formula(case):
    q_lens, seq_lens = CASES[case]
    batch = _make_batch(q_lens, seq_lens, 2, 1, 16, 8, torch.float32, "cpu", seed=1)
    out = paged_prefill_attention_ref(*batch, max(q_lens), 0.3)
    assert_reduction_close(out.double(), _naive(*batch, 0.3), attention_terms(16, max(seq_lens)), torch.float32,
                           roundings=2)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "h{}_kv{}_d{}_bs{}".format(*c))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("device", devices)
def test_kernel_matches_reference(device, case, config):
    _skip_without_triton(device)
    num_heads, num_kv_heads, head_dim, block_size = config
    q_lens, seq_lens = CASES[case]
    dtypes = CPU_DTYPES if device == "cpu" else [torch.bfloat16, torch.float16, torch.float32]
    for dtype in dtypes:
        batch = _make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                            seed=10 * list(CASES).index(case) + CONFIGS.index(config))
        scale = 1 / math.sqrt(head_dim)
        out = torch.full(batch[0].shape, float("nan"), dtype=dtype, device=device)
        result = paged_prefill_attention(*batch, max(q_lens), scale, out=out)
        assert result is out
        ref = paged_prefill_attention_ref(*batch, max(q_lens), scale)
        assert not out.isnan().any()
        assert_reduction_close(out.float(), ref.float(), attention_terms(head_dim, max(seq_lens)), dtype, roundings=2)


@pytest.mark.parametrize("device", devices)
def test_padded_max_query_len_and_allocated_out(device):
    """A max_query_len larger than any chunk (a captured CUDA graph's bound) only adds empty programs; without
    out= a contiguous output is allocated even though q is a strided view."""
    _skip_without_triton(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q_lens, seq_lens = [3, 1], [40, 9]
    batch = _make_batch(q_lens, seq_lens, 4, 2, 64, 16, dtype, device, seed=7)
    out = paged_prefill_attention(*batch, 100, 0.125)
    assert out.is_contiguous() and out.shape == batch[0].shape
    ref = paged_prefill_attention_ref(*batch, 100, 0.125)
    assert_reduction_close(out.float(), ref.float(), attention_terms(64, max(seq_lens)), dtype, roundings=2)


def test_rejects_bad_inputs():
    q, k_cache, v_cache, tables, cu, lens = _make_batch([2], [5], 4, 2, 64, 16, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="multiple"):
        paged_prefill_attention(q[:, :3], k_cache, v_cache, tables, cu, lens, 2, 0.1)
    with pytest.raises(ValueError, match="batch"):
        paged_prefill_attention(q, k_cache, v_cache, tables, cu[:1], lens, 2, 0.1)
    with pytest.raises(ValueError, match="out"):
        paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 2, 0.1, out=torch.empty(2, 4, 32))
    with pytest.raises(ValueError, match="int32"):
        paged_prefill_attention(q, k_cache, v_cache, tables.float(), cu, lens, 2, 0.1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_capture():
    """The launcher never synchronises with the host, so it can be captured and replayed with new lengths."""
    q_lens, seq_lens = [5, 1, 12], [30, 17, 12]
    q, k_cache, v_cache, tables, cu, lens = _make_batch(q_lens, seq_lens, 8, 2, 128, 16, torch.bfloat16,
                                                        "cuda", seed=3)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 16, 0.1, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 16, 0.1, out=out)
    lens.copy_(torch.tensor([20, 9, 12], dtype=torch.int32))  # shorter contexts, same chunks
    out.fill_(float("nan"))
    graph.replay()
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, lens, 16, 0.1)
    assert_reduction_close(out.float(), ref.float(), attention_terms(128, 30), torch.bfloat16, roundings=2)
