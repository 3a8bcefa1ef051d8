"""Continuous batching: which sequences compute how many tokens this step.

Running sequences go first, in the order they started; each asks for all its uncomputed tokens
(1 while decoding, the rest of the prompt while prefilling), cut to what is left of the step's token
budget, less a token for each decoding sequence after it (a prefill chunk never takes a decode row's
token), to `max_prefill_tokens_with_decodes` in a step with decode rows, and to the step's vision budget (`max_num_encoder_tokens_per_step`, engine/core/vision_budget.py:
the image tokens whose vision tower the step runs; a chunk ends before the first image that does not fit,
so a large video's frame groups are encoded over several steps). When the pool has too few free blocks, the most recently started running sequence is
preempted: its blocks (and state slot) are freed and it goes back to the front of the waiting queue,
to be recomputed later (its generated tokens are kept). Waiting sequences are admitted while budget,
blocks, state slots and `max_num_seqs` allow, and not at all in a step that had to preempt, in the
order of the waiting queue (engine/core/waiting_queue.py): the preempted first, then round-robin across
requests (a request: `Sequence.group`), no request holding more than 3/4 of `max_num_seqs`; FIFO when
every request is one sequence. A request whose images do not fit what is left of the vision budget is
passed over for the step and the next is tried (a text prompt never waits behind an image flood). A
sequence (waiting, or running behind another's frame groups) passed over `MAX_VISION_WAITS` steps in a
row has aged: the next step keeps its next image's tokens for it before any other chunk, and admission
goes no further than an aged waiting sequence. A sequence that starts or restarts shares the blocks of its longest
cached prefix and computes only the rest (`CacheCoordinator.start`); a preempted sequence may find its
own blocks still cached when it returns. With state layers and prefix caching, prefill chunks end on
block boundaries (`CacheCoordinator.align`), and the step's state copies come from
`CacheCoordinator.end_step`. For a model whose image tokens attend to each other
(`FamilySpec.whole_images`) a prefill chunk never ends inside an image: it ends before it, or the
sequence waits for a step whose budget holds the rest of the image (`cache_coordinator.whole_image_chunk`;
start-up checks that max_num_batched_tokens holds one).

Every sequence is at most `max_model_len` tokens and `max_model_len` never exceeds the cache, so a
sequence running alone always fits: preemption cannot loop forever.

Asynchronous scheduling: a sequence whose last sampled token is still on the device (`num_inflight`)
asks for that token too, and is left out when that token is certain to be its last (max_tokens or
max_model_len reached); a waiting sequence is admitted only once its tokens have all arrived.

Pipeline micro-batches (`micro_batches` > 1: the engine keeps that many steps in flight through the
stages): a sequence whose sampled token is on its way is left out until it has arrived (vLLM's scheduler
under pipeline parallelism: it has no new token to compute), while a prefilling one may have its next chunk
in the next micro-batch (every stage runs the micro-batches in order, so the chunk before is computed
first). A micro-batch takes at most 1 / micro_batches of the live sequences (running and waiting, rounded
up): without that cap, requests that all fit one step would all go into the first micro-batch and stay
together, leaving the other stages nothing to run meanwhile.

Speculative decoding: a decoding sequence with drafts (`Sequence.spec_token_ids`, proposed by the engine
before the schedule) asks for its last token and its drafts when the budget and free blocks hold them, and
drops its drafts otherwise (`spec_decode.spec_tokens`): drafts never preempt anyone. After its step the
engine rolls back what was rejected (`spec_decode.rollback`), and the blocks it kept reach the worker as
`SchedulerOutput.truncated_blocks` (`truncated`).

`schedule()` decides on live `Sequence`s (`ScheduledBatch`); `worker_input(batch)` turns the decision
into the worker's plain `SchedulerOutput`: a `NewRequestData` for a sequence the worker does not hold
(first scheduled, or resumed after a preemption), a `CachedRequestData` with only what changed for
the others, and the ids of sequences finished or preempted since, so the worker frees their state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from vlm_sdk.config import SchedulerConfig
from vlm_sdk.engine.core.cache_coordinator import NO_COPIES, CacheCoordinator
from vlm_sdk.engine.core.sequence import Sequence, SequenceStatus
from vlm_sdk.engine.core.spec_decode import spec_tokens
from vlm_sdk.engine.core.vision_budget import MAX_VISION_WAITS, VisionBudget, aged, decode_rows
from vlm_sdk.engine.core.waiting_queue import FairWaitingQueue
from vlm_sdk.protocol.scheduler_output import NO_IDS, CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class ScheduledBatch:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)
    state_restores: tuple[tuple[int, int], ...] = NO_COPIES  # (checkpoint slot, live slot), before the forward
    state_checkpoints: tuple[tuple[int, int], ...] = NO_COPIES  # (live slot, checkpoint slot), after it
    encoder_tokens: int = 0  # the vision budget's count: image tokens the step's chunks reach that are new to the ranks


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheCoordinator, micro_batches: int = 1):
        self.config = config
        self.micro_batches = micro_batches
        self.skip_inflight = micro_batches > 1
        self.cache = cache
        self.waiting = FairWaitingQueue(config.max_num_seqs - config.max_num_seqs // 4)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._worker_finished: set[str] = set()  # held by the worker, finished since the last step
        self.truncated: dict[Sequence, int] = {}  # speculative decoding's rollbacks since: sequence -> blocks kept
        self.moved_slots: dict[Sequence, int] = {}  # ... on state layers: sequence -> its new live state slot

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        out = ScheduledBatch()
        vision = VisionBudget(self.config.max_num_encoder_tokens_per_step)
        if vision.limit is not None:  # the next image of a sequence passed over too long goes first
            vision.keep_for(aged(self.running, self.waiting.peek() if self.waiting else None))
        decodes = decode_rows(self.running, self.skip_inflight)
        # prefill chunks beside decode rows are cut to max_prefill_tokens_with_decodes (0: not cut)
        cap = self.config.max_prefill_tokens_with_decodes if decodes else 0
        # a micro-batch's share of the live sequences (every one of them without micro-batches)
        seqs = -(-(len(self.running) + len(self.waiting)) // self.micro_batches)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, vision, decodes, cap, seqs)
        if not out.preempted and self.waiting:
            self._admit(out, budget, vision, cap, seqs)
        out.encoder_tokens = vision.spent
        if self.cache.state is not None:
            out.state_restores, out.state_checkpoints = self.cache.end_step(out.scheduled)
        return out

    def _schedule_running(self, out: ScheduledBatch, budget: int, vision: VisionBudget, reserve: int,
                          cap: int, seqs: int) -> int:
        """Every running sequence's chunk, in the order they started, preempting the newest when blocks run
        out; the token budget left. Decode rows (`reserve` of them) keep a token each from the prefill chunks
        before them, so a long prefill never takes a decoding sequence's step; a prefill chunk is also cut
        to `cap` (when not 0) and to the step's vision budget (a video's next frame groups wait); at most `seqs`
        sequences (a pipeline micro-batch's share)."""
        running, allocate, scheduled = self.running, self.cache.allocate, out.scheduled
        size = self.cache.block_size
        caching = self.cache.enable_prefix_caching
        aligned = self.cache.aligned
        whole_images = self.cache.whole_images
        bounded = vision.limit is not None
        prefill_cap = cap or budget
        skip_inflight = self.skip_inflight
        # preemption removes sequences from the end of `running` only: the iterator stops before them
        for seq in running:
            if budget <= 0 or len(scheduled) >= seqs:
                break
            if skip_inflight and seq.num_inflight:
                continue  # its token is still in the pipeline's stages: nothing to compute until it arrives
            left = len(seq.token_ids) + seq.num_inflight - seq.num_computed_tokens
            if left == 1:
                reserve -= 1
            if seq.num_inflight and len(seq.token_ids) + seq.num_inflight >= seq.length_limit:
                continue  # the token on its way is its last (max_tokens or max_model_len): nothing to compute
            n = min(left, budget if left == 1 else min(budget - reserve, prefill_cap))
            if n <= 0:
                continue  # a prefill chunk: what is left of the budget is the decode rows'
            if seq.spec_token_ids:  # speculative decoding: its last token and its drafts, or its drafts dropped
                # the decode rows after it keep their tokens; admission keeps a state slot per sequence it may start
                n = spec_tokens(seq, n, budget - reserve, self.cache, self.config.max_num_seqs - len(running))
            if aligned and n > 1:  # a prefill chunk ends on a block boundary: its state can be checkpointed
                n = self.cache.align(seq, seq.num_computed_tokens, n)
            if whole_images and seq.num_computed_tokens < seq.num_prompt_tokens:
                n = self.cache.whole_image(seq, seq.num_computed_tokens, n)  # never ends inside an image
                if n == 0:
                    continue  # the rest of an image does not fit this step's budget: a later step's
            if bounded and seq.num_computed_tokens < seq.num_prompt_tokens:
                n = vision.cut(seq, seq.num_computed_tokens, n)
                if n == 0:
                    continue  # its next image (a video's next frame group) is a later step's
            if aligned and n > 1:  # a chunk on its way to a checkpoint: siblings wait for it (cache_coordinator)
                self.cache.note_coming(seq, seq.num_computed_tokens + n)
            total = seq.num_computed_tokens + n
            # the usual case, kept lean (it runs for every sequence every step): the blocks held suffice and
            # none fills up, so `allocate` would change nothing (every group holds as many blocks as group 0)
            if (total > len(seq.block_ids[0]) * size or (caching and total // size > seq.num_cached_blocks)) \
                    and not allocate(seq, n):
                while not allocate(seq, n):
                    victim = running[-1]
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:  # it preempted itself
                    break
            scheduled.append((seq, n))
            budget -= n
        return budget

    def _admit(self, out: ScheduledBatch, budget: int, vision: VisionBudget, cap: int, seqs: int) -> None:
        """Admit waiting sequences in the waiting queue's order while the token budget, `max_num_seqs`,
        blocks and state slots allow. One whose images the step's vision budget cannot hold is passed over
        (its request waits for the next step) and admission goes on with the next request, so a text
        prompt never waits behind images; one passed over `MAX_VISION_WAITS` steps has aged (`schedule` kept
        its next image's tokens for it) and admission stops at it until it is in."""
        self.waiting.count_running(self.running)  # the per-request cap on the batch
        cut = vision.cut if vision.limit is not None else None
        prefill_cap = cap or budget
        passed: set = set()  # groups passed over this step
        while budget > 0 and len(self.running) < self.config.max_num_seqs and len(out.scheduled) < seqs:
            seq = self.waiting.peek(passed)  # None: none left, or every waiting request at its cap or passed
            if seq is None or seq.num_inflight:  # preempted while its token was on the device: restart with it
                break
            vision.refused = False
            n = self.cache.start(seq, min(budget, prefill_cap), cut)  # its cached prefix is not computed again
            if n is None:
                if vision.refused and seq.vision_waits < MAX_VISION_WAITS:
                    passed.add(seq.group)
                    continue
                break
            self.waiting.take(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        self.truncated.pop(seq, None)  # resent whole when it resumes
        self.moved_slots.pop(seq, None)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire `seq` (finished or aborted) wherever it is, returning its blocks and slot at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.cache.free(seq)
        self.truncated.pop(seq, None)
        self.moved_slots.pop(seq, None)
        if seq.in_worker:
            seq.in_worker = False
            self._worker_finished.add(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_worker_finished(self) -> bool:
        """Whether requests the worker holds finished since the last `worker_input`."""
        return bool(self._worker_finished)

    def worker_input(self, batch: ScheduledBatch) -> SchedulerOutput:
        """The plain data the worker needs for `batch` (see the module docstring)."""
        new, cached, counts, spec = [], [], {}, {}
        preempted = set()
        for seq in batch.preempted:
            if seq.in_worker:
                seq.in_worker = False
                preempted.add(seq.request_id)
        moved = {}  # before new requests: a sequence resent whole carries its live slot
        if self.moved_slots:
            moved = {s.request_id: slot for s, slot in self.moved_slots.items() if s.in_worker
                     and s.request_id not in preempted}
            self.moved_slots = {}
        drafts = {}
        for seq, n in batch.scheduled:
            counts[seq.request_id] = n
            if seq.spec_token_ids:
                spec[seq.request_id] = list(seq.spec_token_ids)
                if seq.draft_slots:
                    drafts[seq.request_id] = tuple(seq.draft_slots)
            blocks = seq.block_ids  # per attention group, every list as long as the first
            num_blocks, num_tokens = len(blocks[0]), len(seq.token_ids)
            if not seq.in_worker:
                p = seq.prompt
                new.append(NewRequestData(
                    seq.request_id, list(p.token_ids), seq.output_token_ids, p.images, p.image_positions,
                    p.positions, seq.params, tuple([list(b) for b in blocks]), seq.num_computed_tokens,
                    seq.min_tokens_stop_ids, seq.state_slot))
                seq.in_worker = True
            else:
                cached.append(CachedRequestData(
                    seq.request_id, tuple([b[seq.num_blocks_sent:] for b in blocks]) if num_blocks > seq.num_blocks_sent
                    else NO_IDS,
                    seq.num_computed_tokens, seq.token_ids[seq.num_tokens_sent:] if num_tokens > seq.num_tokens_sent
                    else NO_IDS))
            seq.num_blocks_sent, seq.num_tokens_sent = num_blocks, num_tokens
        finished, self._worker_finished = frozenset(self._worker_finished), set()
        truncated = {}
        if self.truncated:  # cut before this step's blocks are appended; a sequence resent whole needs none
            truncated = {s.request_id: k for s, k in self.truncated.items() if s.in_worker and s.request_id not in
                         preempted and s.request_id not in finished}
            self.truncated = {}
        return SchedulerOutput(new, cached, counts, finished, frozenset(preempted),
                               state_restores=batch.state_restores, state_checkpoints=batch.state_checkpoints,
                               spec_token_ids=spec, truncated_blocks=truncated, draft_state_slots=drafts,
                               moved_state_slots=moved)
