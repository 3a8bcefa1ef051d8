"""Compile every Triton kernel variant the engine can launch before the first request (CUDA only).

Triton compiles a kernel the first time it meets a new specialisation (its constexprs, and ints equal
to 1 or divisible by 16): 1-3 s per variant, a stall in the middle of serving. The kernels do not
specialise the ints that vary per step (`do_not_specialize`: split counts, block-table strides, the
positions' row stride; tests/kernels/test_no_recompile.py), so what is left to vary per model is a
handful of constexpr choices, and this warm-up runs each once through the real model forward:

    prefill, short and long chunk   the prefill kernel (one tile shape: queries x the GQA group)
    mixed: 1 decode row + a chunk   short and long chunk (the backend's mixed path, whatever it launches)
    decode, short context           one split: the decode kernel writes the output directly
    decode, long context            several splits + the merge kernel
    every CUDA-graph batch size     compiled by the capture's own eager pass; replayed once here

The norms (with and without the residual add), rotary_store_kv (the decoder's rotary and K/V store in
one kernel) and silu_and_mul run inside each of these; the sampler's draw, its top-p cut and the structured-output mask run once on the last step's logits. The vision tower's kernels are compiled by the CUDA memory profile, which encodes the largest
image (`Worker.profile_peak`, before this); a small image's full-attention segment of <= 64 patches
(Qwen3-VL has no windows) would still compile the 64-row varlen tile on first use.

The steps write K/V into cache blocks from block 0 up: nothing owns a block before the first request.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.sample.token_mask import apply_token_bitmask

from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.worker.step_metadata import synthetic_step_metadata

logger = logging.getLogger("vlm_sdk")

# the prefill / varlen tile changes at 64 query rows (kernels/flash_config.py)
SHORT_CHUNK = 16
LONG_CHUNK = 128
# long enough for the decode launcher to split the context on the CPU too (512 keys per split there)
LONG_CONTEXT = 4096


@dataclass(frozen=True)
class WarmupStep:
    what: str
    query_lens: tuple[int, ...]  # new tokens per sequence
    seq_lens: tuple[int, ...]  # tokens in the cache after the step, per sequence


def warmup_steps(max_model_len: int, max_num_batched_tokens: int, cache_tokens: int) -> list[WarmupStep]:
    """The steps that reach every variant, sized within the engine's limits and the cache."""
    limit = min(max_model_len, cache_tokens)
    long_chunk = max(1, min(LONG_CHUNK, max_num_batched_tokens - 1, limit - 1))
    short_chunk = max(1, min(SHORT_CHUNK, long_chunk))
    long_context = max(2, min(LONG_CONTEXT, limit))
    steps = [WarmupStep("prefill short", (short_chunk,), (short_chunk,)),
             WarmupStep("prefill long", (long_chunk,), (long_chunk,))]
    for chunk in sorted({short_chunk, long_chunk}):
        steps.append(WarmupStep(f"mixed, chunk {chunk}", (1, chunk), (long_context, min(limit, 2 * chunk))))
    steps += [WarmupStep("decode short", (1,), (1,)),
              WarmupStep("decode long", (1, 1), (long_context, long_context // 2))]
    return steps


def _step_inputs(step: WarmupStep, block_size: int, position_rows: int, device: torch.device):
    """(input ids, positions [rows, N], metadata) of a step whose sequences all use blocks 0, 1, ..."""
    width = max(-(-s // block_size) for s in step.seq_lens)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(step.query_lens, step.seq_lens)])  # [N]
    num_tokens = positions.shape[0]
    meta = AttentionMetadata(
        slot_mapping=positions.to(device),  # blocks 0.. in order: slot == position
        query_start_loc=torch.tensor([0, *step.query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device),
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.arange(width, dtype=torch.int32, device=device).expand(len(step.seq_lens), -1).contiguous(),
        query_lens_cpu=list(step.query_lens), seq_lens_cpu=list(step.seq_lens),
        max_query_len=max(step.query_lens), max_seq_len=max(step.seq_lens))
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    return ids, positions.to(device).expand(position_rows, -1), meta  # positions [rows, N]


@torch.inference_mode()
def run_warmup(runner, *, max_model_len: int, max_num_batched_tokens: int) -> float:
    """Run every warm-up step through `runner`'s model (any device); seconds taken."""
    t0 = time.perf_counter()
    model, caches, layout = runner.model, runner.caches, runner.layout
    k_cache = caches[layout.attention_groups[0].layers[0]][0]  # [num_blocks, block_size, Hkv, D]
    cache_tokens = k_cache.shape[0] * k_cache.shape[1]
    for step in warmup_steps(max_model_len, max_num_batched_tokens, cache_tokens):
        ids, positions, meta = _step_inputs(step, runner.block_size, model.position_rows, runner.device)
        hidden = model(model.embed_tokens(ids), positions, caches,
                       synthetic_step_metadata(layout, caches, runner.attention, meta))
        logits = model.compute_logits(hidden[-len(step.seq_lens):])  # [seqs, vocab]
    # the sampler's kernels on those logits: the draw and the structured-output mask (no token kept)
    runner.sampler.sample(logits, [SamplingParams(temperature=1.0, seed=0)] * logits.shape[0],
                          [([0], 1, ())] * logits.shape[0])
    # top-p alone: the nucleus cut past the candidates (kernels/top_p_cut.py) runs for every such batch
    runner.sampler.sample(logits, [SamplingParams(temperature=1.0, top_p=0.9)] * logits.shape[0])
    words = (logits.shape[1] + 31) // 32
    apply_token_bitmask(logits, [0], torch.full((1, words), -1, dtype=torch.int32))
    if runner.graphs is not None:
        for size in runner.graphs.sizes:
            graph = runner.graphs.graphs.get(size)
            if graph is not None:  # run right after capture: the buffers still hold their padding
                graph.replay()  # (slots -1, lengths 0), so the replay writes no cache slot
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0


def warm_up_kernels(runner, *, max_model_len: int, max_num_batched_tokens: int) -> float | None:
    """CUDA: compile every kernel variant before serving (`run_warmup`); seconds, or None elsewhere
    (the CPU's interpreter compiles nothing)."""
    if runner.device.type != "cuda":
        return None
    seconds = run_warmup(runner, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    logger.info("Triton kernels warmed up in %.1f s", seconds)
    return seconds
