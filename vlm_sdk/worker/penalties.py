"""Per-request logit edits before sampling: repetition / presence / frequency penalties, logit_bias,
min_tokens. Only the rows that ask for one are touched; a batch where none does skips this module."""
from __future__ import annotations

import torch

from vlm_sdk.sampling_params import SamplingParams


def needs_edit(p: SamplingParams, num_output: int) -> bool:
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or bool(p.logit_bias) or num_output < p.min_tokens)


def apply_penalties(logits: torch.Tensor,  # [num_seqs, vocab] float32, edited in place
                    params: list[SamplingParams],
                    histories: list[tuple[list[int], int, tuple[int, ...]]]) -> None:
    """`histories[i]`: row i's (prompt + generated token ids, number of prompt tokens, the ids that
    min_tokens holds back: its stop_token_ids and EOS unless ignore_eos). As in vLLM: repetition
    divides a positive logit (multiplies a negative one) of every token seen in prompt or output;
    presence subtracts once and frequency once per occurrence, over the output only."""
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
