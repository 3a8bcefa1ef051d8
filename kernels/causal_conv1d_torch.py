"""Causal depthwise conv1d with a per-request state in slots, in pure torch: the torch set's op (the
Triton op is `causal_conv1d.py`) and the reference of both.

    x:           [num_tokens, C]      the packed new tokens of a step (a strided view is fine)
    weight:      [C, K]               one filter of width K per channel
    bias:        [C] or None
    conv_state:  [num_state_slots, C, K - 1]   the last K - 1 inputs of each request, oldest first
    state_slots: [batch] int64        each request's slot
    has_initial_state: [batch] bool   False: the request starts at token 0, its slot is read as zeros

For token t of a request, out[t] = act(bias + sum_j weight[:, j] * x[t - (K - 1) + j]), where inputs before
the request's first new token come from its state (zeros without one). Afterwards the slot holds the
request's last K - 1 inputs (state columns where it had fewer new tokens than K - 1). transformers keeps K
columns (`causal_conv1d_update` concatenates the K-column state and the token and keeps the last output,
so its oldest column never reaches an output); K - 1 is what the arithmetic reads. The sum and the
activation are in float32, rounded once to x's dtype; the state keeps x's values as they are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal conv1d activation {activation!r} is not one of {ACTIVATIONS}")
    return F.silu(y) if activation == "silu" else y


def check_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> None:
    """ValueError naming the shapes when x, weight and the state do not agree."""
    if x.dim() != 2 or weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(f"causal conv1d needs x [T, C], weight [C, K], conv_state [slots, C, K - 1]; got "
                         f"{list(x.shape)}, {list(weight.shape)}, {list(conv_state.shape)}")
    c, k = weight.shape
    if x.shape[1] != c or conv_state.shape[1:] != (c, k - 1) or k < 2:
        raise ValueError(f"causal conv1d shapes disagree: x {list(x.shape)}, weight {list(weight.shape)}, "
                         f"conv_state {list(conv_state.shape)} (want [T, C], [C, K >= 2], [slots, C, K - 1])")


def _initial(conv_state: torch.Tensor, state_slots: torch.Tensor,
             has_initial_state: torch.Tensor) -> torch.Tensor:  # [batch, C, K - 1] float32
    init = conv_state.index_select(0, state_slots).float()  # a copy
    # a reused slot's values never leak in: selected away, not multiplied by 0 (which keeps a NaN)
    return init.masked_fill_(~has_initial_state[:, None, None], 0.0)


def causal_conv1d_varlen(x: torch.Tensor,  # [T, C]
                         weight: torch.Tensor,  # [C, K]
                         bias: torch.Tensor | None,  # [C]
                         conv_state: torch.Tensor,  # [slots, C, K - 1], updated in place
                         query_start_loc: torch.Tensor,  # [batch + 1] int32
                         state_slots: torch.Tensor,  # [batch] int64
                         has_initial_state: torch.Tensor,  # [batch] bool
                         activation: str | None = "silu") -> torch.Tensor:  # [T, C] x.dtype
    """The conv over every request's new tokens (prefill chunks, decode rows alike), each continuing
    from its slot; the slots then hold each request's last K - 1 inputs."""
    check_conv(x, weight, conv_state)
    t, c = x.shape
    km1 = weight.shape[1] - 1
    batch = state_slots.shape[0]
    starts = query_start_loc.long()
    lens = starts[1:] - starts[:-1]  # [batch]
    # Each request's state columns, then its tokens, back to back: `ext` has batch * (K - 1) more rows
    # than x, and token i of request b sits (b + 1) * (K - 1) rows further down.
    seq = torch.repeat_interleave(torch.arange(batch, device=x.device), lens, output_size=t)  # [T]
    token_rows = torch.arange(t, device=x.device) + (seq + 1) * km1  # [T]
    state_rows = (starts[:-1] + torch.arange(batch, device=x.device) * km1)[:, None] + torch.arange(
        km1, device=x.device)  # [batch, K - 1]
    ext = torch.empty(t + batch * km1, c, dtype=torch.float32, device=x.device)
    ext[state_rows.reshape(-1)] = _initial(conv_state, state_slots, has_initial_state).transpose(1, 2).reshape(-1, c)
    ext[token_rows] = x.float()
    y = torch.zeros(t, c, dtype=torch.float32, device=x.device) if bias is None else bias.float().expand(t, c).clone()
    w = weight.float()
    for j in range(km1 + 1):  # K taps, each a gather of every token's input j - (K - 1) places back
        y += ext[token_rows - km1 + j] * w[:, j]
    # the last K - 1 rows of each request's run of `ext`: its last inputs, state columns first when short
    last_rows = (starts[1:] + torch.arange(batch, device=x.device) * km1)[:, None] + torch.arange(km1, device=x.device)
    conv_state[state_slots] = ext[last_rows.reshape(-1)].view(batch, km1, c).transpose(1, 2).to(conv_state.dtype)
    return _activate(y, activation).to(x.dtype)


def causal_conv1d_update(x: torch.Tensor,  # [batch, C]: one new token per request
                         weight: torch.Tensor,  # [C, K]
                         bias: torch.Tensor | None,  # [C]
                         conv_state: torch.Tensor,  # [slots, C, K - 1], updated in place
                         state_slots: torch.Tensor,  # [batch] int64
                         has_initial_state: torch.Tensor,  # [batch] bool
                         activation: str | None = "silu") -> torch.Tensor:  # [batch, C] x.dtype
    """A decode step: each request's window is its state and its one new token."""
    check_conv(x, weight, conv_state)
    window = torch.cat((_initial(conv_state, state_slots, has_initial_state), x.float()[:, :, None]), 2)  # [B, C, K]
    y = (window * weight.float()).sum(-1)  # [batch, C]
    if bias is not None:
        y = y + bias.float()
    conv_state[state_slots] = window[:, :, 1:].to(conv_state.dtype)
    return _activate(y, activation).to(x.dtype)
