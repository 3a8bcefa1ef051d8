"""The gated delta rule (Gated DeltaNet's token mixer) over packed requests with states in slots, in
pure torch: the torch set's op and the reference of the Triton ops (`gated_delta_rule_chunk.py`,
`gated_delta_rule_recurrent.py`).

    q, k:   [T, Hk, Dk]   each k head serves Hv / Hk consecutive v heads (transformers' repeat_interleave)
    v:      [T, Hv, Dv]
    g:      [T, Hv] float32, the log decay (<= 0); beta: [T, Hv], the write strength
    state:  [num_state_slots, Hv, Dk, Dv] float32, read from and written to each request's slot

Per head, with q and k L2-normalised in float32 (eps 1e-6) and q scaled by Dk^-0.5:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T      S_t: [Dk, Dv]
    o_t = S_t^T q_t

which is transformers' `torch_recurrent_gated_delta_rule`. The chunked form (`torch_chunk_gated_delta_rule`,
the DeltaNet paper's WY / UT transform) computes the same thing 64 tokens at a time: within a chunk with
decays accumulated from its start (G_i = g_1 + ... + g_i), solve (I + L) U = beta V and (I + L) W = beta
exp(G) K for L = strictly-lower(beta_i exp(G_i - G_j) k_i . k_j); then with S the state at the chunk's
start, V' = U - W S, O = exp(G) Q S + tril(exp(G_i - G_j) q_i . k_j) V', and the next state is
exp(G_last) S + (exp(G_last - G) K)^T V'. Chunks of one request are sequential; chunks of different
requests and every head are independent. Any split of a prompt into steps gives the same state and
outputs up to float rounding: a chunk boundary only regroups the same sums.

A request with has_initial_state False starts from zeros whatever its slot holds (slots are reused).
"""
from __future__ import annotations

import torch

CHUNK = 64  # transformers' chunk_size, and the Triton kernels' tile


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and FLA's) `l2norm`: x * rsqrt(sum(x^2) + eps) over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def check_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> None:
    """ValueError naming the shapes when the inputs of the rule disagree."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if (k.shape != q.shape or v.shape[0] != t or g.shape != (t, hv) or beta.shape != (t, hv)
            or state.dim() != 4 or state.shape[1:] != (hv, dk, dv) or hv % hk):
        raise ValueError(f"gated delta rule shapes disagree: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}, "
                         f"g {list(g.shape)}, beta {list(beta.shape)}, state {list(state.shape)} (want q, k [T, Hk, "
                         f"Dk], v [T, Hv, Dv] with Hk dividing Hv, g and beta [T, Hv], state [slots, Hv, Dk, Dv])")
    if state.dtype != torch.float32:
        raise ValueError(f"the recurrent state must be float32 (decays compound over the whole sequence), got "
                         f"{state.dtype}")


def _heads(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q (normalised, scaled) and k (normalised) per v head, float32 `[T, Hv, Dk]`."""
    rep = hv // q.shape[1]
    qn = l2norm(q) * q.shape[-1] ** -0.5
    kn = l2norm(k)
    if rep > 1:
        qn, kn = qn.repeat_interleave(rep, dim=1), kn.repeat_interleave(rep, dim=1)
    return qn, kn


def _initial(state: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    init = state.index_select(0, state_slots)  # [batch, Hv, Dk, Dv], a copy
    # a reused slot's values never leak in: selected away, not multiplied by 0 (which keeps a NaN)
    return init.masked_fill_(~has_initial_state[:, None, None, None], 0.0)


def recurrent_gated_delta_rule(q: torch.Tensor,  # [batch, Hk, Dk]: one token per request
                               k: torch.Tensor,  # [batch, Hk, Dk]
                               v: torch.Tensor,  # [batch, Hv, Dv]
                               g: torch.Tensor,  # [batch, Hv] float32
                               beta: torch.Tensor,  # [batch, Hv]
                               state: torch.Tensor,  # [slots, Hv, Dk, Dv] float32, updated in place
                               state_slots: torch.Tensor,  # [batch] int64
                               has_initial_state: torch.Tensor,  # [batch] bool
                               ) -> torch.Tensor:  # [batch, Hv, Dv] v.dtype
    """A decode step: one token of each request through the recurrence."""
    check_rule(q, k, v, g, beta, state)
    qn, kn = _heads(q, k, v.shape[1])  # [B, Hv, Dk]
    s = _initial(state, state_slots, has_initial_state) * g.float().exp()[:, :, None, None]  # [B, Hv, Dk, Dv]
    delta = (v.float() - torch.einsum("bhkv,bhk->bhv", s, kn)) * beta.float()[:, :, None]  # [B, Hv, Dv]
    s = s + kn[:, :, :, None] * delta[:, :, None, :]
    state.index_copy_(0, state_slots, s)
    return torch.einsum("bhkv,bhk->bhv", s, qn).to(v.dtype)


def _chunk_table(query_lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(token index [chunks, CHUNK] with -1 past a request's end, the chunk's request [chunks], chunks per
    request): every request's tokens in chunks of CHUNK from its first new token."""
    counts = [-(-n // CHUNK) for n in query_lens]
    starts, owner, ends = [], [], []
    first = 0
    for b, (n, c) in enumerate(zip(query_lens, counts)):
        starts += range(first, first + n, CHUNK)
        ends += [first + n] * c
        owner += [b] * c
        first += n
    idx = torch.tensor(starts, device=device)[:, None] + torch.arange(CHUNK, device=device)  # [chunks, CHUNK]
    idx = torch.where(idx < torch.tensor(ends, device=device)[:, None], idx, -1)
    return idx, torch.tensor(owner, device=device), counts


def chunk_gated_delta_rule(q: torch.Tensor,  # [T, Hk, Dk]
                           k: torch.Tensor,  # [T, Hk, Dk]
                           v: torch.Tensor,  # [T, Hv, Dv]
                           g: torch.Tensor,  # [T, Hv] float32
                           beta: torch.Tensor,  # [T, Hv]
                           state: torch.Tensor,  # [slots, Hv, Dk, Dv] float32, updated in place
                           query_lens: list[int],  # new tokens per request, packed in this order
                           state_slots: torch.Tensor,  # [batch] int64
                           has_initial_state: torch.Tensor,  # [batch] bool
                           ) -> torch.Tensor:  # [T, Hv, Dv] v.dtype
    """Every request's new tokens through the rule, CHUNK tokens at a time (a loop over chunk index: the
    requests' chunks at one index run together), each continuing from its slot."""
    check_rule(q, k, v, g, beta, state)
    hv = v.shape[1]
    qn, kn = _heads(q, k, hv)  # [T, Hv, Dk]
    idx, owner, counts = _chunk_table(query_lens, q.device)
    valid = (idx >= 0)[:, None, :]  # [C, 1, CHUNK]
    at = idx.clamp(min=0)

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, Hv, ...] -> [C, Hv, CHUNK, ...], zeros past the end
        y = x.float()[at].transpose(1, 2)  # [C, Hv, CHUNK, ...]
        return y * (valid if y.dim() == 3 else valid[..., None])

    qc, kc, vc, gc, bc = chunks(qn), chunks(kn), chunks(v), chunks(g), chunks(beta)
    cum = gc.cumsum(-1)  # [C, Hv, CHUNK]: log decay from the chunk's start
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [C, Hv, i, j]
    kb = kc * bc[..., None]
    system = kb @ kc.transpose(-1, -2) * decay  # L below the diagonal (its diagonal is taken as 1: I + L)
    u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)  # [C,Hv,CHUNK,Dv]
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = qc @ kc.transpose(-1, -2) * decay  # [C, Hv, CHUNK, CHUNK]
    q_dec = qc * cum.exp()[..., None]
    k_dec = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [C, Hv, 1, 1]

    s = _initial(state, state_slots, has_initial_state)  # [batch, Hv, Dk, Dv]
    out = torch.empty_like(u)
    first = [0]
    for c in counts[:-1]:
        first.append(first[-1] + c)
    for i in range(max(counts, default=0)):  # chunk i of every request that has one
        rows = [b for b, c in enumerate(counts) if c > i]
        ids = torch.tensor([first[b] + i for b in rows], device=q.device)
        live = torch.tensor(rows, device=q.device)
        cur = s[live]
        v_new = u[ids] - w[ids] @ cur  # [n, Hv, CHUNK, Dv]
        out[ids] = q_dec[ids] @ cur + intra[ids] @ v_new
        s[live] = cur * chunk_decay[ids] + k_dec[ids].transpose(-1, -2) @ v_new
    state.index_copy_(0, state_slots, s)
    o = torch.empty(q.shape[0], hv, v.shape[2], dtype=v.dtype, device=v.device)
    keep = idx >= 0
    o[idx[keep]] = out.transpose(1, 2)[keep].to(v.dtype)  # [tokens, Hv, Dv]
    return o
