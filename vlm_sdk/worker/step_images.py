"""The image stage of a step: the embeddings of the images each scheduled request's chunk reaches
(from the encoder cache or through the vision tower, in groups no bigger than the profiled image), the
rows of them that fall in the step's chunks, and letting go of an image once prefill has passed it.
A request holds the embeddings of the images its current chunk reaches (and of one that straddles the
chunk before), so a video of hundreds of temporal patches is held about a chunk at a time. Images and their
positions are the model family's business (`model.encode_images`); this only moves rows around."""
from __future__ import annotations

import torch

from vlm_sdk.models.base import StepImages
from vlm_sdk.worker.encoder_cache import EncoderCache
from vlm_sdk.worker.request_state import RequestState


def encode_images(model, cache: EncoderCache, max_vision_patches: int | None,
                  scheduled: list[tuple[RequestState, int]]) -> None:
    """Give every image the scheduled chunks reach its embeddings: from the encoder cache, or through
    the vision tower (each distinct image once per step when the cache is on)."""
    todo: dict[object, list[tuple[RequestState, int]]] = {}  # image -> its (state, index), in order
    for state, n in scheduled:
        for i in state.images_needed(state.num_computed_tokens + n):
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
    for group in patch_groups([im.size for im in images], max_vision_patches):
        embeds = model.encode_images([images[i] for i in group])  # [group's image tokens, hidden]
        parts = embeds.split([images[i].num_tokens for i in group])
        del embeds  # the group's output lives beside its parts' clones only until the next group
        for i, part in zip(group, parts):
            if len(parts) > 1:
                part = part.clone()  # its own storage: what the cache keeps is what it counts
            cache.put(images[i].key, part)
            for state, j in owners[i]:
                state.image_embeds[j] = part


def drop_passed_images(scheduled: list[tuple[RequestState, int]]) -> None:
    """A request lets go of an image once its prefill has passed the image's last token."""
    for state, n in scheduled:
        end = state.num_computed_tokens + n
        for i in list(state.image_embeds):
            if state.image_end(i) <= end:
                del state.image_embeds[i]


def step_images(scheduled: list[tuple[RequestState, int]], device: torch.device) -> StepImages | None:
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
    return StepImages(torch.cat(rows).to(device, non_blocking=True), torch.cat(parts))  # [n], [n, width]


def patch_groups(patches: list[int], limit: int | None) -> list[range]:
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
