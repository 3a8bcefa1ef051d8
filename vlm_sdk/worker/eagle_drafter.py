"""EAGLE-3 drafts on the rank (speculative_config method "eagle3"): after each target step, the draft head
(models/common/eagle3_draft.py) runs over the positions the target computed, then proposes k tokens for
every request that got a new token; the engine verifies them next step (engine/core/spec_decode.py).

    the step computed positions s..e of a request (a prefill chunk, one decode token, or 1 + k verified rows
    of which the first a + 1 stand), with the target's aux hidden states h_s..h_e (the three layers')
      draft prefill     rows t = s..e': input (token t + 1, fc(h_t)), its K/V stored at t's slot in the
                        draft's cache; token t + 1 is the next prompt token, the sampled one, or the accepted
                        drafts and the correction (e' = s + a for a verification: rejected rows are skipped)
      drafts            the last row's head -> d_0; then k - 1 steps at t = e' + 1, ...: input (d_{j-1}, the
                        row before's pre-norm output) -> d_j, their K/V kept for this proposal only

Draft cache: one K and one V tensor `[num_blocks, block_size, kv_heads, head_dim]` indexed by the target's
block ids (its first attention group's table: vLLM's design, the draft layer a page in every block). It is
sized with the target's blocks (the worker adds the draft page to bytes per block), so what frees a block
(finish, preemption, a verification's rollback) frees the draft's page too: it cannot leak. Only positions
whose target hidden state is known are stored, so they lie within the blocks the request holds after a
rollback; a prefix-cache hit reuses the draft pages of the cached blocks (computed when they were).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from vlm_sdk.models.common.eagle3_draft import Eagle3Draft


class EagleDrafter:
    def __init__(self, draft: Eagle3Draft, num_speculative_tokens: int, block_size: int, device: torch.device):
        self.draft, self.k, self.block_size, self.device = draft, num_speculative_tokens, block_size, device
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def allocate(self, num_blocks: int, dtype: torch.dtype) -> None:
        c = self.draft.cfg
        shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        self.kv = (torch.zeros(shape, dtype=dtype, device=self.device),
                   torch.zeros(shape, dtype=dtype, device=self.device))

    @torch.inference_mode()
    def propose(self, model, rows: list[tuple], aux: torch.Tensor,  # [num_tokens, 3 * target_hidden]
                positions: torch.Tensor,  # [position_rows, num_tokens] the target's
                ) -> tuple[dict[str, list[int]], float]:
        """`rows`: per scheduled request (state, first row in the step, its next tokens (one per row the draft
        prefills), whether it proposes). (request id -> k drafts, seconds)."""
        t0 = time.perf_counter()
        idx, ids, pos_idx, slots, spans = [], [], [], [], []
        bs = self.block_size
        for state, row0, nxt, _ in rows:
            start, m = state.num_computed_tokens, len(nxt)
            idx.append(np.arange(row0, row0 + m))
            ids.extend(nxt)
            tok = np.arange(start, start + m)
            table = np.asarray(state.block_ids[0], dtype=np.int64)
            slots.append(table[tok // bs] * bs + tok % bs)
            spans.append((start, m))
        if not ids:
            return {}, 0.0
        index = torch.from_numpy(np.concatenate(idx)).to(self.device)  # [R]
        hidden = self.draft.combine(aux.index_select(0, index))  # [R, hidden]
        pos = self._positions(positions.index_select(1, index), torch.from_numpy(
            np.concatenate([np.arange(s, s + m) for s, m in spans])).to(self.device))
        slot_t = torch.from_numpy(np.concatenate(slots)).to(self.device)  # [R]
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [R]
        normed, prenorm = self.draft(input_ids, hidden, pos, lambda q, k, v: self._prefill_attend(
            q, k, v, slot_t, rows, spans))
        offsets = np.cumsum([0] + [m for _, m in spans])
        last = [int(offsets[j + 1]) - 1 for j, r in enumerate(rows) if r[3]]
        proposers = [(r[0], s, m) for r, (s, m) in zip(rows, spans) if r[3]]
        if not last:
            return {}, time.perf_counter() - t0
        pick = torch.tensor(last, dtype=torch.long, device=self.device)
        tokens = [self.draft.draft_tokens(normed.index_select(0, pick))]  # [P] each
        h = prenorm.index_select(0, pick)  # [P, hidden]
        local: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in proposers]
        for j in range(1, self.k):
            at = [s + m - 1 + j for _, s, m in proposers]  # the position of row t = e' + j
            p_rows = [model.positions(st.prompt_positions, t, t + 1) for (st, _, _), t in zip(proposers, at)]
            pos = self._positions(torch.cat(p_rows, dim=1).to(self.device),
                                  torch.tensor(at, dtype=torch.long, device=self.device))
            normed, h = self.draft(tokens[-1], h, pos, lambda q, k, v: self._step_attend(
                q, k, v, proposers, local, j))
            tokens.append(self.draft.draft_tokens(normed))
        drafts = torch.stack(tokens, dim=1).tolist()  # [P, k]
        return {st.request_id: d for (st, _, _), d in zip(proposers, drafts)}, time.perf_counter() - t0

    def _positions(self, target: torch.Tensor,  # [position_rows, R] the target's positions of the rows
                   index: torch.Tensor) -> torch.Tensor:  # [R] their token indices
        """The draft's rotary positions: the target's 3-axis ones for an M-RoPE draft, else the index."""
        if self.draft.position_rows == 1:
            return index
        return target if target.shape[0] == 3 else target[:1].expand(3, -1)

    def _context(self, state, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft K/V of `state`'s positions 0..length-1 ([length, Hkv, D] each), from its blocks."""
        bs = self.block_size
        tok = np.arange(length)
        slots = torch.from_numpy(np.asarray(state.block_ids[0], dtype=np.int64)[tok // bs] * bs + tok % bs)
        k, v = self.kv
        slots = slots.to(self.device)
        return k.view(-1, *k.shape[2:]).index_select(0, slots), v.view(-1, *v.shape[2:]).index_select(0, slots)

    def _prefill_attend(self, q, k, v, slot_t, rows, spans):  # q [R, H, D], k/v [R, Hkv, D] -> [R, H, D]
        ck, cv = self.kv
        ck.view(-1, *ck.shape[2:]).index_copy_(0, slot_t, k.to(ck.dtype))
        cv.view(-1, *cv.shape[2:]).index_copy_(0, slot_t, v.to(cv.dtype))
        out, o = [], 0
        for (state, _, _, _), (start, m) in zip(rows, spans):
            keys, values = self._context(state, start + m)
            out.append(_attend(q[o:o + m], keys, values, start))
            o += m
        return torch.cat(out)

    def _step_attend(self, q, k, v, proposers, local, j):  # q [P, H, D], k/v [P, Hkv, D] -> [P, H, D]
        out = []
        for r, (state, s, m) in enumerate(proposers):
            local[r].append((k[r:r + 1], v[r:r + 1]))
            keys, values = self._context(state, s + m)
            keys = torch.cat([keys] + [a for a, _ in local[r]])  # [s + m + j, Hkv, D]
            values = torch.cat([values] + [b for _, b in local[r]])
            out.append(_attend(q[r:r + 1], keys, values, s + m + j - 1))
        return torch.cat(out)


def draft_rows(scheduled: list, q_start: np.ndarray, out) -> list[tuple]:
    """`EagleDrafter.propose`'s rows from the step's output (`ModelRunnerOutput`): per scheduled (state, n),
    the tokens after each position the target computed that stands (a verification's accepted drafts and
    correction; a sampled row's new token; a prompt chunk's next prompt tokens), and whether it proposes
    (it got a token this step)."""
    rows = []
    for i, (state, n) in enumerate(scheduled):
        rid, start, row0 = state.request_id, state.num_computed_tokens, int(q_start[i])
        if rid in out.spec_token_ids:
            rows.append((state, row0, list(out.spec_token_ids[rid]), True))
        elif rid in out.sampled_token_ids:
            rows.append((state, row0, state.token_ids[start + 1:start + n] + [out.sampled_token_ids[rid]], True))
        else:  # inside its prompt (or recomputing): every next token is known
            rows.append((state, row0, state.token_ids[start + 1:start + n + 1], False))
    return rows


def _attend(q: torch.Tensor,  # [n, H, D]: positions first..first + n - 1
            k: torch.Tensor, v: torch.Tensor,  # [first + n, Hkv, D]: positions 0..first + n - 1
            first: int) -> torch.Tensor:  # [n, H, D]
    """Causal attention of n queries over a sequence's keys (GQA: each KV head serves H / Hkv query heads)."""
    n, h, _ = q.shape
    group = h // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)  # [H, L, D]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1).to(q.dtype)  # [H, L, D]
    mask = torch.arange(k.shape[0], device=q.device)[None, :] <= \
        torch.arange(first, first + n, device=q.device)[:, None]  # [n, L]
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask).transpose(0, 1)
