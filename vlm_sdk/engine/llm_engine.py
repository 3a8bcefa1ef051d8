"""The engine: load once, then `step()` = schedule -> run -> postprocess. Requests arrive as checked
`PromptInputs` from its `inputs` (engine/input/processor.py: tokenizer, guard, chat setup, grammars,
the family's processor), which `LLM`, `AsyncLLM` and the replicas call first.

    schedule:    Scheduler.schedule() on live Sequences, then worker_input() -> plain SchedulerOutput
    run:         executor.execute(SchedulerOutput): every rank runs the step (vlm_sdk/executor/);
                 rank 0 samples -> ModelRunnerOutput (request id -> token)
    postprocess: append tokens, finish on EOS / stop_token_ids / max_tokens / max_model_len
                 -> [EngineOutput] (token ids; text is the OutputProcessor's, off this thread)

Asynchronous scheduling (`EngineArgs.async_scheduling`, on by default on CUDA with one rank): the
step is launched without waiting for it (`executor.execute_async`), and the previous step's output is
read and post-processed while it runs:

    step() call k:   schedule(k) -> launch(k) -> read(k-1) -> postprocess(k-1) -> outputs of k-1
    device:          ... | step k-1 | step k     (the host work of call k+1 runs under step k)

Scheduling step k+1 before step k's tokens are known, a decoding sequence asks for the token still
on the device (`Sequence.num_inflight`; the runner takes its id from the device); a sequence that
finishes at step k has computed one token more in step k+1, which is dropped. A step that samples a
request whose grammar or penalties need its every token on the host is read at once.

Pipeline micro-batches (`pipeline_micro_batches`, by default one per stage: vLLM's batch queue,
`step_with_batch_queue`): up to that many steps are in flight through the stages at once. A call to
`step()` first schedules a micro-batch from the requests with nothing in flight (at most its share of
them: engine/core/scheduler.py) while the queue has room and launches it (`executor.execute_async` returns once stage 0
has run it); it returns at once while the queue still has room and the micro-batch had tokens, else it
waits for the oldest micro-batch and post-processes it. Outputs are applied in launch order.

    step():  schedule(k+1) -> launch(k+1) -> read(k) -> postprocess(k)     (queue of 2)
    stages:  stage 0 | k+1 | k+2 |
             stage 1 |  k  | k+1 | k+2 |

Not thread-safe by itself: `LLM` drives it from the caller's thread, `AsyncLLM` from one engine
thread. `inputs.build_prompt` touches only the prompt tokenizer (behind a lock) and may run on any
thread; `step` never touches a tokenizer.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

import torch

from vlm_sdk.config import EngineArgs, fp8_kv_cache_runs, int_kv_cache_runs, resolve_rank_config
from vlm_sdk.engine.core.cache_coordinator import CacheCoordinator
from vlm_sdk.engine.output.engine_output import EngineOutput
from vlm_sdk.engine.core.preemption_watch import PreemptionWatch, preemption_warning
from vlm_sdk.engine.core.scheduler import ScheduledBatch, Scheduler
from vlm_sdk.engine.core.sequence import Sequence, SequenceStatus
from vlm_sdk.engine.core.spec_decode import SpecDecoder, append_verified, rollback, spec_masks
from vlm_sdk.engine.core.vision_budget import step_shares
from vlm_sdk.engine.input.processor import InputProcessor
from vlm_sdk.engine.structured_output import Grammar, MaskFiller, accept, fill_row
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.executor import make_executor
from vlm_sdk.hub import resolve_model
from vlm_sdk.memory.image_fit import check_largest_image_fits
from vlm_sdk.memory.inputs import memory_inputs
from vlm_sdk.memory.startup import lower_kv_runs, scheduler_config, size_rank_caches, startup_report
from vlm_sdk.model_loader import read_checkpoint
from vlm_sdk.models.registry import resolve
from vlm_sdk.multimodal.inputs import PromptInputs
from vlm_sdk.protocol.rank import RankLoad
from vlm_sdk.protocol.runner_output import EncoderCacheStats, ModelRunnerOutput, PendingOutput
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.spec_config import check_speculation

logger = logging.getLogger("vlm_sdk")


class LLMEngine:
    def __init__(self, model: str, args: EngineArgs):
        self.args = args
        model = resolve_model(model, args.revision)  # a Hub id -> its snapshot directory
        info = read_checkpoint(model)
        self.checkpoint = info
        family = resolve([info.architecture], args.model_family)
        # requests' way in: tokenizer, guard, chat setup, grammars, the family's processor
        self.inputs = inputs = InputProcessor(model, info, family, args)
        self.eos_token_ids = inputs.eos_token_ids
        self._fill_masks = MaskFiller(inputs.vocab_size)
        # every default that depends on the device or the rank count, decided once (refusing
        # async_scheduling=True with tensor parallelism before any rank starts); ranks receive it
        self.rank_config = resolve_rank_config(args)
        self.async_scheduling = self.rank_config.async_scheduling
        # rank 0's worker in this process; under tensor parallelism one more process per rank
        self.executor = make_executor(model, self.rank_config, info.hf_config, family)
        try:
            self._start(info, family)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, info, family) -> None:
        """Size the KV cache from every rank's memory (the smallest any rank can hold: vlm_sdk/memory/),
        allocate it, and build the scheduler."""
        args, executor, rc = self.args, self.executor, self.rank_config
        loads: list[RankLoad] = executor.collective_rpc("load_report")
        self.device, self.dtype = torch.device(loads[0].device), rc.torch_dtype
        largest_image = self.inputs.processor.largest_image()
        meta_model = family.meta_model(info.hf_config, self.dtype, rc.parallel, args.shard_vision)
        memory = memory_inputs(family, info, args, meta_model, self.dtype, executor.world_size,
                               on_gpu=self.device.type == "cuda", decode_graphs=rc.decode_graphs,
                               piecewise_graphs=rc.piecewise_graphs)
        self.max_position_embeddings = memory.max_position_embeddings
        layout = memory.layout  # the model's cache groups (memory_inputs refused specs that cannot share a pool)
        if args.speculative_config is not None:  # before any cache is sized: what cannot verify is refused first
            check_speculation(args.speculative_config, layout.specs, family.display_name)
        # measured on CUDA even when the cache size is given: the report shows it
        profiles = executor.collective_rpc("profile_memory", largest_image, self.max_position_embeddings,
                                           memory.held_vision_tokens)
        runs = lower_kv_runs(fp8_kv_cache_runs(self.device, rc.attention_backend),
                             int_kv_cache_runs(self.device, rc.attention_backend))
        ranks = size_rank_caches(memory, loads, profiles, executor.collective_rpc("memory_snapshot"),
                                 family.plan_setting[1], fp8_runs="fp8" in runs, int_runs="int8" in runs)
        self.cache_config = min((r.cache for r in ranks), key=lambda c: c.num_blocks)  # every rank holds this many
        encoder_tokens, prefill_tokens = step_shares(args, family.whole_images)
        self.scheduler_config = dataclasses.replace(scheduler_config(memory, self.cache_config),
                                                    max_num_encoder_tokens_per_step=encoder_tokens,
                                                    max_prefill_tokens_with_decodes=prefill_tokens)
        check_largest_image_fits(memory.image, family.plan_setting[1], self.cache_config, self.scheduler_config,
                                 self.max_position_embeddings, args)
        self.inputs.set_capacity(self.cache_config, self.scheduler_config, self.max_position_embeddings)
        # vision runs in groups no bigger than the image the profile measured
        executor.collective_rpc("init_cache", self.cache_config, self.scheduler_config.max_model_len,
                                largest_image.size)
        self.memory_report = startup_report(memory, loads, ranks, self.cache_config, self.scheduler_config,
                                            measured=profiles[0] is not None, runs=runs)
        logger.info("%s", self.memory_report.format())
        if family.whole_images:
            check_whole_image_budget(self.scheduler_config.max_num_batched_tokens, largest_image.num_tokens,
                                     family.display_name)
        self.cache = CacheCoordinator(layout, self.cache_config.num_blocks, args.block_size,
                                      args.enable_prefix_caching, self.cache_config.num_state_slots,
                                      whole_images=family.whole_images)
        # pipeline micro-batches in flight at once (1: one step at a time)
        self.micro_batches = min(args.micro_batches(), getattr(self.executor, "max_concurrent_batches", 1))
        self.scheduler = Scheduler(self.scheduler_config, self.cache, micro_batches=self.micro_batches)
        self._batch_queue: deque[tuple[ScheduledBatch, PendingOutput]] = deque()  # launched micro-batches, oldest first
        # speculative decoding (engine/core/spec_decode.py): drafts before each schedule, verified by the ranks
        self.spec = SpecDecoder(args.speculative_config) if args.speculative_config is not None else None
        self.requests: dict[str, Sequence] = {}
        self._next_id = 0
        # running totals since start-up, for /metrics counters
        self.totals = {"prompt_tokens": 0, "image_tokens": 0, "generation_tokens": 0}
        self.preemptions = PreemptionWatch(args.preemption_warning_per_minute)
        self._inflight: tuple[ScheduledBatch, PendingOutput] | None = None  # launched, output not read
        self._constrained: dict[str, Sequence] = {}  # live requests with a grammar: their masks are filled
        self._encoder_cache = EncoderCacheStats()  # rank 0's counters, as the last step that encoded left them

    @property
    def load_seconds(self) -> float:
        return self.memory_report.load_seconds

    def shutdown(self) -> None:
        """End every rank (tensor parallelism) and the grammar workers with their processes. Idempotent."""
        self.inputs.close()
        self.executor.shutdown()

    # -- requests (prompts are the InputProcessor's: engine/input/processor.py) --------------------
    def add_request(self, prompt: PromptInputs, params: SamplingParams | None = None,
                    request_id: str | None = None, grammar: Grammar | None = None, group=None) -> str:
        """`grammar`: `inputs.compile_grammar(params)` done beforehand (else it is compiled here, if needed).
        `group`: the request this sequence belongs to (hashable; default: its own), whose sequences
        share the waiting queue's fair share (engine/core/waiting_queue.py)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.n > 1:  # one engine request is one sequence; LLM / AsyncLLM expand n
            raise InvalidRequestError(f"n={params.n}: LLMEngine.add_request runs one sample; add "
                                      f"params.sample(i) for i in range(n) (as LLM and AsyncLLM do)", param="n")
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        self.inputs.check_params(params)
        self.inputs.check_prompt(prompt, params)
        if grammar is None:
            grammar = self.inputs.compile_grammar(params, prompt)
        seq = Sequence(request_id, prompt, params, group=group)
        if grammar is not None:
            seq.matcher, seq.first_mask = grammar.matcher(), grammar.first_mask
        seq.sync_sampling = grammar is not None or params.min_tokens > 0 or params.repetition_penalty != 1.0 \
            or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        # what `_postprocess` checks per token, resolved once
        seq.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seq.length_limit = min(seq.length_limit, self.scheduler_config.max_model_len)
        if grammar is not None:
            self._constrained[request_id] = seq
        if params.min_tokens:
            eos = () if params.ignore_eos else tuple(sorted(self.eos_token_ids))
            seq.min_tokens_stop_ids = tuple(params.stop_token_ids) + eos
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.totals["prompt_tokens"] += seq.num_prompt_tokens
        self.totals["image_tokens"] += seq.metrics.image_tokens
        return request_id

    def abort(self, request_id: str, reason: str = "abort") -> EngineOutput | None:
        """Finish `request_id` now (an abort, or "stop" when the output processor found a stop
        string), freeing its blocks; None if it is not running here."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self._finish(seq, reason, time.monotonic())
        return _output(seq, [])

    def has_unfinished(self) -> bool:
        """Requests to run, or finished ones whose state the workers still hold: one more `step`
        frees it on every rank (an idle engine keeps nothing of a finished request)."""
        return self.scheduler.has_unfinished() or self.scheduler.has_worker_finished() or self._inflight is not None \
            or bool(self._batch_queue)

    def release_finished(self) -> None:
        """Nothing left to run: read the last launched step (its tokens belong to finished requests:
        dropped) and let every rank drop the state of the finished requests now, not at the next
        request's first step."""
        if self.scheduler.has_unfinished():
            return
        if self._inflight is not None:
            self._read_inflight()
        while self._batch_queue:
            self._read_oldest()
        if self.scheduler.has_worker_finished():
            self.step()

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """schedule -> run -> postprocess: one output per request that sampled a token."""
        if self.micro_batches > 1:
            return self._step_queued()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if batch.preempted:
            self._note_preemptions(len(batch.preempted))
        if not batch.scheduled:
            outputs = self._read_inflight() if self._inflight is not None else []
            # nothing to run, but the ranks must still drop what they hold of finished requests and of
            # the ones this schedule preempted (the only running one may preempt itself while its token is
            # on its way): a preempted request they kept would resume on its old blocks and state slot
            if batch.preempted or self.scheduler.has_worker_finished():
                self.executor.execute(self.scheduler.worker_input(batch))
            return outputs
        work = self._with_masks(batch, self.scheduler.worker_input(batch))
        read_now = self._launched(batch)
        if not self.async_scheduling:
            return self._postprocess(batch, self.executor.execute(work))
        pending = self.executor.execute_async(work)
        outputs = self._read_inflight() if self._inflight is not None else []
        self._inflight = (batch, pending)
        if read_now:
            outputs += self._read_inflight()
        return outputs

    def _with_masks(self, batch: ScheduledBatch, work):
        """`work` with the grammar masks of the constrained rows the step samples (if any)."""
        if self._constrained:
            # a row that has generated nothing is at its grammar's start: its first mask was made with it
            masks = self._fill_masks([(seq.request_id, seq.matcher, seq.first_mask if seq.num_tokens ==
                                       seq.num_prompt_tokens else None) for seq, n in batch.scheduled
                                      if seq.matcher is not None
                                      and seq.num_computed_tokens + n == seq.num_tokens + seq.num_inflight])
            if work.spec_token_ids:  # verifying rows: a mask per position, after the drafts before it
                extra = spec_masks([(seq, seq.spec_token_ids) for seq, n in batch.scheduled
                                    if seq.matcher is not None and seq.request_id in work.spec_token_ids],
                                   self.inputs.vocab_size, fill_row)
                if extra is not None:
                    masks = extra if masks is None else type(masks)(
                        masks.request_ids + extra.request_ids, torch.cat([masks.bitmask, extra.bitmask]))
            if masks is not None:
                work = dataclasses.replace(work, grammar_bitmask=masks)
        return work

    def _step_queued(self) -> list[EngineOutput]:
        """A step with pipeline micro-batches (module docstring): launch one if the queue has room and there is
        work; return at once while there is room still, else read and post-process the oldest."""
        queue = self._batch_queue
        if len(queue) < self.micro_batches:
            batch = self.scheduler.schedule()  # requests with a token in flight are left out
            if batch.preempted:
                self._note_preemptions(len(batch.preempted))
            # an empty one still tells the ranks of the finished and preempted requests (see `step`)
            if batch.scheduled or batch.preempted or self.scheduler.has_worker_finished():
                work = self._with_masks(batch, self.scheduler.worker_input(batch))
                self._launched(batch)
                queue.append((batch, self.executor.execute_async(work)))
                if batch.scheduled and len(queue) < self.micro_batches:
                    return []  # filling the queue comes before reading outputs (vLLM)
        return self._read_oldest() if queue else []

    def _read_oldest(self) -> list[EngineOutput]:
        batch, pending = self._batch_queue.popleft()
        return self._postprocess(batch, pending.result())

    @staticmethod
    def _launched(batch: ScheduledBatch) -> bool:
        """Move the scheduled sequences' computed tokens on; count the tokens the step samples as on
        their way. Whether a sampled sequence needs its token on the host before the next schedule."""
        read_now = False
        for seq, n in batch.scheduled:
            seq.num_computed_tokens += n
            # the step samples its next token (a verification step computes its drafts past it too)
            if seq.num_computed_tokens >= len(seq.token_ids) + seq.num_inflight:
                seq.num_inflight += 1
                if seq.sync_sampling:
                    read_now = True
        return read_now

    def _read_inflight(self) -> list[EngineOutput]:
        """Wait for the launched step and post-process it."""
        batch, pending = self._inflight
        self._inflight = None
        return self._postprocess(batch, pending.result())

    def _postprocess(self, batch: ScheduledBatch, result: ModelRunnerOutput) -> list[EngineOutput]:
        """Append each sampled token and decide whether it finishes its request. Runs for every
        sequence at every step on the engine thread: plain attribute work, inlined (`stop_ids` and
        `length_limit` were resolved by `add_request`; the output processor copies the metrics)."""
        outputs = []
        now = time.monotonic()
        sampled, logprobs = result.sampled_token_ids, result.logprobs
        verified, spec_logprobs = result.spec_token_ids, result.spec_logprobs
        if result.encoder_cache is not None:
            self._encoder_cache = result.encoder_cache
        for request_id, chunk in result.prompt_logprobs.items():
            seq = self.requests.get(request_id)
            if seq is not None and len(seq.token_ids) == seq.num_prompt_tokens:  # sent once output began: kept
                seq.prompt_logprobs.write(chunk.start, chunk.token_ids, chunk.logprobs, chunk.ranks)
        finished = SequenceStatus.FINISHED
        generated = 0
        for seq, n in batch.scheduled:
            token = sampled.get(seq.request_id)
            if token is None:
                if verified and seq.request_id in verified:
                    out = self._append_verified(seq, verified[seq.request_id], spec_logprobs.get(seq.request_id), now)
                    if out is not None:
                        outputs.append(out)
                        generated += len(out.new_token_ids)
                continue
            seq.num_inflight -= 1
            if seq.status is finished:  # finished (or aborted) while this token was on its way: dropped
                continue
            token_ids, metrics = seq.token_ids, seq.metrics
            token_ids.append(token)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            num_output = metrics.generated_tokens = len(token_ids) - seq.num_prompt_tokens
            reason = None
            if token in seq.stop_ids and num_output >= seq.params.min_tokens:  # stop_token_ids, EOS unless ignore_eos
                reason = "stop"  # (min_tokens bans them until then; were all banned, the token sampled stays)
            elif seq.matcher is not None and (reason := accept(seq.matcher, token)) is not None:
                pass  # the grammar is complete ("stop"), or was broken ("abort")
            elif len(token_ids) >= seq.length_limit:  # max_tokens, or max_model_len
                reason = "length"
            if reason is not None:
                self._finish(seq, reason, now)
            out = EngineOutput(seq.request_id, [token], reason, metrics, num_output)
            if logprobs:
                logprob = logprobs.get(seq.request_id)
                if logprob is not None:
                    out.new_logprobs = [logprob]
            if num_output == 1 and seq.prompt_logprobs is not None:  # the whole prompt is computed by now
                out.prompt_logprobs = seq.prompt_logprobs
            outputs.append(out)
            generated += 1
        self.totals["generation_tokens"] += generated
        if result.draft_token_ids or result.draft_seconds:  # EAGLE-3: the next step's drafts, after the tokens above
            self.spec.note_drafts(self.requests, result.draft_token_ids, result.draft_seconds)
        return outputs

    def _append_verified(self, seq: Sequence, tokens: list[int], logprobs, now: float) -> EngineOutput | None:
        """A verification step's tokens appended (`spec_decode.append_verified`), the request finished or its
        rejected drafts rolled back. None when the request finished while they were on their way."""
        seq.num_inflight -= 1
        self.spec.note_verified(seq, len(tokens))
        if seq.status is SequenceStatus.FINISHED:
            return None
        taken, reason = append_verified(seq, tokens, now)
        if reason is not None:
            self._finish(seq, reason, now)
        else:
            rollback(seq, self.cache, self.scheduler.truncated, self.scheduler.moved_slots)
        out = EngineOutput(seq.request_id, tokens[:taken], reason, seq.metrics, seq.num_output_tokens)
        if logprobs is not None:
            out.new_logprobs = logprobs[:taken]
        return out

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.request_id, None)
        self._constrained.pop(seq.request_id, None)
        seq.metrics.finished_time = now

    def _note_preemptions(self, count: int) -> None:
        running = self.scheduler.running
        args, cache = self.args, self.cache_config

        def describe(n: int) -> str:
            seqs = running + list(self.scheduler.waiting)[:count]  # the evicted went back to the front
            mean = sum(s.num_tokens for s in seqs) // max(len(seqs), 1)
            return preemption_warning(n, args.preemption_warning_per_minute, cache.num_blocks, cache.block_size,
                                      len(running) + count, args.max_num_seqs, mean,
                                      cache.blocks_for(max(mean, 1)) if self.cache.num_groups > 1 else None)
        self.preemptions.record(count, describe)

    def stats(self) -> dict:
        """Live numbers: KV blocks used and free (`kv_blocks_cached`: free blocks that still hold
        reusable prefix content; they count as free), the longest prompt that would fit in the free
        blocks right now (0 when the cache is full; never above max_model_len), preemptions (all, and
        in the last minute), queue lengths, prefix- and encoder-cache hits and lookups, the grammar
        cache's bytes and its processes' resident memory, token totals since start-up, and what the
        engine holds: the KV cache's dtype and the weights' format."""
        bm, enc = self.cache, self._encoder_cache  # rank 0's encoder cache (every rank's is alike)
        # the longest prompt the free blocks hold (in every attention group) and a free state slot allows
        free = dataclasses.replace(self.cache_config, num_blocks=bm.num_free_blocks).capacity_tokens
        if bm.state_pool is not None and bm.num_free_slots == 0:
            free = 0
        largest_now = min(free, self.scheduler_config.max_model_len)
        return {"kv_blocks_total": bm.num_blocks, "kv_blocks_used": bm.num_used_blocks,
                "kv_blocks_free": bm.num_free_blocks, "kv_block_size": bm.block_size,
                "kv_capacity_tokens": self.cache_config.capacity_tokens,
                "kv_bytes_per_block": self.cache_config.bytes_per_block,
                "kv_cache_dtype": self.memory_report.kv_cache_dtype, "weight_format": self.memory_report.weight_format,
                "largest_prompt_tokens_now": largest_now,
                "max_model_len": self.scheduler_config.max_model_len,
                "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_preemptions": self.scheduler.num_preemptions,
                "num_preemptions_last_minute": self.preemptions.count_last_minute(),
                "prefix_cache_hit_tokens": bm.hit_tokens, "prefix_cache_query_tokens": bm.query_tokens,
                "kv_blocks_cached": bm.num_cached_free_blocks, "cache_groups": bm.group_stats(),
                "prefix_cache_kinds": bm.prefix_reuse(self.scheduler_config.max_num_seqs),
                "prefix_cache_kind_hit_tokens": dict(bm.kind_hit_tokens),
                "encoder_cache_hits": enc.hits,
                "encoder_cache_queries": enc.queries, "encoder_cache_bytes": enc.num_bytes,
                "grammar_cache_bytes": self.inputs.grammars.cache_bytes,
                "grammar_process_bytes": self.inputs.grammars.process_bytes(),
                **{f"total_{k}": v for k, v in self.totals.items()},
                **(self.spec.stats() if self.spec is not None else {})}



def check_whole_image_budget(max_num_batched_tokens: int, image_tokens: int, model: str) -> None:
    """A model whose image tokens attend to each other computes an image in one prefill chunk: one step's
    budget must hold the largest one (`InvalidRequestError` naming the setting otherwise)."""
    if max_num_batched_tokens < image_tokens:
        raise InvalidRequestError(
            f"{model}'s image tokens attend to each other, so a prefill chunk holds an image's {image_tokens} "
            f"tokens whole; max_num_batched_tokens={max_num_batched_tokens} is below that: set "
            f"max_num_batched_tokens to at least {image_tokens} (--max-num-batched-tokens)",
            param="max_num_batched_tokens")


def _output(seq: Sequence, new_token_ids: list[int]) -> EngineOutput:
    return EngineOutput(seq.request_id, new_token_ids, seq.finish_reason, seq.metrics, seq.num_output_tokens)
