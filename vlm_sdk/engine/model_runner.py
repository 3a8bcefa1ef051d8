"""Runs one scheduled step on the model: vision stage, LLM forward over the paged cache, sampling.

Inputs are packed: the new tokens of every scheduled sequence back to back. Image embeddings are
computed once per sequence (on the first step that needs them; the images of all such sequences go
through the vision tower in groups of at most `max_vision_patches` rows of `ImageInput.size`) and
scattered into the token embeddings at image-token positions, chunk by chunk. Images and positions
are the model family's business: the runner hands `ImageInput`s to `model.encode_images` and asks
`model.positions` for each sequence's `[position_rows, n]` positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.models.base import VisionLanguageModel
from vlm_sdk.engine.block_manager import slot_mapping
from vlm_sdk.engine.cuda_graphs import DecodeGraphs
from vlm_sdk.engine.sampler import Sampler
from vlm_sdk.engine.scheduler import SchedulerOutput
from vlm_sdk.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: VisionLanguageModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 max_vision_patches: int | None = None, graphs: DecodeGraphs | None = None, *,
                 attention: AttentionBackend):
        """`max_vision_patches` (None: no limit) caps the patches of one vision-tower call: the images
        of newly scheduled sequences are encoded in groups of at most that many patches (a group
        always holds at least one image), so a step never exceeds the profiled peak of one
        largest allowed image (`PromptProcessor.largest_image().size`). `attention` (the model's backend)
        prepares each step's attention metadata once, before the forward."""
        self.model = model
        self.attention = attention
        self.max_vision_patches = max_vision_patches
        self.graphs = graphs  # replays decode steps (CUDA graphs, or their padded path eagerly)
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
        step = self._prepare(sched)
        if self.graphs is not None and step.meta.decode_only and self.graphs.covers(len(sched.scheduled)) \
                and not any(seq.num_computed_tokens < seq.num_prompt_tokens for seq, _ in sched.scheduled):
            # generated tokens only: no image rows to scatter, so the captured forward covers it
            meta = step.meta
            hidden = self.graphs.run(step.input_ids, step.positions, meta.slot_mapping, meta.seq_lens,
                                     meta.block_tables)  # [num_seqs, hidden]
        else:
            embeds = self.model.embed_tokens(step.input_ids)  # [num_tokens, hidden]
            self._scatter_image_embeds(sched, embeds)
            hidden = self.model(embeds, step.positions, self.kv_caches, step.meta)  # [num_tokens, hidden]
        if not step.sample_idx:
            return {}
        logits = self.model.compute_logits(hidden[step.sample_rows])  # [num_sampled, vocab]
        seqs = [sched.scheduled[i][0] for i in step.sample_idx]
        tokens = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
        return dict(zip(step.sample_idx, tokens))

    def _encode_images(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        images = [im for seq in seqs for im in seq.prompt.images]
        outs = []
        for group in _patch_groups([im.size for im in images], self.max_vision_patches):
            outs.append(self.model.encode_images([images[i] for i in group]))  # [tokens, hidden]
        embeds = outs[0] if len(outs) == 1 else torch.cat(outs)  # [image tokens, hidden], in image order
        for seq, part in zip(seqs, embeds.split([sum(seq.prompt.image_tokens) for seq in seqs])):
            seq.image_embeds = part

    def _prepare(self, sched: SchedulerOutput) -> StepInputs:
        """Pack the step's inputs on the host and move them to the device in one copy."""
        ids, pos, slots, block_tables = [], [], [], []
        query_lens, seq_lens, sample_rows, sample_idx = [], [], [], []
        row = 0
        for i, (seq, n) in enumerate(sched.scheduled):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            pos.append(self.model.positions(seq.prompt, start, end))  # [position_rows, n]
            slots.extend(slot_mapping(seq.block_ids, self.block_size, start, end))
            block_tables.append(seq.block_ids)
            query_lens.append(n)
            seq_lens.append(end)
            row += n
            if end == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_idx.append(i)
        num_tokens, batch = row, len(query_lens)
        width = max(len(b) for b in block_tables)
        q_start = [0, *accumulate(query_lens)]
        # one int64 host buffer: ids | slots | q_start | seq_lens | sample rows | tables, then positions
        flat = torch.tensor(ids + slots + q_start + seq_lens + sample_rows
                            + [b for t in block_tables for b in t + [0] * (width - len(t))], dtype=torch.int64)
        host = torch.cat([flat, torch.cat(pos, dim=1).flatten()])
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        parts = dev[:flat.numel()].split([num_tokens, num_tokens, batch + 1, batch, len(sample_rows),
                                          batch * width])
        input_ids, slot_map, q_start_d, seq_lens_d, sample_rows_d, tables = parts
        meta = AttentionMetadata(
            slot_mapping=slot_map, query_start_loc=q_start_d.int(), seq_lens=seq_lens_d.int(),
            block_tables=tables.view(batch, width).int(), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens), max_seq_len=max(seq_lens))
        meta = self.attention.prepare(meta, self.kv_caches[0][0])  # the backend's per-step metadata, once
        positions = dev[flat.numel():].view(self.model.position_rows, num_tokens)  # [position_rows, num_tokens]
        return StepInputs(input_ids, positions, meta, sample_rows_d, sample_idx)

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


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [position_rows, num_tokens] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] int64 rows of the hidden states to sample from
    sample_idx: list[int]  # their indices in sched.scheduled


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
