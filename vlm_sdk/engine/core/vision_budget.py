"""The vision tower's share of one step: how many encoder tokens (image embeddings, `ImageInput.num_tokens`:
vLLM's `max_num_encoder_input_tokens` counts the same) one step may encode, and the cut that keeps a
chunk inside it.

The worker runs the vision tower inside the step for every image a scheduled chunk reaches that it does
not hold yet (worker/step_images.py), so a step that reaches many new images is as long as all their
towers and their prefill together, and every decode row in it waits that long for its token. The scheduler
therefore walks a chunk's images in order, as vLLM v1's `_try_schedule_encoder_inputs` does: an image the
step's remaining budget holds is counted; the first that it does not hold ends the chunk just before that
image's first token (the tokens before it still run); a chunk that starts inside such an image, or at its
first token, runs nothing this step. A video is a run of frame groups (one `ImageInput` per temporal
patch), so a large video's encoding spans steps, a frame group or more each; an image is never split (its
tokens attend to each other inside the tower).

What the worker holds: an image whose first token is before the chunk's start, of a sequence the worker
already holds, was encoded by the step that first reached it and is kept until prefill passes its end; any
other image the chunk reaches is new (a sequence starting or restarting after a preemption encodes again
whatever its chunk reaches, from a prefix-cache hit inside an image too). The encoder cache may still answer
a new image without the tower; the scheduler cannot see that cache (it lives on the ranks) and counts the
image anyway, so the bound is on the tower's work, never under it.

An image larger than the whole budget is encoded alone, in a step that encodes nothing else (its tokens attend
to each other in the tower, so it cannot be split); every other step stays within the budget. vLLM instead
raises its budget to the largest item the settings allow, which for Qwen-VL's defaults (a 16,384-token image,
768-token video frame groups) would leave no bound on the images a flood actually sends.
"""
from __future__ import annotations

from vlm_sdk.engine.core.sequence import Sequence

# a sequence passed over this many steps in a row for the vision budget has aged: the next step keeps its next
# image's tokens for it before any other chunk (a waiting one: admission also goes no further than it)
MAX_VISION_WAITS = 16



def step_shares(args, whole_images: bool) -> tuple[int | None, int]:
    """(the encoder tokens a step may encode, None: no bound; the tokens of a prefill chunk beside decode
    rows, 0: no bound) from the settings (None or 0: no bound; `vlm-sdk serve` gives its own defaults:
    server/config.py SERVING_STEP_SHARES). A family that prefills an image whole gets no prefill bound (it
    would cut inside images)."""
    return args.max_num_encoder_tokens_per_step or None, 0 if whole_images else (args.max_prefill_tokens_with_decodes or 0)


def decode_rows(running: list[Sequence], skip_inflight: bool = False) -> int:
    """How many running sequences ask for one token this step (decoding; under asynchronous scheduling the
    token on its way counts; with pipeline micro-batches, `skip_inflight`, a sequence whose token is on its
    way asks for nothing): the tokens the scheduler keeps from prefill chunks for them."""
    return sum(1 for s in running if len(s.token_ids) + s.num_inflight - s.num_computed_tokens == 1
               and not (skip_inflight and s.num_inflight))


def new_images(seq: Sequence, computed: int, n: int):
    """The spans of the images a chunk of `n` tokens from `computed` reaches that the worker does not hold
    (see the module docstring), in order."""
    end = computed + n
    held_before = seq.in_worker  # the worker keeps the image the previous chunk ended inside
    for span in seq.image_spans:  # ascending
        if span.start >= end:
            break
        if span.end <= computed or (held_before and span.start < computed):
            continue
        yield span


def aged(running: list[Sequence], waiting_head: Sequence | None) -> Sequence | None:
    """The prefilling sequence passed over most steps for the vision budget, when that is `MAX_VISION_WAITS`
    or more (a running one, whose next image waits behind the frame groups of sequences that started
    before it, or the waiting queue's next); None when none has aged."""
    best = waiting_head if waiting_head is not None and waiting_head.vision_waits >= MAX_VISION_WAITS else None
    for seq in running:
        if seq.vision_waits >= MAX_VISION_WAITS and (best is None or seq.vision_waits > best.vision_waits):
            best = seq
    return best


class VisionBudget:
    """One step's encoder tokens: `cut` each chunk as it is scheduled; `spent` is what the step encodes.
    `limit` None: no bound (nothing is cut, nothing counted). A chunk cut to nothing counts a wait on its
    sequence (`Sequence.vision_waits`); a chunk that takes a new image clears them."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.spent = 0
        self.refused = False  # the last chunk was cut to nothing by this budget (not by blocks or tokens)
        self._favoured: Sequence | None = None  # an aged sequence whose images' tokens are kept for it
        self._kept = 0

    def keep_for(self, seq: Sequence | None) -> None:
        """Before any chunk: keep the new image tokens of `seq`'s next chunk (up to the whole budget) for it,
        whichever sequences come before it this step (`aged` chose it)."""
        if self.limit is None or seq is None:
            return
        first = next(new_images(seq, seq.num_computed_tokens, seq.num_prompt_tokens - seq.num_computed_tokens), None)
        if first is not None:
            self._favoured, self._kept = seq, min(self.limit, first.end - first.start)
            self.spent += self._kept

    def cut(self, seq: Sequence, computed: int, n: int) -> int:
        """`n` cut so that the new images it reaches fit the step's remaining encoder tokens, those taken;
        0 when the chunk starts inside (or at) an image that does not fit."""
        self.refused = False
        if self.limit is None or not seq.image_spans or n == 0:
            return n
        if seq is self._favoured:  # what was kept for it is its own
            self.spent -= self._kept
            self._favoured, self._kept = None, 0
        spent = took = self.spent
        for span in new_images(seq, computed, n):
            tokens = span.end - span.start
            if spent + tokens > self.limit and spent:  # an image over the whole budget runs alone in a step
                n = max(0, span.start - computed)
                self.refused = n == 0
                break
            spent += tokens
        self.spent = spent
        if self.refused:
            seq.vision_waits += 1
        elif spent > took:
            seq.vision_waits = 0
        return n
