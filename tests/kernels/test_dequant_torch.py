"""The published int4 packings and FP8 scale layouts, read by kernels/dequant_torch.py, against the formats'
definitions written out element by element (AutoAWQ's interleaved order, GPTQ's sequential order and "+1"
zero convention, FP8 block scales with a partial last block), and compressed-tensors' W4A16 pack-quantized
layout against the compressed-tensors package itself."""
import pytest
import torch

from vlm_sdk.kernels.dequant_torch import (AWQ_ORDER, awq_pack, awq_unpack, dequantize_awq, dequantize_fp8_block,
                                           dequantize_gptq, dequantize_w4a16, pack_int4, unpack_int4)
from vlm_sdk.testing.quantizer import quantization_config, quantize_w4a16


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


@pytest.mark.parametrize("group_size, sym", [(16, True), (16, False), (-1, True), (-1, False)],
                         ids=["group-sym", "group-asym", "channel-sym", "channel-asym"])
def test_w4a16_layout_is_compressed_tensors_own(group_size, sym):
    """compressed-tensors (the package that defines pack-quantized) both ways on the reference quantizer's
    bfloat16 tensors: its decompressor reads them to exactly our weight (rounded to the scales' dtype, as
    its dequantize computes), and its compressor, given that weight, the scales and the signed zero
    points, writes back the same weight_packed / weight_zero_point words; its QuantizationConfig takes
    the quantizer's config.json entry."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    scheme = QuantizationConfig.model_validate(quantization_config("w4a16", group_size=group_size, sym=sym)
                                               ).config_groups["group_0"]
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    t = quantize_w4a16(w, group_size, sym=sym, actorder=False)
    assert t["weight_scale"].dtype == torch.bfloat16 and t["weight_shape"].tolist() == [24, 64]
    ours = dequantize_w4a16(t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), None)
    theirs = PackedQuantizationCompressor.decompress(dict(t), scheme)["weight"]
    assert torch.equal(theirs, ours.to(torch.bfloat16))
    state = {"weight": theirs, "weight_scale": t["weight_scale"]}
    if not sym:
        state["weight_zero_point"] = (unpack_int4(t["weight_zero_point"], 0) - 8).to(torch.int8)  # signed
    packed = PackedQuantizationCompressor.compress(state, scheme)
    assert sorted(packed) == sorted(t)
    for name in t:
        assert torch.equal(packed[name], t[name]), name


def test_w4a16_actorder_group_index_picks_each_columns_scale_and_zero():
    """actorder "group" (weight_g_idx), element by element: W[n, k] = (q[n, k] - z[n, g]) * s[n, g],
    g = g_idx[k], every value stored + 8 and the zeros packed along the output."""
    q, z = _values(8, 32, 5), _values(8, 4, 6)  # out 8, in 32, 4 groups
    s = torch.rand(8, 4, generator=torch.Generator().manual_seed(7))
    g_idx = torch.randperm(32, generator=torch.Generator().manual_seed(8)).to(torch.int32) // 8
    w = dequantize_w4a16(pack_int4(q, 1), s, pack_int4(z, 0), g_idx)
    for n in range(8):
        for k in range(32):
            g = int(g_idx[k])
            assert w[n, k] == (q[n, k] - z[n, g]).float() * s[n, g]
    symmetric = dequantize_w4a16(pack_int4(q, 1), s, None, None)  # the zero is 8; groups k // 8
    assert torch.equal(symmetric, (q - 8).float() * s.repeat_interleave(8, 1))
