"""The "triton" attention backend: the Triton kernels of `vlm_sdk.kernels` (CUDA, or the CPU under
TRITON_INTERPRET=1): `store_kv`, then `paged_attention_decode` for the rows with one query and
`paged_prefill_attention` for the others; `varlen_attention` within segments.

Per step (`prepare`, host ints only, no device sync):
- decode rows (query length 1: decode tokens, and a chunk's last single token, which is the same math)
  go to the decode kernel, which reads each K/V tile once for the whole GQA group. Its grid splits each
  context into `num_splits` parts, chosen from the decode rows' count and longest length. A CUDA-graph
  decode step is prepared with max_model_len as `max_seq_len`, so each captured batch size gets one
  fixed grid that serves every length.
- the other rows go to the prefill kernel over the step's real (sequence, query tile) pairs only
  (`TritonMetadata.prefill_tiles`), each program holding all heads of one KV head (GQA packing).
A mixed step thus launches both kernels per layer. When the decode rows are the step's first rows (the
scheduler's order) they are views of the step's tensors; otherwise `prepare` gathers their table rows
and lengths once and each layer gathers their queries and scatters their outputs (two small copies).

An FP8 cache: every kernel takes the layer's k_scale / v_scale (device scalars, so CUDA graphs replay
them unchanged); the store quantizes, the attention kernels dequantize in registers. An int8 / int4
cache (a layer cache of four tensors: K and V codes, their scales and zeros) the same, with the per-token
scales and zeros the store writes beside the codes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import AttentionMetadata
# imported when the backend is chosen (selector.make_backend), so that TRITON_INTERPRET is read then
from vlm_sdk.kernels import paged_attention_decode, paged_prefill_attention, store_kv, varlen_attention


@dataclass(frozen=True)
class DecodeRows:
    """A step's decode rows (query length 1), as the decode kernel takes them."""
    num_rows: int
    token_index: torch.Tensor | None  # [Nd] int64 token row of each; None: they are tokens 0..Nd-1
    block_tables: torch.Tensor  # [Nd, max_blocks] int32, contiguous rows
    seq_lens: torch.Tensor  # [Nd] int32
    max_seq_len: int
    num_splits: int


@dataclass(frozen=True)
class TritonMetadata(AttentionMetadata):
    num_splits: int | None = None  # decode-only steps: parts each context is split into; None otherwise
    decode_rows: DecodeRows | None = None  # steps with prefill rows: their rows of query length 1
    prefill_tiles: torch.Tensor | None = None  # [T, 2] int32 (sequence, first query) of the prefill rows
    query_tile_len: int | None = None  # queries per prefill tile (`paged_prefill_attention.query_tile`)


class TritonBackend(AttentionBackend):
    name = "triton"
    graph_safe = True

    def prepare(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> TritonMetadata:
        device, num_kv_heads = k_cache.device, k_cache.shape[2]
        if meta.decode_only:  # a sliding-window group's rows read at most its window: fewer splits
            reach = paged_attention_decode.reach(meta.max_seq_len, meta.window)
            splits = paged_attention_decode.choose_num_splits(meta.num_seqs, num_kv_heads, reach, device)
            return TritonMetadata(**meta.fields(), num_splits=splits)
        decode = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
        prefill = [b for b, n in enumerate(meta.query_lens_cpu) if n > 1]
        rows = None
        if decode:
            rows = self._decode_rows(meta, decode, num_kv_heads, device)
        tile = paged_prefill_attention.query_tile(device, k_cache.dtype)
        tiles = paged_prefill_attention.prefill_tiles(meta.query_lens_cpu, tile, device, seqs=prefill)
        return TritonMetadata(**meta.fields(), decode_rows=rows, prefill_tiles=tiles, query_tile_len=tile)

    @staticmethod
    def _decode_rows(meta: AttentionMetadata, decode: list[int], num_kv_heads: int, device) -> DecodeRows:
        nd = len(decode)
        max_len = max(meta.seq_lens_cpu[b] for b in decode)
        splits = paged_attention_decode.choose_num_splits(nd, num_kv_heads, paged_attention_decode.reach(
            max_len, meta.window), device)
        if decode == list(range(nd)):  # the first rows: tokens 0..nd-1, views
            return DecodeRows(nd, None, meta.block_tables[:nd], meta.seq_lens[:nd], max_len, splits)
        seqs = torch.tensor(decode, dtype=torch.int64).to(device, non_blocking=True)  # [Nd]
        starts = meta.query_start_loc.index_select(0, seqs).long()  # [Nd] token row of each decode row
        return DecodeRows(nd, starts, meta.block_tables.index_select(0, seqs),
                          meta.seq_lens.index_select(0, seqs), max_len, splits)

    def forward(self, q, k, v, layer, kv_cache, meta, stored=False):
        if not isinstance(meta, TritonMetadata):
            raise TypeError("the triton attention backend needs the metadata of its prepare(meta, k_cache), "
                            f"called once per step; got {type(meta).__name__}")
        if layer.window != meta.window:
            raise ValueError(f"a layer of window {layer.window} got the metadata of a cache group of window "
                             f"{meta.window}: its cache spec and its attention disagree")
        k_cache, v_cache, *sz = kv_cache  # an int8 / int4 cache: (K, V, K scales+zeros, V scales+zeros)
        window = layer.window
        scales = {"k_scale": layer.k_scale, "v_scale": layer.v_scale}  # read only by an FP8 cache
        if sz:
            scales = {"k_sz": sz[0], "v_sz": sz[1]}
        if not stored:
            store_kv.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        if meta.decode_only:
            return paged_attention_decode.paged_attention_decode(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, layer.scale, num_splits=meta.num_splits,
                max_seq_len=meta.max_seq_len, window=window, **scales)  # [N, H, D]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [N, H, D]
        rows = meta.decode_rows
        if rows is not None:
            self._decode_part(q, k_cache, v_cache, layer.scale, rows, out, dict(scales, window=window))
        if meta.prefill_tiles.shape[0]:
            paged_prefill_attention.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.max_query_len,
                layer.scale, out=out, tiles=meta.prefill_tiles, query_tile_len=meta.query_tile_len, window=window,
                key_limits=meta.key_limits, **scales)
        return out

    @staticmethod
    def _decode_part(q, k_cache, v_cache, scale: float, rows: DecodeRows, out: torch.Tensor, scales: dict) -> None:
        """The decode kernel on a mixed step's query-length-1 rows, written into their rows of `out`
        (`scales`: the kernel's keyword arguments: the FP8 scales, the window)."""
        if rows.token_index is None:
            paged_attention_decode.paged_attention_decode(
                q[:rows.num_rows], k_cache, v_cache, rows.block_tables, rows.seq_lens, scale,
                num_splits=rows.num_splits, max_seq_len=rows.max_seq_len, out=out[:rows.num_rows], **scales)
            return
        o = paged_attention_decode.paged_attention_decode(
            q.index_select(0, rows.token_index), k_cache, v_cache, rows.block_tables, rows.seq_lens, scale,
            num_splits=rows.num_splits, max_seq_len=rows.max_seq_len, **scales)  # [Nd, H, D]
        out.index_copy_(0, rows.token_index, o)

    def segments(self, lengths, device):
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)  # [S + 1]
        return cu.to(device), max(lengths)

    def segment_forward(self, q, k, v, layer, plan):
        cu_seqlens, max_seqlen = plan
        return varlen_attention.varlen_attention(q, k, v, cu_seqlens, max_seqlen, layer.scale)
