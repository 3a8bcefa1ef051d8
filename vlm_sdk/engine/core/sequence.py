"""One request's state inside the engine.

There is no prefill phase and no decode phase: a sequence has `token_ids` (prompt, then generated
tokens) and `num_computed_tokens`, the prefix whose K/V is in the cache. Each step the scheduler
lets `num_computed_tokens` catch up by some tokens; when it reaches `len(token_ids)` the step also
samples one new token. Preemption frees the blocks (and the state slot) and sets `num_computed_tokens`
back to 0.

The worker holds its own copy of what it needs (`vlm_sdk/protocol/`); `in_worker`, `num_blocks_sent` and
`num_tokens_sent` record what it has been sent, so each step sends only what changed.

Under asynchronous scheduling `num_computed_tokens` moves when a step is launched and may run one
ahead of `token_ids`: the token at index `len(token_ids)` was sampled by a launched step and is still
on the device (`num_inflight`); the next step computes it from there (`worker.model_runner`).
"""
from __future__ import annotations

import enum
import sys
import time
from typing import Hashable

from vlm_sdk.engine.core.block_hash import ImageSpan, salt_seed
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.outputs import PromptLogprobs, RequestMetrics
from vlm_sdk.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt: PromptInputs, params: SamplingParams,
                 arrival_time: float | None = None, group: Hashable | None = None):
        self.request_id = request_id
        # the request it belongs to, for the waiting queue's fair share (engine/core/waiting_queue.py): the
        # n samples of one AsyncLLM call, or one /v1/completions request's prompts; else a group of its own
        self.group = request_id if group is None else group
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] = list(prompt.token_ids)
        self.num_prompt_tokens = len(prompt.token_ids)
        self.num_computed_tokens = 0
        # per attention cache group, its blocks in order (engine.core.cache_coordinator); () while it holds none
        self.block_ids: tuple[list[int], ...] = ()
        self.state_slot = -1  # its live state slot (a model with state layers), -1: none
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.in_worker = False  # the worker holds this request's state (sent as NewRequestData)
        self.num_blocks_sent = 0  # block_ids[g][:num_blocks_sent] are in the worker's block tables
        self.num_tokens_sent = 0  # token_ids[:num_tokens_sent] are in the worker's token ids
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic(),
                                      prompt_tokens=self.num_prompt_tokens,
                                      image_tokens=sum(prompt.image_tokens),
                                      preprocess_time=prompt.preprocess_seconds)
        self.num_preemptions = 0
        self.vision_waits = 0  # steps it was passed over while waiting, its images beyond the step's vision budget
        self.min_tokens_stop_ids: tuple[int, ...] = ()  # set by the engine (it knows the EOS ids)
        self.matcher = None  # structured outputs: the llguidance matcher of its grammar (engine/structured_output.py)
        self.first_mask = None  # and its grammar's mask at the start, made when the grammar was compiled
        # asynchronous scheduling: tokens sampled by launched steps that have not reached the host yet
        # (0 or 1 between steps; 2 while step t+1 is launched before step t's token is read), and whether
        # a step that samples it must be read at once (its grammar or penalties need its every token)
        self.num_inflight = 0
        self.sync_sampling = False
        # speculative decoding (engine/core/spec_decode.py): the drafts this step verifies
        self.spec_token_ids: list[int] = []
        # EAGLE-3: the drafts the rank proposed after its last step, and the token count they follow (stale once
        # it differs: they are used only right after the step that made them)
        self.next_drafts: tuple[int, list[int]] | None = None
        # ... on a model with state layers: a state slot per draft (the state after it), held from the schedule
        # to the rollback, and the position of the step's first row (its last token) they count from
        self.draft_slots: list[int] = []
        self.draft_start = 0
        # the tokens that finish it as "stop" (set by the engine: it knows the EOS ids), and the length at
        # which it finishes as "length" (max_tokens here; the engine caps it at max_model_len)
        self.stop_ids: frozenset[int] = frozenset()
        self.length_limit = self.num_prompt_tokens + params.max_tokens if params.max_tokens is not None else sys.maxsize
        # prefix caching (engine.core.cache_coordinator): the hashes of the full blocks of token_ids so far, and
        # how many of block_ids have been offered to the cache
        self.image_spans = [ImageSpan(p, p + im.num_tokens, im.key) for p, im in zip(prompt.image_positions,
                                                                                   prompt.images)]
        self.block_hashes: list[bytes] = []
        self.hash_seed = salt_seed(prompt.cache_salt)  # a cache_salt's blocks hash apart from everyone else's
        self.num_cached_blocks = 0
        self.last_checkpoint: tuple[int, bytes] | None = None  # its latest generated-side state checkpoint
        # SamplingParams.prompt_logprobs: filled as the prompt's chunks are computed (a preempted prompt
        # recomputed writes the same rows again); sent with the first output
        k = params.prompt_logprobs
        self.prompt_logprobs = PromptLogprobs(self.num_prompt_tokens, k) if k is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")

