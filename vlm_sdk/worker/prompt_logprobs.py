"""The prompt logprobs of a step (SamplingParams.prompt_logprobs = k, vLLM's field): for every prompt
position a request's chunk computes, the logprob of the next prompt token given the tokens before it,
its rank, and the k most likely tokens there.

    hidden rows of the chunk [n, hidden] -> those whose next token is a prompt token [m, hidden]
    -> logits (a slice of rows at a time) -> log_softmax (float32) -> the prompt token's logprob and rank,
       the top k -> PromptLogprobsChunk on the host

Of the model's raw distribution: nothing is sampled at a prompt position, so no penalty, bias or
temperature applies (vLLM's default, raw logprobs). Run on every rank, since the logits' vocabulary
gather is a collective under tensor parallelism; rank 0 returns them. The rows go through the LM head
`ROWS_PER_SLICE` at a time: a prompt chunk of 2,048 tokens would otherwise hold [2048, vocab] float32
logits (1.2 GiB at Qwen's 151,936 tokens) beside the step; a slice holds what a batch of sampled rows
does. Reading them to the host waits for the device: only steps with such a request pay it.
"""
from __future__ import annotations

import numpy as np
import torch

from vlm_sdk.protocol.runner_output import PromptLogprobsChunk

ROWS_PER_SLICE = 64


def prompt_logprobs(model, scheduled, hidden: torch.Tensor,  # [num_tokens, hidden]
                    q_start: np.ndarray) -> dict[str, PromptLogprobsChunk]:
    """`scheduled`: the step's (RequestState, tokens) in row order, their states as of the step's start;
    `q_start` [batch + 1]: where each request's rows begin in `hidden`."""
    out = {}
    for i, (state, n) in enumerate(scheduled):
        k = state.params.prompt_logprobs
        if k is None or len(state.token_ids) > state.num_prompt_tokens:  # recomputed after output began: sent already
            continue
        first = state.num_computed_tokens  # this chunk's first position
        last = min(first + n, state.num_prompt_tokens - 1)  # positions whose next token is a prompt token
        if last <= first:
            continue
        row = int(q_start[i])
        targets = torch.tensor(state.token_ids[first + 1:last + 1], dtype=torch.int64, device=hidden.device)  # [m]
        ids, values, ranks = [], [], []
        for lo in range(0, last - first, ROWS_PER_SLICE):
            hi = min(lo + ROWS_PER_SLICE, last - first)
            logprobs = torch.log_softmax(model.compute_logits(hidden[row + lo:row + hi]), dim=-1)  # [r, vocab] f32
            own = logprobs.gather(1, targets[lo:hi, None])  # [r, 1]
            ranks.append((logprobs >= own).sum(-1))  # [r]
            top = logprobs.topk(k, dim=-1) if k else None
            ids.append(torch.cat([targets[lo:hi, None], top.indices], 1) if k else targets[lo:hi, None])  # [r, k+1]
            values.append(torch.cat([own, top.values], 1) if k else own)  # [r, k+1]
        out[state.request_id] = PromptLogprobsChunk(
            first + 1, torch.cat(ids).to(torch.int32).cpu().numpy(), torch.cat(values).cpu().numpy(),
            torch.cat(ranks).cpu().numpy())
    return out
