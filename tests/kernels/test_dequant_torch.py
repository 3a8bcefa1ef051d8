"""The published int4 packings and FP8 scale layouts, read by kernels/dequant_torch.py, against the formats'
definitions written out element by element (AutoAWQ's interleaved order, GPTQ's sequential order and "+1"
zero convention, FP8 block scales with a partial last block)."""
import torch

from vlm_sdk.kernels.dequant_torch import (AWQ_ORDER, awq_pack, awq_unpack, dequantize_awq, dequantize_fp8_block,
                                           dequantize_gptq, pack_int4, unpack_int4)


def _values(rows, cols, seed=0):
    return torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def test_awq_word_holds_its_eight_columns_in_the_interleaved_order():
    v = _values(3, 16)
    words = awq_pack(v)
    assert words.shape == (3, 2) and words.dtype == torch.int32
    for r in range(3):
        for c in range(2):
            word = int(words[r, c]) & 0xFFFFFFFF
            # nibble i (bits 4i..4i+3) holds column 8c + AWQ_ORDER[i]
            assert [(word >> (4 * i)) & 0xF for i in range(8)] == [int(v[r, 8 * c + AWQ_ORDER[i]]) for i in range(8)]
    assert torch.equal(awq_unpack(words), v)


def test_gptq_words_run_in_order_along_their_dim():
    v = _values(16, 3, 1)
    words = pack_int4(v, 0)  # qweight: along the input rows
    assert words.shape == (2, 3)
    word = int(words[1, 2]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [int(v[8 + i, 2]) for i in range(8)]
    assert torch.equal(unpack_int4(words, 0), v)
    assert torch.equal(unpack_int4(pack_int4(v.t(), 1), 1), v.t())


def test_awq_dequantizes_each_group_with_its_zero_and_scale():
    q, z = _values(8, 16, 2), _values(2, 16, 3)  # in 8 rows, groups of 4
    s = torch.rand(2, 16, generator=torch.Generator().manual_seed(4)).half()
    w = dequantize_awq(awq_pack(q), awq_pack(z), s)
    expect = torch.empty(16, 8)
    for n in range(16):
        for k in range(8):
            expect[n, k] = (int(q[k, n]) - int(z[k // 4, n])) * float(s[k // 4, n])
    assert torch.equal(w, expect)


def test_gptq_adds_one_to_the_stored_zero_in_the_original_format_and_follows_g_idx():
    q, stored = _values(16, 8, 5), _values(2, 8, 6)
    s = torch.rand(2, 8, generator=torch.Generator().manual_seed(7)).half()
    g_idx = torch.tensor([1, 0] * 8, dtype=torch.int32)  # desc_act: groups in any order
    for offset in (1, 0):  # checkpoint_format gptq, gptq_v2
        w = dequantize_gptq(pack_int4(q, 0), pack_int4(stored, 1), s, g_idx, offset)
        for n in range(8):
            for k in range(16):
                g = int(g_idx[k])
                assert w[n, k] == (int(q[k, n]) - (int(stored[g, n]) + offset)) * float(s[g, n])


def test_fp8_block_scales_cover_a_partial_last_block():
    w = torch.randn(5, 7).to(torch.float8_e4m3fn)
    inv = torch.rand(2, 2) + 0.5  # ceil(5/4) x ceil(7/4)
    out = dequantize_fp8_block(w, inv, (4, 4))
    for n in range(5):
        for k in range(7):
            assert out[n, k] == w[n, k].float() * inv[n // 4, k // 4]
