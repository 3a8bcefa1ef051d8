"""Per-request logit edits before sampling: repetition / presence / frequency penalties, logit_bias,
min_tokens. Only the rows that ask for one are touched; a batch where none does skips this module.

`apply_penalties` edits all the rows at once on the logits' device: the (row, token) pairs of every
edit are gathered on the host into one index tensor and one value tensor (two uploads per step,
whatever the number of rows), then three indexed writes apply them; no value comes from the host
any other way (a Python scalar written into a device tensor is a blocking copy). `apply_penalties_reference` is
the per-row loop it replaced (two to five small uploads and several launches per row), kept as its oracle.

A row's history may carry a `PenaltyTally` (the worker keeps one per request): its distinct tokens
on the device and its output counts, brought up to date with the tokens new since the last step, so
that a step's host work for a row does not grow with its prompt (a 32,000-token prompt with
repetition_penalty cost ~30 ms per row and step when its set was rebuilt each time).
"""
from __future__ import annotations

from collections import Counter

import torch

from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.sample.device_lists import to_device


class PenaltyTally:
    """One request's penalty inputs across steps: `seen`, its distinct token ids so far on the logits'
    device (repetition_penalty), and `output`, how often it generated each id (presence / frequency),
    each updated with the ids added since `update` last saw them."""

    def __init__(self):
        self.counted = 0  # token_ids[:counted] are in seen / output
        self._seen_ids: set[int] = set()
        self.seen: torch.Tensor | None = None  # [len(distinct)] long
        self.output: Counter = Counter()

    def update(self, token_ids: list[int], num_prompt: int, vocab: int, device: torch.device,
               repetition: bool) -> None:
        start, new = self.counted, token_ids[self.counted:]
        if not new:
            return
        self.counted = len(token_ids)
        if repetition:
            fresh = [t for t in dict.fromkeys(new) if t < vocab and t not in self._seen_ids]
            if fresh:
                self._seen_ids.update(fresh)
                more = to_device(fresh, torch.long, device)  # [len(fresh)]
                self.seen = more if self.seen is None else torch.cat([self.seen, more])
        self.output.update(new[max(num_prompt - start, 0):])

    @property
    def num_seen(self) -> int:
        return len(self._seen_ids)


def needs_edit(p: SamplingParams, num_output: int) -> bool:
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or bool(p.logit_bias) or num_output < p.min_tokens)


def apply_penalties(logits: torch.Tensor,  # [num_seqs, vocab] float32, edited in place
                    params: list[SamplingParams],
                    histories: list[tuple]) -> None:
    """`histories[i]`: row i's (prompt + generated token ids, number of prompt tokens, the ids that
    min_tokens holds back: its stop_token_ids and EOS unless ignore_eos), and optionally its
    `PenaltyTally` (else the tokens are counted afresh). As in vLLM: repetition divides a positive
    logit (multiplies a negative one) of every token seen in prompt or output; presence subtracts
    once and frequency once per occurrence, over the output only."""
    vocab = logits.shape[1]
    dev = logits.device
    kept_rows: list[int] = []  # rows whose seen tokens are a tally's device tensor
    kept_seen: list[torch.Tensor] = []
    kept_pens: list[float] = []  # their repetition penalty, per row
    rep_rows: list[int] = []  # (row, token) pairs of each kind, flattened over the rows
    rep_toks: list[int] = []
    rep_vals: list[float] = []  # the row's repetition penalty, per pair
    add_rows: list[int] = []
    add_toks: list[int] = []
    add_vals: list[float] = []  # -(presence + frequency x count) and logit_bias: they add up
    ban_rows: list[int] = []
    ban_toks: list[int] = []
    for i, (p, history) in enumerate(zip(params, histories)):
        token_ids, num_prompt, stop_ids = history[:3]
        tally = history[3] if len(history) > 3 else None
        num_output = len(token_ids) - num_prompt
        if not needs_edit(p, num_output):
            continue
        repetition = p.repetition_penalty != 1.0 and bool(token_ids)
        if tally is not None:
            tally.update(token_ids, num_prompt, vocab, dev, repetition)
        if repetition and tally is not None and tally.seen is not None:
            kept_rows.append(i)
            kept_seen.append(tally.seen)
            kept_pens.append(p.repetition_penalty)
        elif repetition:
            seen = [t for t in set(token_ids) if t < vocab]
            rep_rows += [i] * len(seen)
            rep_toks += seen
            rep_vals += [p.repetition_penalty] * len(seen)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and num_output:
            counts = tally.output if tally is not None else Counter(token_ids[num_prompt:])
            for t, n in counts.items():
                if t < vocab:
                    add_rows.append(i)
                    add_toks.append(t)
                    add_vals.append(-(p.presence_penalty + p.frequency_penalty * n))
        for t, b in p.logit_bias:
            if t < vocab:
                add_rows.append(i)
                add_toks.append(t)
                add_vals.append(b)
        if num_output < p.min_tokens:
            ids = [t for t in stop_ids if t < vocab]
            ban_rows += [i] * len(ids)
            ban_toks += ids
    sizes = [t.numel() for t in kept_seen]
    n_rep, n_kept, n_add = len(rep_rows), sum(sizes), len(add_rows)
    if not n_rep + n_kept + n_add + len(ban_rows):
        return
    n_ban = len(ban_rows)
    idx = to_device(rep_rows + rep_toks + add_rows + add_toks + ban_rows + ban_toks, torch.long, dev)  # [2 x pairs]
    # the bans' -inf travel with the other values: a Python scalar written into a CUDA tensor
    # (`logits[r, t] = -inf`) is a blocking copy of a host scalar, a host sync
    vals = to_device(rep_vals + add_vals + [float("-inf")] * n_ban, logits.dtype, dev)  # [n_rep + n_add + n_ban]
    rows, toks, pen = idx[:n_rep], idx[n_rep:2 * n_rep], vals[:n_rep]  # [n_rep] each
    if n_kept:  # the tallied rows' pairs, after the counted ones: their ids are on the device already
        per_row = to_device(sizes, torch.long, dev)  # [len(kept_rows)]; output_size: no sync
        rows = torch.cat([rows, torch.repeat_interleave(to_device(kept_rows, torch.long, dev), per_row,
                                                        output_size=n_kept)])  # [n_rep + n_kept]
        pen = torch.cat([pen, torch.repeat_interleave(to_device(kept_pens, logits.dtype, dev), per_row,
                                                      output_size=n_kept)])
        toks = torch.cat([toks, *kept_seen])
    if n_rep + n_kept:  # each (row, token) once: the gather reads logits before any write
        # through the flat view: index_select / index_copy_ of 32,000 pairs take tens of microseconds
        # on the CPU, the two-index gather and put as many milliseconds
        flat, at_ = logits.view(-1), rows * vocab + toks  # [rows x vocab], [n_rep + n_kept]
        seen = flat.index_select(0, at_)  # [n_rep + n_kept]
        flat.index_copy_(0, at_, torch.where(seen > 0, seen / pen, seen * pen))
    at = 2 * n_rep
    if n_add:  # a token both penalised and biased gets both (accumulate)
        logits.index_put_((idx[at:at + n_add], idx[at + n_add:at + 2 * n_add]), vals[n_rep:n_rep + n_add],
                          accumulate=True)
    at += 2 * n_add
    if n_ban:
        logits.index_put_((idx[at:at + n_ban], idx[at + n_ban:]), vals[n_rep + n_add:])


def apply_penalties_reference(logits: torch.Tensor,  # [num_seqs, vocab] float32, edited in place
                              params: list[SamplingParams],
                              histories: list[tuple[list[int], int, tuple[int, ...]]]) -> None:
    """The same edits row by row (the sampler before issue 19): the oracle of `apply_penalties`."""
    vocab = logits.shape[1]
    dev = logits.device
    for i, (p, (token_ids, num_prompt, stop_ids)) in enumerate(zip(params, histories)):
        num_output = len(token_ids) - num_prompt
        if not needs_edit(p, num_output):
            continue
        row = logits[i]  # [vocab], a view: edits land in `logits`
        if p.repetition_penalty != 1.0 and token_ids:
            seen = torch.tensor(sorted(set(t for t in token_ids if t < vocab)), device=dev)  # [distinct]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and num_output:
            out = torch.tensor([t for t in token_ids[num_prompt:] if t < vocab], dtype=torch.long, device=dev)
            counts = torch.bincount(out, minlength=vocab).to(row.dtype)  # [vocab]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            pairs = [(t, b) for t, b in p.logit_bias if t < vocab]
            if pairs:
                row[torch.tensor([t for t, _ in pairs], device=dev)] += torch.tensor(
                    [b for _, b in pairs], dtype=row.dtype, device=dev)  # [len(pairs)]
        if num_output < p.min_tokens:
            ids = [t for t in stop_ids if t < vocab]
            if ids:
                row[torch.tensor(ids, device=dev)] = float("-inf")
