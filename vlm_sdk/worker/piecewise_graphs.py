"""Piecewise CUDA graphs: any step (prefill, chunked prefill, mixed) replayed from graphs around the
attention calls, which run eagerly between them (vLLM's piecewise cudagraph idea).

A decode-only step has one fixed attention shape per batch size, so `cuda_graphs.DecodeGraphs` captures
the whole forward. A step with prefill rows does not: its attention grid depends on the chunks (the
prefill tile list, the decode rows' split). Everything else in a layer is row-wise and depends only on
the token count, so per token-count bucket N this captures L + 1 pieces of a decoder of L layers:

    piece 0      rotary inputs, layer 0's pre-attention half (norm, qkv, rotary)        -> q, k, v, residual
    piece i      layer i-1's post-attention half (o_proj, add+norm, MLP), layer i's pre half
    piece L      layer L-1's post half, the final add+norm                              -> hidden [N, hidden]

and between pieces runs `layer.attn` (store_kv + the backend's kernels) eagerly on the step's n <= N real
rows, with the step's own prepared metadata, writing into the bucket's attention buffer that the next
piece reads. Rows n..N are padding: zero embeddings and positions, never stored (the attention sees only
the first n rows) and never read back. Launches per step: L + 1 graph replays plus the attention calls,
instead of ~L * 14 kernel launches.

The pieces are `LlamaDecoderLayer.pre_attention` / `post_attention` (models/common/llama_decoder.py),
the same code the plain forward runs, so `capture=False` (same buffers, run eagerly: the CPU test) equals
the plain forward. Not covered: DeepStack (Qwen3-VL adds image features at step-dependent rows after the
first layers: such steps run the plain forward), and tensor parallelism is untested here.

Memory: each bucket keeps its pieces' outputs alive (q/k/v/residual per layer boundary, from the graphs'
shared pool, largest bucket first so the smaller ones reuse it).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from vlm_sdk.attention.metadata import AttentionMetadata

logger = logging.getLogger("vlm_sdk")


def piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token-count buckets: powers of two from 16, then the budget itself (padding at most 2x)."""
    sizes, n = [], 16
    while n < max_num_batched_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_num_batched_tokens]


class PiecewiseGraphs:
    """`run(embeds, positions, meta)` for any step of at most `sizes[-1]` tokens; `decoder` is a
    `LlamaDecoder`, `meta` the attention backend's prepared metadata for the step's real rows."""

    def __init__(self, decoder, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *, max_num_batched_tokens: int,
                 position_rows: int, device: torch.device, dtype: torch.dtype, capture: bool = True):
        self.decoder, self.kv_caches = decoder, kv_caches
        self.sizes = piecewise_sizes(max_num_batched_tokens)
        biggest = self.sizes[-1]
        layer = decoder.layers[0]
        hidden = decoder.cfg.hidden_size
        self.embeds = torch.zeros(biggest, hidden, dtype=dtype, device=device)  # [biggest, hidden]
        shape = (position_rows, biggest) if position_rows > 1 else (biggest,)
        self.positions = torch.zeros(shape, dtype=torch.int64, device=device)  # [rows, biggest] or [biggest]
        # what the attention writes and the next piece reads (rows past a step's n: stale padding, never read back)
        self.attn = torch.zeros(biggest, layer.num_heads, layer.head_dim, dtype=dtype,
                                device=device)  # [biggest, H, D]
        self.capture = capture
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, list[tuple]] = {}
        self.capture_seconds = 0.0
        if capture:
            self._capture_all(device)

    def covers(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _pieces(self, size: int) -> list[Callable[[tuple], tuple]]:
        """The L + 1 pieces of bucket `size`; each takes the previous piece's outputs (() for piece 0)."""
        dec = self.decoder
        layers = dec.layers
        embeds, positions, attn = self.embeds[:size], self.positions[..., :size], self.attn[:size]

        def first(_prev):
            rope = dec.ops.rotary_inputs(positions, dec.rotary, embeds.dtype)
            return (rope, *layers[0].pre_attention(embeds, None, rope))

        def middle(i):
            def piece(prev):
                rope, residual = prev[0], prev[4]
                x, residual = layers[i - 1].post_attention(attn, residual)
                return (rope, *layers[i].pre_attention(x, residual, rope))
            return piece

        def last(prev):
            x, residual = layers[-1].post_attention(attn, prev[4])
            return (dec.ops.add_rms_norm(x, residual, dec.norm.weight, dec.norm.eps)[0],)
        return [first] + [middle(i) for i in range(1, len(layers))] + [last]

    def _attend(self, i: int, prev: tuple, n: int, meta: AttentionMetadata) -> None:
        """Layer i's attention on the step's n real rows, eagerly, into the attention buffer."""
        _, q, k, v, _ = prev
        out = self.decoder.layers[i].attn(q[:n], k[:n], v[:n], self.kv_caches[i], meta)  # [n, H, D]
        self.attn[:n].copy_(out)

    def _eager(self, size: int, n: int, meta: AttentionMetadata) -> tuple:
        pieces, outs = self._pieces(size), []
        prev: tuple = ()
        for i, piece in enumerate(pieces):
            prev = piece(prev)
            outs.append(prev)
            if i < len(pieces) - 1:
                self._attend(i, prev, n, meta)
        return outs

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        """Per bucket, largest first (the smaller ones reuse its pool): a warm-up pass (Triton compiles
        outside the capture), then each piece captured on its own. The attention does not run during
        the capture: the pieces' outputs are fixed buffers whatever it writes."""
        t0 = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            pieces = self._pieces(size)
            prev: tuple = ()
            for piece in pieces:  # warm-up
                prev = piece(prev)
            torch.cuda.synchronize(device)
            graphs, outs, prev = [], [], ()
            for piece in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    prev = piece(prev)
                pool = graph.pool()
                graphs.append(graph)
                outs.append(prev)
            self.graphs[size], self.outputs[size] = graphs, outs
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured piecewise CUDA graphs for %d token counts %s in %.1f s", len(self.sizes), self.sizes,
                    self.capture_seconds)

    @torch.inference_mode()
    def run(self, embeds: torch.Tensor,  # [n, hidden]
            positions: torch.Tensor,  # [rows, n] or [n]
            meta: AttentionMetadata) -> torch.Tensor:  # [n, hidden], after the final norm
        n = embeds.shape[0]
        size = self.size_for(n)
        self.embeds[:n].copy_(embeds)
        self.embeds[n:size].zero_()
        self.positions[..., :n].copy_(positions)
        self.positions[..., n:size].zero_()
        if size not in self.graphs:
            return self._eager(size, n, meta)[-1][0][:n]
        graphs, outs = self.graphs[size], self.outputs[size]
        for i, graph in enumerate(graphs):
            graph.replay()
            if i < len(graphs) - 1:
                self._attend(i, outs[i], n, meta)
        return outs[-1][0][:n]
