"""Measure the activation peak of the largest step before sizing the KV cache on CUDA.

The cache gets what is left of `memory_utilization * total` after the weights and this peak, so the
profile must run the worst case the scheduler can produce, with everything that is alive at once:

    held images    the largest image's embeddings (`largest_image()` of the family's processor), kept
                   by a request across the chunks of its prefill while other steps run, or as many rows
                   as a video's items within a chunk's reach when more (`held_tokens`:
                   `MemoryInputs.held_vision_tokens`)
    LLM step       `max_num_batched_tokens` new tokens in one forward
    logits         `max_num_seqs` rows of the full vocabulary
    sampler        those rows through the sampler with every per-row edit on: penalties, temperature,
                   top-k, top-p and logprobs (its [rows, vocab] temporaries)
    vision tower   the largest image through it (its own peak, after the step)
    graph pool     with CUDA graphs: the memory pool the decode graphs keep for good, measured as the
                   peak of a decode forward of the largest captured batch (`graph_batch`) with its
                   logits and their argmax (the graphs compute them; their float32 logits buffer is as
                   large as this peak's), added on top, since eager steps run beside the pool
    piecewise      with piecewise graphs (`piecewise_tokens`): their fixed buffers and per-bucket outputs
                   (`memory.consumers.piecewise.held_bytes`, arithmetic) and their pool, bounded by the peak of a
                   plain forward of `piecewise_tokens` tokens (a piece is a part of one layer's work)

`ProfiledPeak` keeps the parts apart, each named as the memory consumer it measures (vlm_sdk/memory/
consumers/: activation, sampler, decode_graph_pool, piecewise_graphs); the engine sizes the KV cache from
them with vlm_sdk/memory/ (a consumer without a measured part counts its estimate). The sampler's part is
what logits and sampling add over the step's activations, so the parts add up to the step's peak.
`meter` measures memory: CUDA's
allocator statistics by default; the CPU tests pass one that counts live tensor bytes, so what is
counted is checked without a GPU.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.worker.kv_cache import allocate_caches
from vlm_sdk.worker.step_metadata import synthetic_step_metadata
from vlm_sdk.memory.consumers.piecewise import held_bytes
from vlm_sdk.protocol.blocks import blocks_needed
from vlm_sdk.protocol.cache_layout import CacheLayout
from vlm_sdk.sample.sampler import Sampler
from vlm_sdk.multimodal.inputs import ImageInput

# the sampler's worst row: every edit that makes a [rows, vocab] temporary
WORST_ROW = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5,
                           logprobs=5, max_tokens=16)


class CudaMeter:
    """Peak bytes allocated on a CUDA device since `reset()`, beyond what was allocated then."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


@dataclass(frozen=True)
class ProfiledPeak:
    """The measured parts, each named as the memory consumer it measures (vlm_sdk/memory/consumers/)."""
    activation_bytes: int  # held image + LLM step, or the vision tower: the larger peak
    sampler_bytes: int  # what the logits and the sampler's worst rows add on top of that peak
    graph_pool_bytes: int  # the decode graphs' pool (0 without graphs)
    piecewise_bytes: int = 0  # the piecewise graphs' buffers, outputs and pool (0 without them)

    @property
    def step_bytes(self) -> int:
        """The step's whole peak: activations, logits and sampler together."""
        return self.activation_bytes + self.sampler_bytes

    @property
    def total(self) -> int:
        return self.step_bytes + self.graph_pool_bytes + self.piecewise_bytes

    def parts(self) -> dict[str, int]:
        return {"activation": self.activation_bytes, "sampler": self.sampler_bytes,
                "decode_graph_pool": self.graph_pool_bytes, "piecewise_graphs": self.piecewise_bytes}


@torch.inference_mode()
def profile_peak(model, largest_image: ImageInput, *, num_tokens: int, num_seqs: int, block_size: int,
                 layout: CacheLayout, dtype: torch.dtype, device: torch.device, attention: AttentionBackend,
                 graph_batch: int | None = None, piecewise_tokens: int | None = None, held_tokens: int = 0,
                 meter=None) -> ProfiledPeak:
    """The worst-case step's peak (module docstring), the profile's own temporary cache excluded (`layout`:
    the model's cache groups; a state slot per sequence of its forwards). The sampler's part is what its
    phase adds over the activation peak, so the parts sum to the step's peak."""
    meter = meter or CudaMeter(device)
    meter.reset()
    blocks, slots = blocks_needed(num_tokens, block_size), max(1, graph_batch or 1)
    caches = allocate_caches(layout, blocks, block_size, slots if layout.has_state else 0, device)
    held = model.encode_images([largest_image])  # [image tokens, width]: held across chunks
    if held_tokens > held.shape[0]:  # a video's items within a chunk's reach: more rows of the same width
        held = [held, held.new_zeros(held_tokens - held.shape[0], held.shape[1])]  # [more rows, width]
    hidden = _forward(model, layout, caches, attention, [num_tokens], device)  # [num_tokens, hidden]
    forward_peak = meter.peak()
    rows = hidden[-1:].expand(num_seqs, -1).contiguous()  # [num_seqs, hidden]: max_num_seqs rows, however few tokens
    logits = model.compute_logits(rows)  # [num_seqs, vocab]
    _sample_worst(logits)
    with_sampler = meter.peak()
    del hidden, rows, logits, held
    meter.reset()  # the caches stay: the tower's peak is measured beyond them, as the step's is
    model.encode_images([largest_image])  # [image tokens, hidden]: the tower's own peak
    tower = max(0, meter.peak())
    kv = blocks * layout.block_bytes(block_size) + (slots * layout.state_slot_bytes if layout.has_state else 0)
    activation = max(forward_peak - kv, tower, 0)
    sampler = max(with_sampler - kv, tower, 0) - activation
    pool = 0
    if graph_batch:
        meter.reset()  # the caches stay: the pool is measured beyond them
        hidden = _forward(model, layout, caches, attention, [1] * graph_batch, device)  # [graph_batch, hidden]
        model.compute_logits(hidden).argmax(dim=-1)  # [graph_batch, vocab] float32, then [graph_batch]
        del hidden
        pool = max(0, meter.peak())
    piecewise = 0
    if piecewise_tokens:
        meter.reset()
        _forward(model, layout, caches, attention, [min(piecewise_tokens, blocks * block_size)], device)
        stack = model.decoder_stack()  # the worker builds piecewise graphs only for a model that has one
        layer = stack.layers[0]
        piecewise = max(0, meter.peak()) + held_bytes(
            piecewise_tokens, stack.hidden_size, layer.num_heads, layer.num_kv_heads, layer.head_dim,
            model.position_rows, dtype)
    del caches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ProfiledPeak(activation, sampler, pool, piecewise)


def _forward(model, layout: CacheLayout, caches, attention: AttentionBackend, query_lens: list[int],
             device) -> torch.Tensor:
    """One step of sequences with these new-token counts, each alone in consecutive blocks from 0
    (the profile's cache holds one sequence of the step's tokens; decode rows share its first slots)."""
    n = sum(query_lens)
    block_size = caches[layout.attention_groups[0].layers[0]][0].shape[1]
    seq_lens = query_lens if len(query_lens) == 1 else [1] * len(query_lens)
    width = blocks_needed(max(seq_lens), block_size)
    q_start = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # [B + 1]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device) if len(query_lens) == 1 else torch.zeros(n, dtype=torch.long,
                                                                                            device=device),
        query_start_loc=q_start.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.arange(width, dtype=torch.int32, device=device).expand(len(seq_lens), -1).contiguous(),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens))
    meta = synthetic_step_metadata(layout, caches, attention, meta)
    ids = torch.zeros(n, dtype=torch.long, device=device)
    positions = torch.arange(n, device=device).expand(model.position_rows, -1)  # [rows, n]
    return model(model.embed_tokens(ids), positions, caches, meta)  # [n, hidden]


def _sample_worst(logits: torch.Tensor) -> None:  # logits [rows, vocab]
    rows = logits.shape[0]
    histories = [([0, 1, 2, 3], 2, ()) for _ in range(rows)]  # two generated tokens: penalties apply
    sampler = Sampler(0)
    # the sampler's signature differs by whether rows pass their generators (issue 19 moves them)
    if "generators" in inspect.signature(sampler.sample).parameters:
        sampler.sample(logits, [WORST_ROW] * rows, [None] * rows, histories)
    else:
        sampler.sample(logits, [WORST_ROW] * rows, histories)
