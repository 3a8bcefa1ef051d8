"""The verification half of a speculative step on rank 0: the logits at every position of the requests
verifying drafts, their grammar masks, and the rejection sampler (sample/rejection_sampler.py).

    scheduled   a (1 + 2)  b (prefill chunk of 7)  c (1)       spec_token_ids {"a": [d0, d1]}
    rows        a0 a1 a2 | b0 .. b6 | c0                   a0: after a's last token, a1: after d0, a2: after d1
    verified    logits of a0 a1 a2 -> RejectionSampler -> a's tokens (accepted drafts + one)
    plain       b6 and c0 -> the usual sampler

The model computed the drafts' K/V with the rest of the step; what the target rejects is rolled back by the
engine (engine/core/spec_decode.py), which cuts the tables here next step (`truncated_blocks`). On a model with
state layers, the step's `DraftStates` (`draft_states`) tell them where to leave the state after each draft; the
engine then makes the slot of the last accepted position the request's live slot (`moved_state_slots`).
"""
from __future__ import annotations

import numpy as np
import torch

from vlm_sdk.attention.metadata import DraftStates, StateMetadata
from vlm_sdk.protocol.scheduler_output import GrammarBitmask
from vlm_sdk.sample.penalties import apply_penalties
from vlm_sdk.sample.rejection_sampler import RejectionSampler
from vlm_sdk.sample.token_mask import apply_token_bitmask


def verify_drafts(model, rejection: RejectionSampler, scheduled: list, q_start: np.ndarray,
              hidden: torch.Tensor,  # [num_tokens, hidden]
              spec: dict[str, list[int]], masks: GrammarBitmask | None) -> tuple[dict, dict, set[int]]:
    """(request id -> tokens, request id -> logprobs, the indices in `scheduled` it verified)."""
    idx = [i for i, (s, _) in enumerate(scheduled) if s.request_id in spec]
    starts = q_start[idx]  # [len(idx)]
    counts = q_start[[i + 1 for i in idx]] - starts  # [len(idx)]: 1 + k each
    rows = np.concatenate([np.arange(a, a + n) for a, n in zip(starts.tolist(), counts.tolist())])  # [R]
    logits = model.compute_logits(hidden[torch.from_numpy(rows).to(hidden.device)])  # [R, vocab]
    states = [scheduled[i][0] for i in idx]
    if masks is not None:
        first = {}
        o = 0
        for s, n in zip(states, counts.tolist()):
            first[s.request_id] = o
            o += n
        mask_rows, logit_rows, seen = [], [], {}
        for m, rid in enumerate(masks.request_ids):
            if rid in first:
                j = seen.get(rid, 0)
                seen[rid] = j + 1
                mask_rows.append(m)
                logit_rows.append(first[rid] + j)
        if mask_rows:
            apply_token_bitmask(logits, logit_rows, masks.bitmask[mask_rows])
    drafts = [list(spec[s.request_id]) for s in states]
    edit_logits(logits, states, counts.tolist(), drafts)
    # the output index of each request's first token this step: its seed's key
    draws = [s.num_computed_tokens + 1 - s.num_prompt_tokens for s in states]
    tokens, logprobs = rejection.verify(logits, drafts, [s.params for s in states], draws)
    out_tokens = {s.request_id: t for s, t in zip(states, tokens)}
    out_logprobs = {s.request_id: lp for s, lp in zip(states, logprobs) if lp is not None}
    return out_tokens, out_logprobs, set(idx)


def edit_logits(logits: torch.Tensor,  # [R, vocab], edited in place
                states: list, counts: list[int], drafts: list[list[int]]) -> None:
    """Penalties, logit_bias and min_tokens on the rows of requests that ask for them: row j of a request
    edits as if its first j drafts were already its tokens (counted afresh from that history: the tally the
    plain sampler keeps holds the known tokens only), so a verification edits exactly as decoding one token
    at a time would have."""
    rows, params, histories = [], [], []
    o = 0
    for s, n, d in zip(states, counts, drafts):
        p = s.params
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 \
                or p.logit_bias or p.min_tokens > 0:
            known = s.token_ids[:s.num_computed_tokens + 1]
            for j in range(n):
                rows.append(o + j)
                params.append(p)
                histories.append((known + d[:j], s.num_prompt_tokens, s.min_tokens_stop_ids))
        o += n
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    edited = logits.index_select(0, index).float()  # [len(rows), vocab]
    apply_penalties(edited, params, histories)
    logits.index_copy_(0, index, edited.to(logits.dtype))


def plain_masks(masks: GrammarBitmask | None, spec: dict[str, list[int]]) -> GrammarBitmask | None:
    """The mask rows of the requests sampling one token (those not verifying drafts)."""
    if masks is None:
        return None
    keep = [m for m, rid in enumerate(masks.request_ids) if rid not in spec]
    if not keep:
        return None
    if len(keep) == len(masks.request_ids):
        return masks
    return GrammarBitmask(tuple(masks.request_ids[m] for m in keep), masks.bitmask[keep])


def draft_states(scheduled: list, q_start: np.ndarray, slots: dict[str, tuple[int, ...]],
                 device: torch.device) -> DraftStates:
    """Where the step's state layers leave the state after each draft (attention/metadata.py `DraftStates`):
    `slots` request id -> a slot per draft (SchedulerOutput.draft_state_slots); every index in one upload."""
    reqs = [(int(q_start[i]), s) for i, (s, _) in enumerate(scheduled) if s.request_id in slots]
    mine = [slots[s.request_id] for _, s in reqs]
    ks = [len(d) for d in mine]
    parts = [np.array([s.state_slot for _, s in reqs], np.int64), np.array([f for f, _ in reqs], np.int64)]
    for j in range(max(ks)):  # per draft position: the requests with more than j drafts
        r = [x for x, k in enumerate(ks) if k > j]
        parts += [np.array([reqs[x][0] + j for x in r], np.int64),  # row j of each
                  np.array([mine[x][j - 1] if j else reqs[x][1].state_slot for x in r], np.int64),  # state before
                  np.array([mine[x][j] for x in r], np.int64),  # state after
                  np.array(r, np.int64)]
    dev = torch.from_numpy(np.concatenate(parts)).to(device, non_blocking=True).split([p.size for p in parts])
    live, first, per = dev[0], dev[1], dev[2:]
    steps = []
    for j in range(max(ks)):
        n = per[4 * j].shape[0]
        steps.append(StateMetadata(torch.arange(n + 1, dtype=torch.int32, device=device), [1] * n, per[4 * j + 2],
                                   torch.ones(n, dtype=torch.bool, device=device), [True] * n, 1))
    return DraftStates(live, first, tuple(per[0::4]), tuple(per[1::4]), tuple(steps), tuple(per[3::4]), 1 + max(ks))
