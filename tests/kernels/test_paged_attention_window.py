"""The torch paged attention of a sliding-window layer (kernels/paged_attention.py `window`) against dense
attention with the band mask (a query at p reads keys p - W < q <= p, HF's `sliding_window`): whole
prompts, prefill chunks, one decode row and batched decode, with the blocks before each window let go of
(-1 in the block table, as the engine leaves them) so that reading one would fail."""
import pytest
import torch
import torch.nn.functional as F

from vlm_sdk.kernels.paged_attention import decode_layout, paged_attention, write_kv_cache

BLOCK, HKV, GROUP, D = 4, 2, 2, 8


def _dense(q, k, v, positions, window, scale):  # q [n, H, D] at `positions`; k, v [L, Hkv, D]: keys 0..L-1
    keys = torch.arange(k.shape[0])[None, :]
    mask = (keys <= positions[:, None]) & (keys > positions[:, None] - window)  # [n, L]
    kk = k.repeat_interleave(GROUP, dim=1).transpose(0, 1)  # [H, L, D]
    vv = v.repeat_interleave(GROUP, dim=1).transpose(0, 1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=scale)  # [H, n, D]
    return o.transpose(0, 1)


def _case(seq_lens, query_lens, window, seed=0):
    """Sequences laid out in the cache one after the other; entries before each one's first needed block -1."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK) for n in seq_lens) + 1
    k_cache = torch.zeros(num_blocks, BLOCK, HKV, D)
    v_cache = torch.zeros(num_blocks, BLOCK, HKV, D)
    tables, keys, nxt = [], [], 1  # block 0 unused
    for n, q in zip(seq_lens, query_lens):
        blocks = list(range(nxt, nxt + -(-n // BLOCK)))
        nxt += len(blocks)
        k, v = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
        slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        write_kv_cache(k, v, k_cache, v_cache, slots)
        first = max(0, n - q - window + 1) // BLOCK
        tables.append([-1] * first + blocks[first:])
        keys.append((k, v))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(query_lens), HKV * GROUP, D, generator=g)
    return k_cache, v_cache, block_tables, keys, q


@pytest.mark.parametrize("seq_lens,query_lens,window", [
    ([13], [13], 5),  # a whole prompt longer than the window
    ([13], [13], 40),  # a window wider than the prompt: plain causal
    ([23, 9], [6, 9], 7),  # a prefill chunk after earlier blocks, beside a whole prompt
    ([30], [1], 6),  # one decode row
    ([30, 11, 17, 4], [1, 1, 1, 1], 6),  # batched decode, lengths around the window
])
def test_windowed_paged_attention_equals_dense_attention_with_the_band(seq_lens, query_lens, window):
    k_cache, v_cache, tables, keys, q = _case(seq_lens, query_lens, window)
    scale = D ** -0.5
    new_k = torch.cat([k[n - m:] for (k, _), n, m in zip(keys, seq_lens, query_lens)])  # this step's K/V
    new_v = torch.cat([v[n - m:] for (_, v), n, m in zip(keys, seq_lens, query_lens)])
    out = paged_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), list(query_lens),
                          list(seq_lens), scale, new_k, new_v, window=window)
    start = 0
    for (k, v), n, m in zip(keys, seq_lens, query_lens):
        ref = _dense(q[start:start + m], k, v, torch.arange(n - m, n), window, scale)
        torch.testing.assert_close(out[start:start + m], ref, rtol=1e-5, atol=1e-5)
        start += m


def test_the_window_decode_layout_gathers_only_each_rows_window():
    seq_lens = [30, 11, 4]
    _, _, tables, _, _ = _case(seq_lens, [1, 1, 1], 6)
    (group,) = decode_layout(tables, torch.tensor(seq_lens, dtype=torch.int32), seq_lens, BLOCK, window=6)
    # a window of 6 spans at most 3 blocks of 4 (whatever the host lengths: a graph's are max_model_len);
    # row 0 reads keys 24..29 (blocks 6, 7 of its table), row 1 keys 5..10 (its blocks 1, 2), row 2 all 4
    assert group.mask.shape[-1] == 3 * BLOCK and group.mask.sum().item() == 6 + 6 + 4
    assert group.blocks.view(3, 3)[0, :2].tolist() == tables[0, 6:8].tolist()
    assert group.blocks.view(3, 3)[1, :2].tolist() == tables[1, 1:3].tolist()
