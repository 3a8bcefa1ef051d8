"""The "triton" attention backend: the Triton kernels of `vlm_sdk.kernels` (CUDA, or the CPU under
TRITON_INTERPRET=1): `store_kv`, then `paged_attention_decode` (every query length 1) or
`paged_prefill_attention`; `varlen_attention` within segments.

Per step (`prepare`): a decode step's grid splits each context into `num_splits` parts, chosen once
from the batch size and `max_seq_len`. A CUDA-graph decode step is prepared with max_model_len as
`max_seq_len`, so each captured batch size gets one fixed grid that serves every length.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import AttentionMetadata
# imported when the backend is chosen (selector.make_backend), so that TRITON_INTERPRET is read then
from vlm_sdk.kernels import paged_attention_decode, paged_prefill_attention, store_kv, varlen_attention


@dataclass(frozen=True)
class TritonMetadata(AttentionMetadata):
    num_splits: int | None = None  # decode steps: parts each context is split into; None otherwise


class TritonBackend(AttentionBackend):
    name = "triton"
    graph_safe = True

    def prepare(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> TritonMetadata:
        splits = None
        if meta.decode_only:
            splits = paged_attention_decode.choose_num_splits(meta.num_seqs, k_cache.shape[2], meta.max_seq_len,
                                                              k_cache.device)
        return TritonMetadata(**meta.fields(), num_splits=splits)

    def forward(self, q, k, v, layer, kv_cache, meta):
        if not isinstance(meta, TritonMetadata):
            raise TypeError("the triton attention backend needs the metadata of its prepare(meta, k_cache), "
                            f"called once per step; got {type(meta).__name__}")
        k_cache, v_cache = kv_cache
        store_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            return paged_attention_decode.paged_attention_decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, layer.scale, num_splits=meta.num_splits,
                max_seq_len=meta.max_seq_len)  # [N, H, D]
        return paged_prefill_attention.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len,
            layer.scale)  # [N, H, D]

    def segments(self, lengths, device):
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)  # [S + 1]
        return cu.to(device), max(lengths)

    def segment_forward(self, q, k, v, layer, plan):
        cu_seqlens, max_seqlen = plan
        return varlen_attention.varlen_attention(q, k, v, cu_seqlens, max_seqlen, layer.scale)
