"""Runs one scheduled step on the model: vision stage, LLM forward over the paged cache, sampling.

Inputs are packed: the new tokens of every scheduled sequence back to back. Image embeddings are
computed once per sequence (on the first step that needs them; the images of all such sequences go
through the vision tower in groups of at most `max_vision_patches` patches) and scattered into the token embeddings at image-token positions, chunk by chunk.
"""
from __future__ import annotations

import torch

from vlm_sdk.models.base import VisionLanguageModel
from vlm_sdk.engine.attention_metadata import AttentionMetadata
from vlm_sdk.engine.block_manager import slot_mapping
from vlm_sdk.engine.sampler import Sampler
from vlm_sdk.engine.scheduler import SchedulerOutput
from vlm_sdk.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: VisionLanguageModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 max_vision_patches: int | None = None):
        """`max_vision_patches` (None: no limit) caps the patches of one vision-tower call: the images
        of newly scheduled sequences are encoded in groups of at most that many patches (a group
        always holds at least one image), so a step never exceeds the profiled peak of one
        max_pixels image (`profiler.max_image_patches`)."""
        self.model = model
        self.max_vision_patches = max_vision_patches
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler(seed)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> dict[int, int]:
        """Compute the scheduled tokens; return {index in sched.scheduled: sampled token} for the
        sequences whose cached tokens caught up with all their tokens this step."""
        self._encode_images([seq for seq, _ in sched.scheduled if seq.needs_images and seq.image_embeds is None])
        input_ids, positions, meta, sample_rows, sample_idx = self._prepare(sched)
        embeds = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        self._scatter_image_embeds(sched, embeds)
        hidden = self.model(embeds, positions, self.kv_caches, meta)  # [num_tokens, hidden]
        if not sample_idx:
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])  # [num_sampled, vocab]
        seqs = [sched.scheduled[i][0] for i in sample_idx]
        tokens = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        return dict(zip(sample_idx, tokens))

    def _encode_images(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        images = [im for seq in seqs for im in seq.prompt.images]
        outs = []
        for group in _patch_groups([im.pixel_values.shape[0] for im in images], self.max_vision_patches):
            chosen = [images[i] for i in group]
            pixels = torch.cat([im.pixel_values for im in chosen]).to(self.device, self.dtype)  # [patches, dim]
            outs.append(self.model.encode_images(pixels, [im.grid_thw for im in chosen]))  # [tokens, hidden]
        embeds = outs[0] if len(outs) == 1 else torch.cat(outs)  # [image tokens, hidden], in image order
        for seq, part in zip(seqs, embeds.split([sum(seq.prompt.image_tokens) for seq in seqs])):
            seq.image_embeds = part

    def _prepare(self, sched: SchedulerOutput):
        ids, pos, slots, block_tables = [], [], [], []
        query_lens, seq_lens, sample_rows, sample_idx = [], [], [], []
        row = 0
        for i, (seq, n) in enumerate(sched.scheduled):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            pos.append(_positions(seq, start, end))
            slots.extend(slot_mapping(seq.block_ids, self.block_size, start, end))
            block_tables.append(seq.block_ids)
            query_lens.append(n)
            seq_lens.append(end)
            row += n
            if end == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_idx.append(i)
        width = max(len(b) for b in block_tables)
        tables = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int32)
        q_start = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            query_start_loc=q_start.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=tables.to(dev, non_blocking=True),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens))
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        positions = torch.cat(pos, dim=1).to(dev, non_blocking=True)  # [3, num_tokens]
        return input_ids, positions, meta, torch.tensor(sample_rows, device=dev), sample_idx

    def _scatter_image_embeds(self, sched: SchedulerOutput, embeds: torch.Tensor) -> None:
        row = 0
        for seq, n in sched.scheduled:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if seq.image_embeds is not None:
                index = seq.image_token_index  # [image tokens] prompt indices, ascending
                lo = int(torch.searchsorted(index, start))
                hi = int(torch.searchsorted(index, end))
                if hi > lo:
                    rows = (index[lo:hi] - start + row).to(embeds.device)
                    embeds[rows] = seq.image_embeds[lo:hi].to(embeds.dtype)
            row += n


def _patch_groups(patches: list[int], limit: int | None) -> list[range]:
    """Consecutive runs of image indices whose patches sum to at most `limit` (a run always holds at
    least one image, however large); one run of all images when there is no limit."""
    if limit is None:
        return [range(len(patches))]
    groups, start, total = [], 0, 0
    for i, n in enumerate(patches):
        if i > start and total + n > limit:
            groups.append(range(start, i))
            start, total = i, 0
        total += n
    groups.append(range(start, len(patches)))
    return groups


def _positions(seq: Sequence, start: int, end: int) -> torch.Tensor:
    """M-RoPE positions `[3, end - start]` of tokens start..end: the prompt's precomputed ones, then
    index + rope_delta on all three axes for generated tokens."""
    prompt = seq.prompt
    n_prompt = seq.num_prompt_tokens
    parts = []
    if start < n_prompt:
        if prompt.mrope_positions is not None:
            parts.append(prompt.mrope_positions[:, start:min(end, n_prompt)])
        else:
            parts.append(torch.arange(start, min(end, n_prompt)).expand(3, -1))
    if end > n_prompt:
        tail = torch.arange(max(start, n_prompt), end) + prompt.rope_delta
        parts.append(tail.expand(3, -1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
