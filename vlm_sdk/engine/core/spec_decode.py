"""Speculative decoding on the engine side: drafts before the schedule, their verification step's
tokens and KV, and the rollback of what the target rejected.

    step() with speculative_config:
      propose      each running sequence that decodes (its last token not computed yet, nothing on its
                   way) gets up to k drafts (`Sequence.spec_token_ids`; n-gram: ngram_proposer.py; EAGLE-3:
                   those the rank proposed after the previous step, worker/eagle_drafter.py), capped
                   so 1 + k tokens never pass its length limit and cut where its grammar would refuse one
      schedule     such a sequence asks for 1 + k tokens (`spec_tokens`): its last token and the drafts,
                   blocks for all of them; without room (budget, blocks) it drops its drafts first and
                   decodes one token, so speculation never preempts anyone
      worker       computes the 1 + k positions in the same step as every other sequence (prefills, plain
                   decodes), verifies the drafts against the target (sample/rejection_sampler.py) and
                   returns the accepted drafts plus one token (the correction at the first rejection,
                   else the bonus) -> ModelRunnerOutput.spec_token_ids
      postprocess  tokens appended one at a time (stops, grammar, max_tokens as ever), then `rollback`:
                   num_computed_tokens = len(token_ids) - 1 (the newest token is computed next step), and
                   the blocks past ceil(len(token_ids) / block_size) returned to the pool in every group;
                   the worker cuts its block tables the same (SchedulerOutput.truncated_blocks)

    block_size 4, 6 tokens (last not computed), k = 3:  blocks [7, 2] -> allocate for 9: [7, 2, 5]
    1 draft accepted + correction: 8 tokens, 7 computed -> keep ceil(8 / 4) = 2 blocks: 5 freed

Prefix caching stays exact: a block is offered to the cache only once full of known tokens
(`CacheCoordinator._commit` hashes `token_ids`, never drafts), and a block freed here held none.
Penalties, logit_bias and min_tokens edit each of the 1 + k rows as if the drafts before it were tokens
(worker/spec_verify.py). A sequence with a grammar speculates too: its drafts are cut to what the grammar
accepts (`validate_tokens`), and each of its 1 + k rows gets the mask of the grammar after the drafts
before it (`spec_masks`), the matcher rolled back after; it then advances over accepted tokens only.
"""
from __future__ import annotations

import time

import torch

from vlm_sdk.engine.core.ngram_proposer import propose_ngram
from vlm_sdk.engine.core.sequence import Sequence, SequenceStatus
from vlm_sdk.engine.structured_output import accept
from vlm_sdk.protocol.scheduler_output import GrammarBitmask
from vlm_sdk.spec_config import SpeculativeConfig


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.draft_tokens = 0  # drafts sent to verification, since start-up
        self.accepted_tokens = 0  # of them, accepted
        self.verify_rows = 0  # (sequence, step) pairs that verified at least one draft
        self.draft_seconds = 0.0  # time spent proposing

    def propose(self, running: list[Sequence]) -> None:
        """Drafts for every running sequence that decodes next step (see the module docstring)."""
        start = time.perf_counter()
        c = self.config
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_inflight or seq.num_computed_tokens != len(seq.token_ids) - 1:
                continue
            k = min(c.num_speculative_tokens, seq.length_limit - len(seq.token_ids) - 1)
            if k <= 0:
                continue
            if c.method == "eagle3":  # the rank's, made after the step that gave the last token
                made = seq.next_drafts
                drafts = list(made[1][:k]) if made is not None and made[0] == len(seq.token_ids) else []
            else:
                drafts = propose_ngram(seq.token_ids, c.prompt_lookup_min, c.prompt_lookup_max, k)
            if drafts and seq.matcher is not None:
                drafts = drafts[:seq.matcher.validate_tokens(drafts)]
            seq.spec_token_ids = drafts
        self.draft_seconds += time.perf_counter() - start

    def note_drafts(self, seqs: dict, drafts: dict[str, list[int]], seconds: float) -> None:
        """A step's output carried the rank's drafts (EAGLE-3) for the next step, made in `seconds`: each kept
        with the token count it follows (`Sequence.next_drafts`; `seqs`: request id -> Sequence)."""
        self.draft_seconds += seconds
        for rid, d in drafts.items():
            seq = seqs.get(rid)
            if seq is not None:
                seq.next_drafts = (len(seq.token_ids), d)

    def note_verified(self, seq: Sequence, num_tokens: int) -> None:
        """`seq`'s verification step produced `num_tokens` tokens (accepted drafts + one)."""
        self.draft_tokens += len(seq.spec_token_ids)
        self.accepted_tokens += num_tokens - 1
        self.verify_rows += 1

    def stats(self) -> dict:
        rows, drafts = self.verify_rows, self.draft_tokens
        return {"spec_method": self.config.method, "spec_num_speculative_tokens": self.config.num_speculative_tokens,
                "spec_draft_tokens": drafts, "spec_accepted_tokens": self.accepted_tokens, "spec_verify_steps": rows,
                "spec_acceptance_rate": self.accepted_tokens / drafts if drafts else 0.0,
                # vLLM's mean acceptance length: the token every verification yields (correction or bonus) counted
                "spec_mean_accepted_length": 1 + self.accepted_tokens / rows if rows else 0.0,
                "spec_draft_seconds": self.draft_seconds}


def spec_tokens(seq: Sequence, n: int, budget: int, cache, slot_reserve: int = 0) -> int:
    """The tokens a running `seq` computes this step: 1 + its drafts when it decodes and the budget and
    the free blocks hold them all (the blocks taken here), else `n` with its drafts dropped. On a model with
    state layers each draft also needs a free state slot beyond `slot_reserve` (`take_draft_slots`): drafts
    without one are dropped."""
    drafts = seq.spec_token_ids
    if n == 1 and len(seq.token_ids) - seq.num_computed_tokens == 1:
        k = min(len(drafts), budget - 1)
        if k > 0 and cache.allocate(seq, 1 + k):
            k = cache.take_draft_slots(seq, k, slot_reserve)
            if k > 0:
                del drafts[k:]
                return 1 + k
    drafts.clear()
    return n


def append_verified(seq: Sequence, tokens: list[int], now: float) -> tuple[int, str | None]:
    """Append a verification's tokens (accepted drafts, then the correction or bonus) one at a time with the
    engine's finish checks: a stop token or id, a complete grammar (its matcher advanced over each), the length
    limit; a finish drops the rest. (tokens taken, finish reason or None)."""
    token_ids, metrics = seq.token_ids, seq.metrics
    if metrics.first_token_time is None:
        metrics.first_token_time = now
    reason, taken = None, 0
    for token in tokens:
        token_ids.append(token)
        taken += 1
        if token in seq.stop_ids and len(token_ids) - seq.num_prompt_tokens >= seq.params.min_tokens:
            reason = "stop"
        elif seq.matcher is not None and (reason := accept(seq.matcher, token)) is not None:
            pass  # the grammar is complete ("stop"), or was broken ("abort")
        elif len(token_ids) >= seq.length_limit:
            reason = "length"
        if reason is not None:
            break
    metrics.generated_tokens = len(token_ids) - seq.num_prompt_tokens
    return taken, reason


def rollback(seq: Sequence, cache, truncated: dict, moved: dict | None = None) -> None:
    """After `seq`'s verification step (its tokens appended): what it computed beyond its accepted tokens
    is forgotten, and its blocks past the tokens it holds go back to the pool, last first. `truncated`
    (the scheduler's): request -> blocks kept, for the worker's tables. State layers: the state after its
    last accepted position is in that draft's slot, which becomes its live slot (`settle_draft_slots`;
    `moved`, the scheduler's: sequence -> new live slot, for the worker), nothing recomputed."""
    seq.spec_token_ids = []
    if seq.status is not SequenceStatus.RUNNING:
        return
    seq.num_computed_tokens = len(seq.token_ids) - 1
    if seq.draft_slots:
        slot = cache.settle_draft_slots(seq)
        if slot is not None and moved is not None:
            moved[seq] = slot
    keep = cache.blocks_for(len(seq.token_ids))
    if not seq.block_ids or len(seq.block_ids[0]) <= keep:
        return
    cache.truncate(seq, keep)
    if seq.num_blocks_sent > keep:
        seq.num_blocks_sent = keep
        truncated[seq] = keep


def spec_masks(rows: list[tuple[Sequence, list[int]]], vocab_size: int, fill_row) -> GrammarBitmask | None:
    """The grammar masks of constrained sequences verifying drafts: row j of a sequence is its grammar's mask
    after its first j drafts (the matcher advanced over them, then rolled back), its request id repeated once
    per row (1 + k rows, in order)."""
    if not rows:
        return None
    words = (vocab_size + 31) // 32
    total = sum(1 + len(d) for _, d in rows)
    bitmask = torch.full((total, words), -1, dtype=torch.int32)  # [rows, words]
    ids, r = [], 0
    for seq, drafts in rows:
        m = seq.matcher
        for j in range(len(drafts) + 1):
            if j == 0 and seq.num_tokens == seq.num_prompt_tokens and seq.first_mask is not None:
                bitmask[r] = seq.first_mask
            else:
                fill_row(m, bitmask, r)
            ids.append(seq.request_id)
            r += 1
            if j < len(drafts):
                m.consume_token(drafts[j])
        if drafts:
            m.rollback(len(drafts))
    return GrammarBitmask(tuple(ids), bitmask)
