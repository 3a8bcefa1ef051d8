"""Runs one scheduled step on the model: vision stage, LLM forward over the paged cache, sampling.

Fed plain data (`worker.io.SchedulerOutput`), it keeps its own `RequestState` per request (token
ids, block table) and returns `ModelRunnerOutput` (request id -> sampled token).

Inputs are packed: the new tokens of every scheduled request back to back, in the order of
`num_scheduled_tokens`. Image embeddings are computed on the first step that needs them (the
images of all such requests go through the vision tower in groups of at most `max_vision_patches`
rows of `ImageInput.size`; images and positions are the model family's business: `model.encode_images`,
`model.positions`), held by the request (`RequestState.image_embeds`) and kept for reuse in the
`EncoderCache` (by image key: pixels and settings), and scattered into the token embeddings at
image-token positions, chunk by chunk; a request lets go of an image once prefill has passed its last
token. A request whose cached prefix ends inside an image takes the rest of that image's rows from
embeddings of the same key (the cache's, or the vision tower's again), never from another image.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import AttentionMetadata
from vlm_sdk.models.base import StepImages, VisionLanguageModel
from vlm_sdk.worker.block_table import slot_mapping
from vlm_sdk.worker.cuda_graphs import DecodeGraphs
from vlm_sdk.worker.encoder_cache import EncoderCache
from vlm_sdk.worker.io import ModelRunnerOutput, SchedulerOutput
from vlm_sdk.worker.request_state import RequestState
from vlm_sdk.worker.sampler import Sampler
from vlm_sdk.worker.token_mask import apply_token_bitmask


class ModelRunner:
    def __init__(self, model: VisionLanguageModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 max_vision_patches: int | None = None, graphs: DecodeGraphs | None = None, *,
                 attention: AttentionBackend, samples: bool = True, encoder_cache_bytes: int = 0):
        """`max_vision_patches` (None: no limit) caps the patches of one vision-tower call: the images
        of newly scheduled requests are encoded in groups of at most that many patches (a group
        always holds at least one image), so a step never exceeds the profiled peak of the largest
        image (`largest_image().size` of the family's processor). `attention` (the model's backend)
        prepares each step's attention metadata once, before the forward. `samples` False: a
        tensor-parallel rank other than 0, which computes the logits (their gather is a collective) but
        leaves sampling to rank 0 and returns an empty output. `encoder_cache_bytes`: the vision
        embeddings kept for reuse by image key (0: none)."""
        self.model = model
        self.attention = attention
        self.max_vision_patches = max_vision_patches
        self.graphs = graphs  # replays decode steps (CUDA graphs, or their padded path eagerly)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler(seed)
        self.samples = samples
        self.requests: dict[str, RequestState] = {}
        self.encoder_cache = EncoderCache(encoder_cache_bytes)

    # -- state ------------------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> list[tuple[RequestState, int]]:
        """Apply the step's changes to the per-request state; the scheduled (state, tokens) in order."""
        for rid in sched.finished_request_ids | sched.preempted_request_ids:
            self.requests.pop(rid, None)
        for new in sched.new_requests:
            self.requests[new.request_id] = RequestState.from_new(new)
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            state.token_ids.extend(cached.new_token_ids)
            state.num_computed_tokens = cached.num_computed_tokens
        return [(self.requests[rid], n) for rid, n in sched.num_scheduled_tokens.items()]

    # -- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens; sample one token for each request whose computed tokens
        catch up with all its tokens this step."""
        scheduled = self._update_states(sched)
        if not scheduled:
            return ModelRunnerOutput()
        self._encode_images(scheduled)
        step = self._prepare(scheduled)
        if self.graphs is not None and step.meta.decode_only and self.graphs.covers(len(scheduled)) \
                and not any(s.num_computed_tokens < s.num_prompt_tokens for s, _ in scheduled):
            # generated tokens only: no image rows to scatter, so the captured forward covers it
            meta = step.meta
            hidden = self.graphs.run(step.input_ids, step.positions, meta.slot_mapping, meta.seq_lens,
                                     meta.block_tables)  # [num_seqs, hidden]
        else:
            embeds = self.model.embed_tokens(step.input_ids)  # [num_tokens, hidden]
            hidden = self.model(embeds, step.positions, self.kv_caches, step.meta,
                                self._step_images(scheduled))  # [num_tokens, hidden]
        self._drop_passed_images(scheduled)
        if not step.sample_idx:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[step.sample_rows])  # [num_sampled, vocab]
        if not self.samples:
            return ModelRunnerOutput()
        states = [scheduled[i][0] for i in step.sample_idx]
        if sched.grammar_bitmask is not None:  # structured outputs: only the constrained rows change
            row_of = {s.request_id: j for j, s in enumerate(states)}
            apply_token_bitmask(logits, [row_of[r] for r in sched.grammar_bitmask.request_ids],
                                sched.grammar_bitmask.bitmask)
        histories = [(s.token_ids, s.num_prompt_tokens, s.min_tokens_stop_ids) for s in states]
        tokens, logprobs = self.sampler.sample(logits, [s.params for s in states], histories)
        return ModelRunnerOutput({s.request_id: t for s, t in zip(states, tokens)},
                                 {s.request_id: lp for s, lp in zip(states, logprobs) if lp is not None})

    def _encode_images(self, scheduled: list[tuple[RequestState, int]]) -> None:
        """Give every still-needed image of the scheduled requests its embeddings: from the encoder
        cache, or through the vision tower (each distinct image once per step when the cache is on)."""
        cache = self.encoder_cache
        todo: dict[object, list[tuple[RequestState, int]]] = {}  # image -> its (state, index), in order
        for state, _ in scheduled:
            for i in state.images_needed():
                if i in state.image_embeds:
                    continue
                key = state.images[i].key if cache.capacity_bytes else None
                if key is not None and key in todo:  # the same image, encoded by this step anyway
                    cache.count_hit()
                    todo[key].append((state, i))
                    continue
                embeds = cache.get(key) if cache.capacity_bytes else None
                if embeds is not None:
                    state.image_embeds[i] = embeds
                else:
                    todo[key if key is not None else (state.request_id, i)] = [(state, i)]
        if not todo:
            return
        owners = list(todo.values())
        images = [state.images[i] for state, i in (o[0] for o in owners)]
        outs = []
        for group in _patch_groups([im.size for im in images], self.max_vision_patches):
            outs.append(self.model.encode_images([images[i] for i in group]))  # [tokens, hidden]
        embeds = outs[0] if len(outs) == 1 else torch.cat(outs)  # [image tokens, hidden], in image order
        parts = embeds.split([im.num_tokens for im in images])
        for image, users, part in zip(images, owners, parts):
            if len(parts) > 1:
                part = part.clone()  # its own storage: what the cache keeps is what it counts
            cache.put(image.key, part)
            for state, i in users:
                state.image_embeds[i] = part

    def _drop_passed_images(self, scheduled: list[tuple[RequestState, int]]) -> None:
        for state, n in scheduled:
            end = state.num_computed_tokens + n
            for i in list(state.image_embeds):
                if state.image_end(i) <= end:
                    del state.image_embeds[i]

    def _prepare(self, scheduled: list[tuple[RequestState, int]]) -> StepInputs:
        """Pack the step's inputs on the host and move them to the device in one copy."""
        ids, pos, slots, block_tables = [], [], [], []
        query_lens, seq_lens, sample_rows, sample_idx = [], [], [], []
        row = 0
        for i, (s, n) in enumerate(scheduled):
            start, end = s.num_computed_tokens, s.num_computed_tokens + n
            ids.extend(s.token_ids[start:end])
            pos.append(self.model.positions(s.prompt_positions, start, end))  # [position_rows, n]
            slots.extend(slot_mapping(s.block_ids, self.block_size, start, end))
            block_tables.append(s.block_ids)
            query_lens.append(n)
            seq_lens.append(end)
            row += n
            if end == s.num_tokens:
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

    def _step_images(self, scheduled: list[tuple[RequestState, int]]) -> StepImages | None:
        """The held image rows that fall in this step's chunk of each request, and where they go in
        the packed step; None when the step has no image token."""
        rows, parts = [], []
        row = 0
        for s, n in scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + n
            for i, embeds in s.image_embeds.items():  # [image tokens, width]
                first = s.image_positions[i]
                lo, hi = max(start, first), min(end, s.image_end(i))
                if hi > lo:
                    rows.append(torch.arange(row + lo - start, row + hi - start))
                    parts.append(embeds[lo - first:hi - first])
            row += n
        if not parts:
            return None
        return StepImages(torch.cat(rows).to(self.device, non_blocking=True), torch.cat(parts))  # [n], [n, width]


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [position_rows, num_tokens] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] int64 rows of the hidden states to sample from
    sample_idx: list[int]  # their indices in the scheduled list


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
