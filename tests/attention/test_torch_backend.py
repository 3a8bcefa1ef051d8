"""The torch attention backend prepares its per-step metadata once (`prepare`), into a frozen object of its
own; the layers read it and write nothing back."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.attention.torch_backend import TorchBackend, TorchMetadata


def test_decode_layout_is_prepared_once_per_step_by_the_torch_backend():
    """The torch backend builds the decode groups in `prepare` (once per step), into its own frozen
    metadata; layers read it and write nothing back."""
    class Layer:
        scale = 0.3
        window = None  # full attention
        k_scale = v_scale = torch.tensor(1.0)  # read only by an FP8 cache

    torch.manual_seed(0)
    blocks, bs, hkv, d = 8, 4, 2, 8
    k_cache, v_cache = torch.randn(blocks, bs, hkv, d), torch.randn(blocks, bs, hkv, d)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 14]), query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([6, 3], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1], [3, 0]], dtype=torch.int32),
        query_lens_cpu=[1, 1], seq_lens_cpu=[6, 3], max_query_len=1, max_seq_len=6)
    backend = TorchBackend()
    prepared = backend.prepare(meta, k_cache)
    assert isinstance(prepared, TorchMetadata) and prepared.decode_layout is not None
    layout = prepared.decode_layout
    q = torch.randn(2, 4, d)
    k, v = torch.randn(2, hkv, d), torch.randn(2, hkv, d)
    out = backend.forward(q, k, v, Layer(), (k_cache, v_cache), prepared)
    assert prepared.decode_layout is layout
    with pytest.raises(TypeError, match="prepare"):
        backend.forward(q, k, v, Layer(), (k_cache, v_cache), meta)  # not prepared
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.decode_layout = None
    # the same as attending sequence by sequence
    for i, (table, n) in enumerate(((meta.block_tables[0], 6), (meta.block_tables[1], 3))):
        k = k_cache[table.long()].reshape(-1, hkv, d)[:n].repeat_interleave(2, dim=1)  # [n, H, D]
        v = v_cache[table.long()].reshape(-1, hkv, d)[:n].repeat_interleave(2, dim=1)
        ref = torch.softmax(torch.einsum("hd,nhd->hn", q[i], k) * 0.3, -1)
        torch.testing.assert_close(out[i], torch.einsum("hn,nhd->hd", ref, v))
