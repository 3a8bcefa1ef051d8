"""What the scheduler hands every rank each step (vLLM v1's `core/sched/output.py`).

Plain data only (ints, lists, tensors of pixels; no engine objects):

    step k   SchedulerOutput(new_requests=[NewRequestData(a)], cached_requests=[],
                             num_scheduled_tokens={"a": 9})
    step k+1 SchedulerOutput(new_requests=[], cached_requests=[CachedRequestData("a", new_block_ids=(),
                             num_computed_tokens=9, new_token_ids=[t9])], num_scheduled_tokens={"a": 1})
    ...      finished_request_ids={"a"} once it finished or was aborted (the worker frees its state)

A request is sent as `NewRequestData` the first time it is scheduled and again when it is scheduled
after a preemption (its `output_token_ids` then hold what it generated before: recompute). The order
of `num_scheduled_tokens` is the order the step packs its tokens in.

Block ids come one list per attention cache group, in group order (vlm_sdk/protocol/cache_layout.py;
one group for a model of one attention kind), every list as long as the others. A sliding-window group's
entries before its window may be -1 (never read). A model with state layers gives each running request
a state slot (`NewRequestData.state_slot`), and the step's state copies: restores (a checkpoint into a
request's live slot, before the forward) and checkpoints (a live slot into a checkpoint slot, after it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before a preemption; [] for a fresh request
    images: list[ImageInput]  # preprocessed pixels, in prompt order
    image_positions: list[int]  # index in the prompt of image i's first token
    prompt_positions: Any  # `PromptInputs.positions`: the model family's, read by `model.positions`
    sampling_params: SamplingParams  # its seed, if any, seeds the request's own generator
    block_ids: tuple[list[int], ...]  # per attention group, the KV blocks held, in order
    num_computed_tokens: int  # tokens whose K/V (and state) is already in the cache
    # what `min_tokens` masks until it is reached: stop_token_ids, and EOS unless ignore_eos (the engine
    # knows the checkpoint's EOS ids, the worker does not); () when min_tokens is 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    state_slot: int = -1  # its live state slot (a model with state layers); -1: none


NO_IDS: tuple = ()  # what a `CachedRequestData` holds when nothing was added (shared: no list per step)


@dataclass(slots=True)
class CachedRequestData:
    """A request the worker already holds: what changed since it was last scheduled. Not frozen (the
    worker only reads it): one is built per running request per step, and a frozen dataclass's
    __init__ costs ~3x (0.7 us more each: 0.18 ms a step at batch 256)."""
    request_id: str
    new_block_ids: tuple[list[int], ...]  # per attention group, appended to its block table (NO_IDS: none)
    num_computed_tokens: int
    new_token_ids: list[int] | tuple[int, ...]  # appended by the engine (sampled ones) since it was last sent


@dataclass(frozen=True)
class GrammarBitmask:
    """Structured outputs: the tokens each constrained request may sample this step, one bit per token
    (bit t of word w allows token 32w + t; llguidance's layout). The other sampled rows are free."""
    request_ids: tuple[str, ...]
    bitmask: Any  # torch.Tensor [len(request_ids), ceil(vocab / 32)] int32, on the host


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step
    finished_request_ids: frozenset[str] = frozenset()  # finished or aborted since the last step
    preempted_request_ids: frozenset[str] = frozenset()  # preempted this step: free, resend later
    grammar_bitmask: GrammarBitmask | None = None  # masks of the constrained requests that sample now
    state_restores: tuple[tuple[int, int], ...] = ()  # (checkpoint slot, live slot): copied before the forward
    state_checkpoints: tuple[tuple[int, int], ...] = ()  # (live slot, checkpoint slot): copied after it
    # speculative decoding: request id -> the draft tokens it verifies this step (its scheduled count is
    # 1 + their number: its last token, then these); request id -> the blocks it keeps per group after a
    # verification rejected drafts (the tables cut there before this step's new blocks are appended)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    truncated_blocks: dict[str, int] = field(default_factory=dict)
    # ... on a model with state layers: request id -> a slot per draft, where the step leaves the state after
    # that draft (its live slot gets the state after the last); request id -> its live slot from now on, after a
    # verification that rejected a draft (the slot of the last accepted position: the engine's rollback)
    draft_state_slots: dict[str, tuple[int, ...]] = field(default_factory=dict)
    moved_state_slots: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
