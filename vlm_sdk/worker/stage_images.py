"""Where a step's image tokens are, for a pipeline stage after the first: it holds no vision tower and no
image embeddings (the first stage scattered them into the hidden states it sent), but a family whose
attention depends on the image spans (Gemma 3: bidirectional within each image) needs their rows on
every stage. The same rows `step_images` gives the first stage, from the requests' image positions."""
from __future__ import annotations

import torch

from vlm_sdk.models.base import StepImages
from vlm_sdk.worker.request_state import RequestState


def stage_image_rows(scheduled: list[tuple[RequestState, int]], device: torch.device) -> StepImages | None:
    """The step's image-token rows (`StepImages.embeds` empty: `[n, 0]`); None when it has none."""
    rows = []
    row = 0
    for s, n in scheduled:
        start, end = s.num_computed_tokens, s.num_computed_tokens + n
        for i, first in enumerate(s.image_positions):
            lo, hi = max(start, first), min(end, s.image_end(i))
            if hi > lo:
                rows.append(torch.arange(row + lo - start, row + hi - start))
        row += n
    if not rows:
        return None
    picked = torch.cat(rows)  # [n]
    return StepImages(picked.to(device, non_blocking=True), torch.empty(picked.numel(), 0, device=device))
