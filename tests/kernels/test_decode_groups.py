"""Batched decode attention groups sequences of very different lengths; results equal attending to
each sequence alone."""
import torch

from tolerance import assert_reduction_close, attention_terms
from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.kernels.paged_attention import decode_groups, decode_layout, paged_attention

BLOCK, HKV, GROUP, D = 4, 2, 3, 8


def _meta(seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_lens_cpu=[1] * n, seq_lens_cpu=list(seq_lens), max_query_len=1, max_seq_len=max(seq_lens))


def _attend(q, k_cache, v_cache, meta: AttentionMetadata, layout=None):
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_lens_cpu,
                           meta.seq_lens_cpu, 0.3, layout=layout)


def test_decode_groups_split_only_wide_length_spreads():
    assert decode_groups([300, 290, 310, 305]) == [[1, 0, 3, 2]]
    assert decode_groups([280, 800, 290, 810]) == [[0, 2], [1, 3]]
    assert len(decode_groups([1, 2, 4, 8, 16, 32, 64, 128])) == 4  # capped


def test_grouped_decode_equals_each_sequence_alone():
    g = torch.Generator().manual_seed(0)
    seq_lens = [5, 40, 7, 100, 33, 64, 6]
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered, non-contiguous blocks
    tables, used = [], 0
    for n in seq_lens:
        nb = -(-n // BLOCK)
        tables.append(perm[used:used + nb])
        used += nb
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=g)
    q = torch.randn(len(seq_lens), HKV * GROUP, D, generator=g)
    meta = _meta(seq_lens, tables)
    layout = decode_layout(meta.block_tables, meta.seq_lens, meta.seq_lens_cpu, BLOCK)
    assert len(layout) > 1
    out = _attend(q, k_cache, v_cache, meta, layout)
    torch.testing.assert_close(_attend(q, k_cache, v_cache, meta), out, atol=0, rtol=0)  # built when not given
    for i, (n, table) in enumerate(zip(seq_lens, tables)):
        alone = _attend(q[i:i + 1], k_cache, v_cache, _meta([n], [table]))
        assert_reduction_close(out[i:i + 1], alone, attention_terms(D, n), roundings=2)
