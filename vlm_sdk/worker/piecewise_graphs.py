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

The pieces are the model contract's decoder stack (`DecoderStack`, models/base.py: each layer's
`pre_attention` / `post_attention`, the rotary inputs, the final norm), the same code the plain forward
runs, so `capture=False` (same buffers, run eagerly: the CPU test) equals the plain forward. The runner
wraps the model from outside: a step goes through here when the model gives its `stack_inputs` (not a
DeepStack step of Qwen3-VL, whose image features join between layers: those run `forward`), and tensor
parallelism is untested here. A family without a decoder stack runs every step through `forward`.

Memory: the pieces hand over through fixed buffers sized for the largest bucket (q, k, v: the attention's
inputs; the residual stream; the attention's output), copied at each piece's end, so a piece's own
temporaries are dead once it ends and the graphs' shared pool reuses them for the next piece: held
are those buffers, one piece's temporaries and each bucket's rotary inputs and final hidden states,
not L layers' worth of activations.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from vlm_sdk.attention.metadata import StepMetadata
from vlm_sdk.memory.consumers.piecewise import piecewise_sizes
from vlm_sdk.models.base import DecoderStack
from vlm_sdk.protocol.cache_layout import CacheLayout

logger = logging.getLogger("vlm_sdk")


def piecewise_stack(model, wanted: bool, tp_size: int, layout: CacheLayout) -> DecoderStack | None:
    """The decoder stack piecewise graphs run, when `wanted` (piecewise_cuda_graphs on a device that
    captures graphs) with one rank; None otherwise. A model that declares no stack (a family with a
    decoder of its own), or whose layers are not all attention layers (a state layer has no attention
    call to split around), still runs, every step eagerly or from whole-step decode graphs: logged
    once, at start-up."""
    if not wanted or tp_size != 1:
        return None
    if layout.has_state:
        logger.warning("piecewise_cuda_graphs: %s has state layers (%s), which piecewise graphs do not split: steps "
                       "with prefill rows run eagerly, decode steps from whole-step CUDA graphs",
                       type(model).__name__, layout.describe())
        return None
    stack = model.decoder_stack()
    if stack is None:
        logger.warning("piecewise_cuda_graphs: %s declares no decoder stack (models/base.py DecoderStack): steps "
                       "with prefill rows run eagerly, decode steps from whole-step CUDA graphs",
                       type(model).__name__)
    return stack


class PiecewiseGraphs:
    """`run(embeds, positions, meta)` for any step of at most `sizes[-1]` tokens; `stack` is the model's
    `DecoderStack`, `meta` the attention backend's prepared metadata for the step's real rows."""

    def __init__(self, stack: DecoderStack, caches: list[tuple[torch.Tensor, torch.Tensor]], *,
                 max_num_batched_tokens: int, device: torch.device, dtype: torch.dtype, capture: bool = True):
        self.stack, self.caches = stack, caches
        self.sizes = piecewise_sizes(max_num_batched_tokens)
        biggest = self.sizes[-1]
        layer = stack.layers[0]
        hidden = stack.hidden_size
        self.embeds = torch.zeros(biggest, hidden, dtype=dtype, device=device)  # [biggest, hidden]
        # what the stack takes: [3, N] for M-RoPE, [N] for plain RoPE
        shape = (3, biggest) if stack.position_rows == 3 else (biggest,)
        self.positions = torch.zeros(shape, dtype=torch.int64, device=device)  # [rows, biggest] or [biggest]
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        # the hand-over between pieces and the attention (rows past a step's n: stale padding, never read back)
        self.q = torch.zeros(biggest, h, d, dtype=dtype, device=device)  # [biggest, H, D]
        self.k = torch.zeros(biggest, hkv, d, dtype=dtype, device=device)  # [biggest, Hkv, D]
        self.v = torch.zeros(biggest, hkv, d, dtype=dtype, device=device)  # [biggest, Hkv, D]
        self.residual = torch.zeros(biggest, hidden, dtype=dtype, device=device)  # [biggest, hidden]
        self.attn = torch.zeros(biggest, h, d, dtype=dtype, device=device)  # [biggest, H, D]
        self.capture = capture
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, tuple] = {}  # size -> (its rotary inputs, its final hidden states)
        self.capture_seconds = 0.0
        if capture:
            self._capture_all(device)

    def covers(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _pieces(self, size: int) -> list[Callable[[tuple], tuple]]:
        """The L + 1 pieces of bucket `size`. Piece 0 returns the rotary inputs (shared by the later
        pieces: they take it as their argument); the others return nothing but the last, which returns
        the final hidden states [size, hidden]."""
        stack = self.stack
        layers = stack.layers
        embeds, positions = self.embeds[:size], self.positions[..., :size]
        q_buf, k_buf, v_buf, res_buf, attn = (t[:size] for t in (self.q, self.k, self.v, self.residual, self.attn))

        def hand_over(q, k, v, residual):
            q_buf.copy_(q)
            k_buf.copy_(k)
            v_buf.copy_(v)
            res_buf.copy_(residual)

        def first(_rope):
            rope = stack.rotary_inputs(positions, embeds.dtype)
            hand_over(*layers[0].pre_attention(embeds, None, rope))
            return rope

        def middle(i):
            def piece(rope):
                x, residual = layers[i - 1].post_attention(attn, res_buf)
                hand_over(*layers[i].pre_attention(x, residual, rope))
            return piece

        def last(_rope):
            x, residual = layers[-1].post_attention(attn, res_buf)
            return stack.final_norm(x, residual)
        return [first] + [middle(i) for i in range(1, len(layers))] + [last]

    def _attend(self, i: int, n: int, meta: StepMetadata) -> None:
        """Layer i's attention on the step's n real rows, eagerly, with its group's metadata, into the
        attention buffer."""
        out = self.stack.layers[i].attn(self.q[:n], self.k[:n], self.v[:n], self.caches[i], meta.layer(i))  # [n, H, D]
        self.attn[:n].copy_(out)

    def _eager(self, size: int, n: int, meta: StepMetadata) -> torch.Tensor:  # [size, hidden]
        pieces = self._pieces(size)
        rope = pieces[0](None)
        for i, piece in enumerate(pieces[1:]):
            self._attend(i, n, meta)
            out = piece(rope)
        return out

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        """Per bucket, largest first (the smaller ones reuse its pool): a warm-up pass (Triton compiles
        outside the capture), then each piece captured on its own. The attention does not run during
        the capture: the pieces' outputs are fixed buffers whatever it writes."""
        t0 = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            pieces = self._pieces(size)
            rope = pieces[0](None)  # warm-up
            for piece in pieces[1:]:
                piece(rope)
            torch.cuda.synchronize(device)
            graphs = []
            for i, piece in enumerate(pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    result = piece(rope)
                if i == 0:
                    rope = result  # the captured rotary inputs, read by every later piece
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[size], self.outputs[size] = graphs, (rope, result)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured piecewise CUDA graphs for %d token counts %s in %.1f s", len(self.sizes), self.sizes,
                    self.capture_seconds)

    @torch.inference_mode()
    def run(self, embeds: torch.Tensor,  # [n, hidden]
            positions: torch.Tensor,  # [rows, n] or [n]
            meta: StepMetadata) -> torch.Tensor:  # [n, hidden], after the final norm
        n = embeds.shape[0]
        size = self.size_for(n)
        self.embeds[:n].copy_(embeds)
        self.embeds[n:size].zero_()
        self.positions[..., :n].copy_(positions)
        self.positions[..., n:size].zero_()
        if size not in self.graphs:
            return self._eager(size, n, meta)[:n]
        graphs = self.graphs[size]
        for i, graph in enumerate(graphs):
            if i:
                self._attend(i - 1, n, meta)
            graph.replay()
        return self.outputs[size][1][:n]
