"""Runs one scheduled step on the model: vision stage, LLM forward over the paged cache, sampling.

Fed plain data (`protocol.scheduler_output.SchedulerOutput`), it keeps its own `RequestState` per request (token
ids, block tables, state slot) and returns `ModelRunnerOutput` (request id -> sampled token).

Inputs are packed: the new tokens of every scheduled request back to back, in the order of
`num_scheduled_tokens`, with numpy from state kept between steps (no Python loop per token or per
block): each held request owns a row of `BlockTables` (one table per attention cache group; only new
block ids are written; the device tables get them in one flush) and the offset of its generated tokens'
positions. Each step's metadata is one `AttentionMetadata` per attention group (its slots and table rows,
the backend's `prepare` once per group) and one `StateMetadata` for the state layers (`StepMetadata`:
layer i reads `meta.layer(i)`); a state step's restores are copied before the forward, its checkpoints
after it (`SchedulerOutput.state_restores` / `state_checkpoints`). A decode step that
CUDA graphs replay is packed straight into the graphs' pinned input buffer (`DecodeGraphs.stage`,
one copy); other steps go through `_prepare` (one copy, the table rows gathered on the device). Image embeddings are computed on the first step that needs them (the
images of all such requests go through the vision tower in groups of at most `max_vision_patches`
rows of `ImageInput.size`; images and positions are the model family's business: `model.encode_images`,
`model.positions`), held by the request (`RequestState.image_embeds`) and kept for reuse in the
`EncoderCache` (by image key: pixels and settings), and scattered into the token embeddings at
image-token positions, chunk by chunk; a request lets go of an image once prefill has passed its last
token. A request whose cached prefix ends inside an image takes the rest of that image's rows from
embeddings of the same key (the cache's, or the vision tower's again), never from another image.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from vlm_sdk.attention.backend import AttentionBackend
from vlm_sdk.attention.metadata import StateMetadata, StepMetadata
from vlm_sdk.models.base import VisionLanguageModel
from vlm_sdk.protocol.cache_layout import CacheLayout
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.worker.block_table import BlockTables
from vlm_sdk.worker.cuda_graphs import DecodeGraphs
from vlm_sdk.worker.eagle_drafter import EagleDrafter, draft_rows
from vlm_sdk.worker.encoder_cache import EncoderCache
from vlm_sdk.worker.kv_cache import copy_state_slots
from vlm_sdk.worker.step_metadata import step_metadata
from vlm_sdk.worker.piecewise_graphs import PiecewiseGraphs
from vlm_sdk.protocol.runner_output import ModelRunnerOutput
from vlm_sdk.protocol.scheduler_output import SchedulerOutput
from vlm_sdk.protocol.runner_output import PendingOutput, Ready
from vlm_sdk.worker.pending_output import DevicePendingOutput
from vlm_sdk.worker.pp_transfer import StageLink
from vlm_sdk.worker.stage_images import stage_image_rows
from vlm_sdk.worker.prompt_logprobs import prompt_logprobs
from vlm_sdk.worker.request_state import RequestState
from vlm_sdk.sample.sampled_tokens import SampledTokens
from vlm_sdk.sample.rejection_sampler import RejectionSampler
from vlm_sdk.sample.sampler import Sampler
from vlm_sdk.worker.spec_verify import draft_states, plain_masks, verify_drafts
from vlm_sdk.worker.step_images import drop_passed_images, encode_images, step_images
from vlm_sdk.sample.token_mask import apply_token_bitmask


class ModelRunner:
    def __init__(self, model: VisionLanguageModel, caches: list[tuple[torch.Tensor, ...]], layout: CacheLayout,
                 block_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 max_vision_patches: int | None = None, graphs: DecodeGraphs | None = None, *,
                 attention: AttentionBackend, samples: bool = True, encoder_cache_bytes: int = 0,
                 keep_sampled: bool = False, piecewise: PiecewiseGraphs | None = None,
                 stage: StageLink | None = None, drafter: EagleDrafter | None = None):
        """`caches[i]`: layer i's cache as `layout` allocates it (worker/kv_cache.py). `max_vision_patches` (None: no limit) caps the patches of one vision-tower call: the images
        of newly scheduled requests are encoded in groups of at most that many patches (a group
        always holds at least one image), so a step never exceeds the profiled peak of the largest
        image (`largest_image().size` of the family's processor). `attention` (the model's backend)
        prepares each step's attention metadata once, before the forward. `samples` False: a
        tensor-parallel rank other than 0, which computes the logits (their gather is a collective) but
        leaves sampling to rank 0 and returns an empty output. `encoder_cache_bytes`: the vision
        embeddings kept for reuse by image key (0: none). `keep_sampled` (asynchronous scheduling):
        each step's sampled tokens stay on the device, where the next step takes the ids the engine
        has not sent yet (a request whose computed tokens reach past its known ones). `piecewise`: graphs
        of the model's decoder stack that steps with prefill rows run through when the model gives the
        step's `stack_inputs` (the model itself is never changed: they wrap it from outside). `stage`:
        this rank's pipeline stage links (worker/pp_transfer.py): the first stage encodes images and
        embeds, a later one starts from the tensors it receives, a stage before the last sends its own
        and returns an empty output (the last stage samples). `drafter`: EAGLE-3's (worker/eagle_drafter.py):
        after each eager step it proposes the next step's drafts from the target's hidden states."""
        self.model = model
        self.attention = attention
        self.max_vision_patches = max_vision_patches
        self._graphs = graphs  # replays decode steps (CUDA graphs, or their padded path eagerly)
        self.piecewise = piecewise  # runs other steps' decoder stack in pieces (CUDA graphs around attention)
        self.caches, self.layout = caches, layout
        self.num_groups = layout.num_attention_groups
        self._num_state_groups = len(layout.state_groups)
        self._state_tensors = [t for i in layout.state_layers if caches[i] is not None for t in caches[i]]
        self.stage = stage
        self.drafter = drafter
        self._draft_inputs = None  # this step's (scheduled, q_start, aux hidden states, positions) for the drafter
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler(seed)
        self.rejection = RejectionSampler(self.sampler)  # speculative decoding's verification (worker/spec_verify.py)
        self._spec: dict[str, list[int]] = {}  # this step's drafts per request (SchedulerOutput.spec_token_ids)
        self._draft_slots: dict[str, tuple[int, ...]] = {}  # ... and their state slots (SchedulerOutput.draft_state_slots)
        self.samples = samples
        self.reports_encoder = samples  # the encoder cache's counters come from this rank (rank 0)
        self.requests: dict[str, RequestState] = {}
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        # one row per held request, changed only where a step changes it; fixed in size when a CUDA graph
        # gathers from it (the graphs' max batch and max_model_len), else grown as needed
        self._tables = BlockTables(8, 16, device, growable=True, num_groups=self.num_groups)  # `tables` without graphs
        # per row: position - token index of its generated tokens, on each position row (M-RoPE: the
        # prompt's rope_delta; 1-D: 0), so a decode step's positions are one vectorised add
        self._pos_delta = np.zeros((0, model.position_rows), dtype=np.int64)
        self._linear = np.zeros(0, dtype=bool)  # whether the row's delta applies
        self._nonlinear = 0  # held requests whose delta does not apply (their positions are the family's, per step)
        self._staging = [None, None]  # two pinned host buffers, used in turns (see `_upload`)
        self._turn = 0
        self.keep_sampled = keep_sampled
        self._sampled = torch.zeros(0, dtype=torch.int64, device=device)  # without graphs: the last step's tokens
        self._last_rows: dict[str, int] = {}  # request id -> its row there, for the last step's samplers
        # how many held requests draw at random / ask for logprobs / edit their logits: when none does, the
        # sampler skips its per-row scans for them
        self._held_kinds = [0, 0, 0]
        self._prompt_logprobs_held = 0  # held requests asking for their prompt's logprobs
        self._num_behind = 0  # see `_update_states`

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self._graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        """Swapped only while no request is held (tests, the host-overhead bench): the rows of held
        requests live in the current `tables`, which the graphs replace."""
        if getattr(self, "requests", None):
            raise RuntimeError(f"cannot swap the decode graphs while {len(self.requests)} requests are held")
        self._graphs = graphs

    @property
    def tables(self) -> BlockTables:
        """The block tables: the graphs' (fixed size: they gather from it) when decode steps replay."""
        return self.graphs.tables if self.graphs is not None else self._tables

    # -- state ------------------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> list[tuple[RequestState, int]]:
        """Apply the step's changes to the per-request state and the block tables (new block ids only);
        the scheduled (state, tokens) in order. Counts the scheduled requests not at their last token
        (`_num_behind`: in their prompt, or recomputing after a preemption): a decode step has none."""
        if sched.finished_request_ids or sched.preempted_request_ids:
            for rid in sched.finished_request_ids | sched.preempted_request_ids:
                self._release(rid)
        for rid, keep in sched.truncated_blocks.items():  # a verification's rejected drafts: their blocks went back
            state = self.requests.get(rid)
            if state is not None:
                for held in state.block_ids:
                    del held[keep:]
                self.tables.truncate(state.row, keep)
        self._spec = sched.spec_token_ids
        self._draft_slots = sched.draft_state_slots
        for rid, slot in sched.moved_state_slots.items():  # a rollback kept an accepted draft's state
            self.requests[rid].state_slot = slot
        behind = 0
        for new in sched.new_requests:
            self._release(new.request_id)
            state = RequestState.from_new(new)
            self._count_kinds(state.params, 1)
            state.row = self.tables.add(state.block_ids)
            self._set_position_delta(state)
            self.requests[new.request_id] = state
            behind += state.num_computed_tokens + 1 < max(len(state.token_ids), state.num_prompt_tokens + 1)
        for cached in sched.cached_requests:
            state = self.requests[cached.request_id]
            if cached.new_block_ids:
                for held, new_ids in zip(state.block_ids, cached.new_block_ids):
                    held.extend(new_ids)
                self.tables.append(state.row, cached.new_block_ids)
            if cached.new_token_ids:
                state.token_ids.extend(cached.new_token_ids)
            computed = state.num_computed_tokens = cached.num_computed_tokens
            # behind: prompt tokens left, or generated ones to recompute (one short of the last is the last)
            behind += computed < state.num_prompt_tokens or computed + 1 < len(state.token_ids)
        self._num_behind = behind
        return [(self.requests[rid], n) for rid, n in sched.num_scheduled_tokens.items()]

    def _release(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.tables.remove(state.row)
            self._count_kinds(state.params, -1)
            self._nonlinear -= not state.linear_positions

    def _count_kinds(self, p: SamplingParams, sign: int) -> None:
        kinds = self._held_kinds
        kinds[0] += sign * (not p.greedy)
        kinds[1] += sign * p.wants_logprobs
        kinds[2] += sign * (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                            or bool(p.logit_bias) or p.min_tokens > 0)
        self._prompt_logprobs_held += sign * (p.prompt_logprobs is not None)

    def _set_position_delta(self, state: RequestState) -> None:
        """Generated tokens sit at index + a constant on every position row (the family's positions of
        the first two generated indices tell it); a family where they do not takes the slow path."""
        rows = self.tables.max_rows
        if self._pos_delta.shape[0] < rows:  # the tables grew
            self._pos_delta = np.concatenate([self._pos_delta, np.zeros((rows - self._pos_delta.shape[0],
                                                                         self._pos_delta.shape[1]), np.int64)])
            self._linear = np.concatenate([self._linear, np.zeros(rows - self._linear.shape[0], bool)])
        p = state.num_prompt_tokens
        pos = self.model.positions(state.prompt_positions, p, p + 2).numpy()  # [position_rows, 2]
        delta = pos - np.array([p, p + 1])  # [position_rows, 2]
        self._linear[state.row] = linear = bool((delta[:, 0] == delta[:, 1]).all())
        self._pos_delta[state.row] = delta[:, 0]
        state.linear_positions = linear
        self._nonlinear += not linear

    # -- the step ---------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled tokens; sample one token for each request whose computed tokens
        catch up with all its tokens this step."""
        return self.execute_async(sched).result()

    @torch.inference_mode()
    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        """`execute`, returning as soon as the step is queued on the device: its output arrives by
        `PendingOutput.result()`. A request whose last token is still on its way (sampled by the
        previous step, not yet sent by the engine) reads it from the device (`keep_sampled`). With a
        drafter the step's tokens are read at once and the next step's drafts added (`_with_drafts`)."""
        self._draft_inputs = None
        pending = self._execute_async(sched)
        if self.drafter is None or self._draft_inputs is None:
            return pending
        return self._with_drafts(pending.result())

    def _with_drafts(self, out: ModelRunnerOutput) -> PendingOutput:
        """The step's output with the next step's drafts (worker/eagle_drafter.py)."""
        scheduled, q_start, aux, positions = self._draft_inputs
        self._draft_inputs = None
        drafts, seconds = self.drafter.propose(self.model, draft_rows(scheduled, q_start, out), aux, positions)
        return Ready(dataclasses.replace(out, draft_token_ids=drafts, draft_seconds=seconds))

    def _execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        scheduled = self._update_states(sched)
        if not scheduled:
            self._last_rows = {}
            return Ready(ModelRunnerOutput())
        if sched.state_restores:  # checkpoints into the live slots of requests resuming from them
            self._copy_states(sched.state_restores)
        encoder = None  # the encoder cache's counters, when this step's vision stage ran
        spec_out = None  # a verification's (tokens, logprobs) per request (worker/spec_verify.py)
        prompt_lp = None  # the prompt logprobs this step computed (worker/prompt_logprobs.py)
        if self.graphs is not None and self._num_behind == 0 and self.graphs.covers(len(scheduled)) \
                and sched.total_num_scheduled_tokens == len(scheduled):  # one token each, every one the last
            # generated tokens only: every image is behind them (none to encode, scatter or drop), so the
            # captured forward covers the step; every row samples (its one token is its last)
            self._run_graph(scheduled)  # logits and their argmax computed in the graph
            if sched.state_checkpoints:
                self._copy_states(sched.state_checkpoints)
            n = len(scheduled)
            if self.samples and not any(self._held_kinds) and sched.grammar_bitmask is None:
                return self._greedy_from_graph([s for s, _ in scheduled])
            sample_idx = list(range(n))
            logits = self.graphs.logits[:n]  # [num_seqs, vocab]
        else:
            if self.stage is not None:
                return self._run_stage(sched, scheduled)
            self._encode_images(scheduled)
            encoder = self.encoder_cache.stats() if self.samples else None
            step = self._prepare(scheduled)
            embeds = self.model.embed_tokens(step.input_ids)  # [num_tokens, hidden]
            hidden = self._forward(embeds, step, step_images(scheduled, self.device))  # [num_tokens, hidden]
            if self.drafter is not None:  # the target's aux hidden states, before the next forward replaces them
                self._draft_inputs = (scheduled, step.q_start, self.model.aux_hidden_states(), step.positions)
            if sched.state_checkpoints:  # the states the step ended on block boundaries with, kept
                self._copy_states(sched.state_checkpoints)
            drop_passed_images(scheduled)
            if self._prompt_logprobs_held:  # every rank: the logits' gather is a collective
                prompt_lp = prompt_logprobs(self.model, scheduled, hidden, step.q_start)
            sample_idx, sample_rows = step.sample_idx, step.sample_rows
            if sched.spec_token_ids and self.samples:  # drafts verified at every one of their positions
                *spec_out, verified = verify_drafts(self.model, self.rejection, scheduled, step.q_start, hidden,
                                                    sched.spec_token_ids, sched.grammar_bitmask)
                keep = [j for j, i in enumerate(sample_idx) if i not in verified]
                sample_idx = [sample_idx[j] for j in keep]
                sample_rows = sample_rows[torch.tensor(keep, dtype=torch.long, device=sample_rows.device)]
                sched = dataclasses.replace(sched, grammar_bitmask=plain_masks(sched.grammar_bitmask,
                                                                               sched.spec_token_ids))
            if not sample_idx:
                self._last_rows = {}
                return DevicePendingOutput([], None, self.device, encoder,  # its event: the step's buffers free again
                                           prompt_lp if self.samples else None, spec_out)
            logits = self.model.compute_logits(hidden[sample_rows])  # [num_sampled, vocab]
        return self._sample(sched, scheduled, sample_idx, logits, encoder, prompt_lp, spec_out)

    def _run_stage(self, sched: SchedulerOutput, scheduled: list[tuple[RequestState, int]]) -> PendingOutput:
        """One pipeline stage's share of a step (worker/pp_transfer.py for the order of the transfers);
        no drafts (speculative decoding runs on one rank)."""
        stage = self.stage
        encoder = None
        if stage.is_first:
            stage.computing()
            self._encode_images(scheduled)
            encoder = self.encoder_cache.stats() if self.reports_encoder else None
        step = self._prepare(scheduled)
        if stage.is_first:
            embeds = self.model.embed_tokens(step.input_ids)  # [num_tokens, hidden]
            out = self.model(embeds, step.positions, self.caches, step.meta, step_images(scheduled, self.device))
        else:
            received = stage.recv(step.input_ids.shape[0])
            stage.computing()
            # the image rows only (their embeddings went into the hidden states on the first stage)
            out = self.model(received.hidden, step.positions, self.caches, step.meta,
                             stage_image_rows(scheduled, self.device), intermediate=received)
        if sched.state_checkpoints:
            self._copy_states(sched.state_checkpoints)
        drop_passed_images(scheduled)
        if not stage.is_last:
            stage.computed()
            stage.send(out)  # IntermediateTensors [num_tokens, hidden] x 2
            stage.step_done()
            self._last_rows = {}
            return Ready(ModelRunnerOutput(encoder_cache=encoder))
        stage.step_done()
        hidden = out  # [num_tokens, hidden]
        prompt_lp = prompt_logprobs(self.model, scheduled, hidden, step.q_start) if self._prompt_logprobs_held else None
        if not step.sample_idx:
            self._last_rows = {}
            pending = Ready(ModelRunnerOutput(encoder_cache=encoder, prompt_logprobs=prompt_lp or {}))
        else:
            logits = self.model.compute_logits(hidden[step.sample_rows])  # [num_sampled, vocab]
            pending = self._sample(sched, scheduled, step.sample_idx, logits, encoder, prompt_lp, None)
        stage.computed()
        return pending

    def _sample(self, sched: SchedulerOutput, scheduled: list[tuple[RequestState, int]], sample_idx: list[int],
                logits: torch.Tensor, encoder, prompt_lp, spec_out) -> PendingOutput:  # logits [num_sampled, vocab]
        """Sample the step's rows (rank 0, or of the last pipeline stage; the others return an empty output)."""
        if not self.samples:
            return Ready(ModelRunnerOutput())
        states = [scheduled[i][0] for i in sample_idx]
        counts = [scheduled[i][1] for i in sample_idx]
        if sched.grammar_bitmask is not None:  # structured outputs: only the constrained rows change
            row_of = {s.request_id: j for j, s in enumerate(states)}
            apply_token_bitmask(logits, [row_of[r] for r in sched.grammar_bitmask.request_ids],
                                sched.grammar_bitmask.bitmask)
        draws_at_random, logprobs, edits = self._held_kinds
        histories = [(s.token_ids, s.num_prompt_tokens, s.min_tokens_stop_ids, s.tally) for s in states] \
            if edits else None
        # the output index each row draws: its history may lack the token still on its way
        draws = [s.num_computed_tokens + n - s.num_prompt_tokens for s, n in zip(states, counts)] \
            if draws_at_random else None
        sampled = self.sampler.sample_on_device(logits, [s.params for s in states], histories, draws,
                                                may_edit=bool(edits), may_want_logprobs=bool(logprobs),
                                                may_draw=bool(draws_at_random))
        if self.keep_sampled:
            self._keep(states, sampled.tokens)
        return DevicePendingOutput([s.request_id for s in states], sampled, self.device, encoder, prompt_lp, spec_out)

    def _greedy_from_graph(self, states: list[RequestState]) -> PendingOutput:
        """Every held request is greedy without edits, logprobs or a grammar: the graph's argmax, already
        in `sampled_tokens` where the next step reads ids from, is the step's tokens."""
        if self.keep_sampled:
            self._last_rows = {s.request_id: j for j, s in enumerate(states)}
        tokens = self.graphs.sampled_tokens[:len(states)]  # [n] int64
        if self.device.type != "cuda":  # read at result(), after the next step's argmax: keep a copy (CUDA
            tokens = tokens.clone()     # copies to pinned memory in stream order before that step runs)
        return DevicePendingOutput([s.request_id for s in states], SampledTokens(tokens, [], []), self.device, None)

    def _forward(self, embeds: torch.Tensor, step: StepInputs, images) -> torch.Tensor:  # [num_tokens, hidden]
        """The model's forward, or its decoder stack through the piecewise graphs when they cover the step
        and the model gives the step's stack inputs."""
        pw = self.piecewise
        if pw is not None and pw.covers(embeds.shape[0]):
            inputs = self.model.stack_inputs(embeds, step.positions, images)
            if inputs is not None:
                return pw.run(*inputs, step.meta)
        return self.model(embeds, step.positions, self.caches, step.meta, images)

    def _copy_states(self, pairs: tuple[tuple[int, int], ...]) -> None:
        copy_state_slots(self._state_tensors, pairs, self.device)

    def _keep(self, states: list[RequestState], tokens: torch.Tensor) -> None:  # tokens [rows] int64
        """The step's tokens into the static buffer the next step reads ids from (the graphs' when
        they replay decode steps: captured, they read it by address)."""
        if self.graphs is not None:
            buf = self.graphs.sampled_tokens
        else:
            if self._sampled.numel() < len(states):
                self._sampled = torch.zeros(max(2 * self._sampled.numel(), len(states), 8), dtype=torch.int64,
                                            device=self.device)
            buf = self._sampled
        buf[:len(states)].copy_(tokens)
        self._last_rows = {s.request_id: j for j, s in enumerate(states)}

    def _token_source(self, state: RequestState) -> int:
        """The row of the last step's sampled tokens holding `state`'s next token."""
        row = self._last_rows.get(state.request_id)
        if row is None:
            raise RuntimeError(f"request {state.request_id!r}: token {state.num_computed_tokens} was neither sent "
                               f"by the engine ({len(state.token_ids)} known) nor sampled by the last step")
        return row

    def _encode_images(self, scheduled: list[tuple[RequestState, int]]) -> None:
        encode_images(self.model, self.encoder_cache, self.max_vision_patches, scheduled)

    def _prepare(self, scheduled: list[tuple[RequestState, int]]) -> StepInputs:
        """Pack the step's inputs with numpy from the persistent tables (no Python loop per token or per
        block), move them to the device in one copy, and gather the step's block-table rows there (every
        attention group's slots and rows at once)."""
        batch = len(scheduled)
        ids, rows, starts, counts, known, slow = [], [], [], [], [], []
        fill_at, fill_src = [], []  # tokens still on the device: their index in the step, their source row
        spec = self._spec
        for i, (s, n) in enumerate(scheduled):
            start = s.num_computed_tokens
            if n == 1:
                if start < len(s.token_ids):
                    ids.append(s.token_ids[start])
                else:  # sampled by the last step, not sent yet (asynchronous scheduling)
                    fill_at.append(len(ids))
                    fill_src.append(self._token_source(s))
                    ids.append(0)
            else:
                ids.extend(s.token_ids[start:start + n])
                if spec and s.request_id in spec:  # its last token, then the drafts it verifies
                    ids.extend(spec[s.request_id])
            rows.append(s.row)
            starts.append(start)
            counts.append(n)
            known.append(len(s.token_ids))
            if start < s.num_prompt_tokens:
                slow.append(i)  # prompt tokens: the family's positions (M-RoPE tables, images)
        row_arr = np.array(rows, dtype=np.int64)  # [batch]
        start_arr = np.array(starts, dtype=np.int64)  # [batch]
        n_arr = np.array(counts, dtype=np.int64)  # [batch]
        end_arr = start_arr + n_arr  # [batch]
        q_start = np.zeros(batch + 1, dtype=np.int64)  # [batch + 1]
        np.cumsum(n_arr, out=q_start[1:])
        num_tokens = int(q_start[-1])
        if num_tokens == batch:  # decode only: token i is request i's
            tok_req, tok_pos = np.arange(batch), start_arr  # [num_tokens]
        else:
            tok_req = np.repeat(np.arange(batch), n_arr)  # [num_tokens]
            tok_pos = start_arr[tok_req] + np.arange(num_tokens) - q_start[tok_req]  # [num_tokens]
        tok_row = row_arr[tok_req]  # [num_tokens]
        bs = self.block_size
        # [groups, num_tokens]: each group's slot of every token (one group: today's flat slots)
        slots = self.tables.host_np[:, tok_row, tok_pos // bs].astype(np.int64) * bs + tok_pos % bs
        sample_idx = np.flatnonzero(end_arr >= np.array(known, dtype=np.int64))  # [num_sampled]
        sample_rows = q_start[1:][sample_idx] - 1  # [num_sampled]
        positions = tok_pos[None, :] + self._pos_delta[tok_row].T  # [position_rows, num_tokens]
        for i in slow + [i for i in np.flatnonzero(~self._linear[row_arr]).tolist() if i not in slow]:
            s, lo, hi = scheduled[i][0], int(q_start[i]), int(q_start[i + 1])
            positions[:, lo:hi] = self.model.positions(s.prompt_positions, starts[i], starts[i] + counts[i]).numpy()
        width = int(self.tables.num_blocks[row_arr].max())
        groups = self.num_groups
        parts = [np.array(ids, dtype=np.int64), slots.reshape(-1), q_start, end_arr, sample_rows, row_arr,
                 positions.reshape(-1)]
        sizes = [num_tokens, groups * num_tokens, batch + 1, batch, len(sample_rows), batch, positions.size]
        if self._num_state_groups:  # each request's live slot; whether it starts from a state (not token 0)
            parts += [np.fromiter((s.state_slot for s, _ in scheduled), dtype=np.int64, count=batch),
                      (start_arr > 0).astype(np.int64)]
            sizes += [batch, batch]
        if fill_at:
            parts += [np.array(fill_at, dtype=np.int64), np.array(fill_src, dtype=np.int64)]
            sizes += [len(fill_at), len(fill_at)]
        dev = self._upload(parts)
        input_ids, slot_map, q_start_d, seq_lens_d, sample_rows_d, rows_d, pos_d, *rest = dev.split(sizes)
        state_slots, initial_d = (rest.pop(0), rest.pop(0)) if self._num_state_groups else (None, None)
        if rest:
            input_ids[rest[0]] = self._last_sampled().index_select(0, rest[1])
        self.tables.flush()  # new block ids since the last step: only those entries
        tables = self.tables.device_table.index_select(1, rows_d)[:, :, :width]  # [groups, batch, width] int32
        slot_map = slot_map.view(groups, num_tokens)
        q_start_d = q_start_d.int()
        common = dict(query_start_loc=q_start_d, seq_lens=seq_lens_d.int(), query_lens_cpu=counts,
                      seq_lens_cpu=end_arr.tolist(), max_query_len=int(n_arr.max()), max_seq_len=int(end_arr.max()))
        state = None if state_slots is None else StateMetadata(
            q_start_d, counts, state_slots, initial_d.bool(), [c > 0 for c in starts], int(n_arr.max()),
            draft_states(scheduled, q_start, self._draft_slots, self.device) if self._draft_slots else None)
        # the backend's per-step metadata, once per attention group
        meta = step_metadata(self.layout, self.caches, self.attention, common, slot_map, tables, state)
        return StepInputs(input_ids, pos_d.view(self.model.position_rows, num_tokens), meta, sample_rows_d,
                          sample_idx.tolist(), q_start)

    def _run_graph(self, scheduled: list[tuple[RequestState, int]]) -> torch.Tensor:  # [n, hidden]
        """A decode step packed straight into the graphs' staged inputs (one copy), then replayed."""
        n, g = len(scheduled), self.graphs
        host = g.stage(n)  # [rows of DecodeGraphs.inputs, size] int64
        src_row = g.row_src
        rows = np.fromiter((s.row for s, _ in scheduled), dtype=np.int64, count=n)  # [n]
        pos = np.fromiter((s.num_computed_tokens for s, _ in scheduled), dtype=np.int64, count=n)  # [n]
        if not self._last_rows:  # every id on the host
            host[0, :n] = [s.token_ids[s.num_computed_tokens] for s, _ in scheduled]
            if self.keep_sampled:
                host[src_row, :n] = -1
        else:  # asynchronous scheduling: the graph takes ids sampled by the last step from the device
            ids, src, last = [], [], self._last_rows
            for s, _ in scheduled:
                c = s.num_computed_tokens
                if c < len(s.token_ids):
                    ids.append(s.token_ids[c])
                    src.append(-1)
                else:
                    ids.append(0)
                    src.append(last.get(s.request_id, -2))
            if -2 in src:  # neither sent nor sampled by the last step: a bookkeeping error, named
                self._token_source(scheduled[src.index(-2)][0])
            host[0, :n] = ids
            host[src_row, :n] = src
        block, offset = np.divmod(pos, self.block_size)  # [n] each
        slots = host[1:1 + self.num_groups, :n]  # [groups, n]: each attention group's slot of the token
        np.multiply(self.tables.host_np[:, rows, block], self.block_size, out=slots)
        slots += offset
        host[g.row_table, :n] = rows
        np.add(pos, 1, out=host[g.row_len, :n])
        if g.row_state is not None:
            host[g.row_state, :n] = [s.state_slot for s, _ in scheduled]
        pos_rows = host[g.row_pos:, :n]  # [position_rows, n]
        np.add(self._pos_delta[rows].T, pos, out=pos_rows)
        if self._nonlinear == 0:
            return g.run(n)
        for i in np.flatnonzero(~self._linear[rows]).tolist():  # a family whose positions are not index + delta
            s = scheduled[i][0]
            pos_rows[:, i] = self.model.positions(s.prompt_positions, int(pos[i]), int(pos[i]) + 1)[:, 0].numpy()
        return g.run(n)

    def _last_sampled(self) -> torch.Tensor:  # [rows] int64: the last step's tokens, by row
        return self.graphs.sampled_tokens if self.graphs is not None else self._sampled

    def _upload(self, parts: list[np.ndarray]) -> torch.Tensor:  # [sum of sizes] int64, on the device
        """One int64 host buffer (pinned on CUDA, grown as needed) -> the device in one copy. Two
        buffers in turns: the copy of step t may still be in flight while step t+1 is packed."""
        total = sum(p.size for p in parts)
        if self.device.type != "cuda":
            return torch.from_numpy(np.concatenate(parts))
        buf = self._staging[self._turn]
        if buf is None or buf.numel() < total:
            buf = self._staging[self._turn] = torch.empty(max(total, 4096) * 2, dtype=torch.int64, pin_memory=True)
        self._turn ^= 1
        np.concatenate(parts, out=buf.numpy()[:total])
        return buf[:total].to(self.device, non_blocking=True)

@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [position_rows, num_tokens] int64
    meta: StepMetadata
    sample_rows: torch.Tensor  # [num_sampled] int64 rows of the hidden states to sample from
    sample_idx: list[int]  # their indices in the scheduled list
    q_start: np.ndarray  # [batch + 1] int64: where each scheduled request's rows begin (host)
