"""The "torch" attention backend: pure torch over the paged cache (`kernels/paged_attention.py`) and
within segments (`kernels/segment_attention.py`); the CPU default and the reference of the Triton one.

Per step and attention cache group (`prepare`): a decode step of several sequences groups them by length
and builds each group's flat block ids and key mask once (`TorchMetadata.decode_layout`), shared by
every layer of the group; a sliding-window group's reach only its window.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.kernels import paged_attention as torch_paged
from vlm_sdk.kernels import segment_attention as torch_segments


@dataclass(frozen=True)
class TorchMetadata(AttentionMetadata):
    # a batched decode step: groups of similar-length sequences (`kernels.paged_attention.DecodeGroup`);
    # None for any other step
    decode_layout: tuple[torch_paged.DecodeGroup, ...] | None = None


class TorchBackend(AttentionBackend):
    name = "torch"
    graph_safe = False  # batched decode groups sequences by their host-side lengths

    def prepare(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> TorchMetadata:
        layout = None
        if meta.decode_only and meta.num_seqs > 1:
            layout = torch_paged.decode_layout(meta.block_tables, meta.seq_lens, meta.seq_lens_cpu,
                                               k_cache.shape[1], meta.window)
        return TorchMetadata(**meta.fields(), decode_layout=layout)

    def forward(self, q, k, v, layer, kv_cache, meta, stored=False):
        if not isinstance(meta, TorchMetadata):
            raise TypeError("the torch attention backend needs the metadata of its prepare(meta, k_cache), "
                            f"called once per step; got {type(meta).__name__}")
        if layer.window != meta.window:
            raise ValueError(f"a layer of window {layer.window} got the metadata of a cache group of window "
                             f"{meta.window}: its cache spec and its attention disagree")
        k_cache, v_cache, *sz = kv_cache  # an int8 / int4 cache: (K, V, K scales+zeros, V scales+zeros)
        scales = {"k_scale": layer.k_scale, "v_scale": layer.v_scale}  # read only by an FP8 cache
        if sz:
            scales = {"k_sz": sz[0], "v_sz": sz[1]}
        if not stored:
            torch_paged.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        return torch_paged.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                           meta.query_lens_cpu, meta.seq_lens_cpu, layer.scale, k, v,
                                           layout=meta.decode_layout, window=layer.window,
                                           key_limits=meta.key_limits, **scales)  # [N, H, D]

    def segments(self, lengths, device):
        return torch_segments.segment_plan(lengths, device)

    def segment_forward(self, q, k, v, layer, plan):
        return torch_segments.segment_attention(q, k, v, plan, layer.scale)
