"""A state layer's part in speculative decoding: in a verification step, the state after each draft position
is left in that draft's slot (`StateMetadata.drafts`, a `DraftStates`), so that the engine keeps the state at
the last accepted position without computing anything again (engine/core/spec_decode.py `rollback`).

    request: last token t, drafts d0 d1 (rows t d0 d1), live slot L, draft slots s0 s1
    the layer as ever      L <- state after d1 (every draft accepted)
    here                   s0 <- state after t, s1 <- state after d0
    2 accepted: L stays; 1: s1 becomes the live slot; 0: s0 does (the others go back to the pool)

The conv state after row j is the last K - 1 conv inputs up to it: the K - 1 columns the slot held before the
step and the step's inputs, cut at j (gathers, no arithmetic). The recurrent state after row j is the rule over
the rows up to j from the state before the step: one decode-form step of the kernel set per position, each from
the slot the previous one wrote (the conv's outputs, q, k, v, g and beta of those rows, are the step's own).
That is the decode rule plain decoding runs for those tokens, so what a verification keeps is what decoding one
token at a time would have held, up to the rounding of the live slot's chunked form.

Cost per verification, per layer: k recurrent steps and k state copies beside the step's own pass (vLLM's
fused recurrent kernel writes the k states from one pass: a kernel of ours to write, measured on a GPU first).
"""
from __future__ import annotations

import torch

from vlm_sdk.attention.metadata import DraftStates
from vlm_sdk.layers.ops import KernelOps


def conv_before(conv_state: torch.Tensor,  # [slots, C, K - 1]
                drafts: DraftStates) -> torch.Tensor:  # [R, C, K - 1], a copy
    """The verifying requests' conv states before the step writes their live slots."""
    return conv_state.index_select(0, drafts.live)


def recurrent_before(state: torch.Tensor,  # [slots, Hv, Dk, Dv] float32
                     drafts: DraftStates) -> None:
    """Each verifying request's recurrent state before the step, copied into its first draft's slot (where the
    rule over its first row then runs: `keep_recurrent_states`)."""
    state.index_copy_(0, drafts.steps[0].state_slots, state.index_select(0, drafts.live))


def keep_conv_states(conv_state: torch.Tensor,  # [slots, C, K - 1], the draft slots written
                     before: torch.Tensor,  # [R, C, K - 1] (`conv_before`)
                     x: torch.Tensor,  # [T, C]: the step's conv inputs
                     drafts: DraftStates) -> None:
    """Slot s_j of each request <- its last K - 1 conv inputs up to row j."""
    km1 = before.shape[2]
    offsets = torch.arange(drafts.max_rows, device=x.device)  # [rows]
    at = (drafts.first[:, None] + offsets).clamp_(max=x.shape[0] - 1)  # [R, rows]: past a request's end: unread
    ext = torch.cat((before, x[at].transpose(1, 2).to(before.dtype)), 2)  # [R, C, K - 1 + rows]
    for j, (step, rows) in enumerate(zip(drafts.steps, drafts.rows)):
        conv_state.index_copy_(0, step.state_slots, ext[rows, :, j + 1:j + 1 + km1])


def keep_recurrent_states(ops: KernelOps, q: torch.Tensor,  # [T, Hk, Dk]
                          k: torch.Tensor,  # [T, Hk, Dk]
                          v: torch.Tensor,  # [T, Hv, Dv]
                          g: torch.Tensor,  # [T, Hv] float32
                          beta: torch.Tensor,  # [T, Hv]
                          state: torch.Tensor,  # [slots, Hv, Dk, Dv] float32, the draft slots written
                          drafts: DraftStates) -> None:
    """Slot s_j of each request <- the rule over its rows 0..j from its state before the step (s_0 holds that
    state: `recurrent_before`): position by position, s_j starting from s_{j-1}."""
    for j, (tok, step) in enumerate(zip(drafts.token, drafts.steps)):
        if j:
            state.index_copy_(0, step.state_slots, state.index_select(0, drafts.source[j]))
        ops.gated_delta_rule(q[tok], k[tok], v[tok], g[tok], beta[tok], state, step)  # its outputs: the step's own
