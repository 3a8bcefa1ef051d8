"""Decode steps replayed from CUDA graphs: one graph per batch size in `capture_sizes`.

A decode step of a 3B model launches some 400 small kernels (36 layers x norm, matmuls, rotary,
store, attention...). Launched one by one from Python that is several ms of CPU time per step, more
than the GPU needs to read the weights; a graph replays them all with one launch.

A graph replays fixed addresses and a fixed grid, so every input lives in a static buffer sized for
the largest batch, and a step of `n` sequences runs the graph of the smallest captured size >= n with
the rows past `n` padded:

    rows        0 .. n-1 (real)              n .. size-1 (padding)
    input_ids   the new tokens               0
    slot        their cache slots            -1   (store_kv skips it: no cache write); one row per
                                                  attention cache group
    table_rows  their rows in `tables`       0    (read only up to seq_len: not at all)
    seq_lens    their lengths                0    (paged_attention_decode writes zeros)
    token_src   -1, or the row of `sampled_tokens` holding the token (asynchronous scheduling)   -1
    state_slot  their live state slots       -1   (a state layer neither reads nor writes it); only for a
                                                  model with state layers
    positions   their positions              0

The graph ends with the step's logits and their argmax: `logits` (a static float32 `[biggest, vocab]`
buffer: the compute_logits cast writes straight into it) and the greedy tokens, written into
`sampled_tokens`. A step whose rows are all greedy (no penalties, logprobs or grammar held) takes its
tokens from there with no sampler launch and no copy (`ModelRunner`); any other step samples from
`logits`, and the sampler's tokens overwrite the argmax in `sampled_tokens` (`ModelRunner._keep`).

These are views of ONE int64 device buffer (`inputs`: the rows above, `row_*` naming where), and the runner
packs a step straight into a pinned host copy of it (`stage`): the step's inputs reach the graph in
one host-to-device copy, padding included. The block tables are not copied per step at all: they
live in `tables` (`BlockTables`: one row per request, updated only where blocks are added) and the
graph gathers the step's rows itself (`index_select` by `table_rows`, captured with the rest), as it
converts the lengths to int32.

Under asynchronous scheduling a step is packed before the previous one's tokens reach the host: the
runner copies each step's sampled tokens into `sampled_tokens` (a static device buffer) and marks a
row whose token is still on the device with its index there (`token_src`); the graph picks those ids
itself (`torch.where`, captured), so no host sync and no extra copy sits between two steps.

The attention grid splits each context into `num_splits` parts fixed per size: each size's metadata
is prepared by the attention backend (`AttentionBackend.prepare`, the hook the runner calls every
step) with max_model_len as max_seq_len; the kernel sizes the parts from each sequence's own length,
so one grid serves every length. Steps the graphs do not cover (prefill chunks, batches larger than the largest size) run
eagerly. With `capture=False` the same buffers and padding run eagerly: the CPU tests use that to check
the padding path that the graphs replay.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import StateMetadata, StepMetadata
from vlm_sdk.protocol.blocks import blocks_needed
from vlm_sdk.protocol.cache_layout import CacheLayout
from vlm_sdk.worker.block_table import BlockTables
from vlm_sdk.worker.step_metadata import step_metadata

logger = logging.getLogger("vlm_sdk")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (always included): padding wastes at most 7 rows."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(self, model, caches: list[tuple[torch.Tensor, ...]], layout: CacheLayout, *, max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device, attention: AttentionBackend,
                 capture: bool = True):
        self.model, self.caches, self.layout, self.attention = model, caches, layout, attention
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        biggest = self.sizes[-1]
        self.max_blocks = max_blocks = blocks_needed(max_model_len, block_size)
        groups = self.num_groups = layout.num_attention_groups
        self.row_table, self.row_len, self.row_src = 1 + groups, 2 + groups, 3 + groups
        self.row_state = 4 + groups if layout.has_state else None
        self.row_pos = 4 + groups + layout.has_state
        rows = self.row_pos + model.position_rows
        self.inputs = torch.zeros(rows, biggest, dtype=torch.int64, device=device)  # [rows, biggest]
        self.input_ids = self.inputs[0]  # [biggest] each
        self.slot_mapping = self.inputs[1:1 + groups]  # [groups, biggest]
        self.table_rows, self.seq_lens, self.token_src = (self.inputs[r] for r in (self.row_table, self.row_len,
                                                                                   self.row_src))
        self.state_slots = None if self.row_state is None else self.inputs[self.row_state]  # [biggest]
        self.positions = self.inputs[self.row_pos:]  # [position_rows, biggest]
        self.sampled_tokens = torch.zeros(biggest, dtype=torch.int64, device=device)  # the last step's, by row
        self.logits = torch.zeros(biggest, model.vocab_size, dtype=torch.float32, device=device)  # [biggest, vocab]
        self.tables = BlockTables(biggest, max_blocks, device, num_groups=groups)  # the runner's: a row per request
        self.query_start_loc = torch.arange(biggest + 1, dtype=torch.int32, device=device)
        self.has_state = torch.ones(biggest, dtype=torch.bool, device=device)  # a decode row always continues one
        self._padding(self.inputs)  # what the graphs hold between steps too
        pin = device.type == "cuda"
        # two host copies used in turns: step t's copy may still be in flight while step t+1 is staged
        self._host = [torch.zeros(rows, biggest, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        for host in self._host:
            self._padding(host)  # a graph reads only its size's columns
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        if capture:
            self._capture_all(device)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _padding(self, buf) -> None:
        """Padding in every column: slots -1 (no cache write), ids from input_ids, state slot -1."""
        buf[1:1 + self.num_groups] = -1  # a tensor or its pinned host copy's numpy view
        buf[self.row_src] = -1
        if self.row_state is not None:
            buf[self.row_state] = -1

    def _meta(self, size: int) -> StepMetadata:
        tables = self.tables.device_table.index_select(1, self.table_rows[:size])  # [groups, size, max_blocks]
        common = dict(query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size].int(),
                      query_lens_cpu=[1] * size, seq_lens_cpu=[self.max_model_len] * size,
                      max_query_len=1, max_seq_len=self.max_model_len)  # fixed per size: one grid for every length
        state = None if self.state_slots is None else StateMetadata(
            self.query_start_loc[:size + 1], [1] * size, self.state_slots[:size], self.has_state[:size],
            [True] * size, 1)
        return step_metadata(self.layout, self.caches, self.attention, common, self.slot_mapping[:, :size], tables,
                             state)

    def _input_ids(self, size: int) -> torch.Tensor:  # [size] int64
        src = self.token_src[:size]  # [size]
        return torch.where(src >= 0, self.sampled_tokens.index_select(0, src.clamp(min=0)), self.input_ids[:size])

    def _forward(self, size: int) -> torch.Tensor:  # [size, hidden]
        embeds = self.model.embed_tokens(self._input_ids(size))
        hidden = self.model(embeds, self.positions[:, :size], self.caches, self._meta(size))
        self.logits_and_argmax(hidden)
        return hidden

    def logits_and_argmax(self, hidden: torch.Tensor) -> None:  # hidden [size, hidden]
        """The graph's tail: the logits into `logits`, their argmax into `sampled_tokens` (after the
        step's ids were read from it)."""
        size = hidden.shape[0]
        logits = self.model.compute_logits(hidden, out=self.logits[:size])  # [size, vocab]
        torch.argmax(logits, dim=-1, out=self.sampled_tokens[:size])

    @torch.inference_mode()
    def _capture_all(self, device: torch.device) -> None:
        t0 = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            self._forward(size)  # warm-up: Triton compiles and autotunes outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.sizes), self.sizes,
                    self.capture_seconds)

    def covers(self, batch: int) -> bool:
        return batch <= self.max_batch

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def stage(self, n: int) -> np.ndarray:  # [rows, size] int64, a pinned host view
        """The host copy to pack a step of `n` sequences into, columns `n..size` already padded: fill
        `[0, :n]` ids, `[1:1 + groups, :n]` slots, `[row_table, :n]` table rows, `[row_len, :n]` lengths,
        `[row_src, :n]` token sources (-1: the id in row 0), `[row_state, :n]` state slots (state layers),
        `[row_pos:, :n]` positions, then `run(n)`."""
        host = self._host[self._turn].numpy()
        size = self.size_for(n)
        if n < size:
            host[:, n:size] = 0
            self._padding(host[:, n:size])
        return host[:, :size]

    @torch.inference_mode()
    def run(self, n: int) -> torch.Tensor:  # [n, hidden]
        """Copy the staged step into the graph's inputs (one copy) and replay the graph of its size."""
        size = self.size_for(n)
        host = self._host[self._turn]
        self._turn ^= 1
        self.inputs.copy_(host, non_blocking=True)  # all of it: ~(4 + rows) * 8 B a row, one contiguous copy
        self.tables.flush()  # block ids added since the last step: only those entries
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]
