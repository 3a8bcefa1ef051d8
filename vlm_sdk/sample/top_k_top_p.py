"""The distribution a sampled row draws from: temperature, then top-k and top-p, as probabilities.

`filtered_probs` looks for each row's kept tokens among its `candidates` most likely ones
(`torch.topk`, sorted) instead of sorting the whole vocabulary: a top-k row keeps at most k of them,
and a top-p row's nucleus is nearly always far smaller than 1,024 tokens. A row whose nucleus might
reach past the candidates (top-p only, the candidates' mass still below top_p: a flat distribution)
is cut again on the device (`kernels/top_p_cut.py`: the largest threshold whose mass reaches top_p,
by bisection, no host sync) on CUDA, or from a sort of its whole row on the CPU, which learns on the
host whether any row needs it (a sync only the CPU path makes; the CPU has no overlap to lose).

Same distribution as `filtered_probs_reference` (the sampler's full sort before issue 19, kept as the
oracle): the top-p mass is that of the whole tempered distribution (not renormalised after top-k),
the token that crosses top_p stays, the kept tokens are renormalised; top_p 1 cuts nothing. Only ties
at the cut may keep a different one of equal tokens (topk and sort order ties their own way).

Memory per row (float32, vocabulary V, C candidates), besides the logits: the reference holds about
a dozen [V] temporaries at its peak (sorted logits and their int64 order, the drop mask, sorted probs,
cumsum, mass before, the masked copy, the -inf canvas, the softmax: ~40 V bytes); `filtered_probs`
holds one [V] buffer (the tempered probabilities, cut in place: 4 V bytes, 0.6 MB at V = 151,936)
plus ~30 C bytes of candidates; a row sent to the full sort adds ~30 V bytes while it is cut.
`vlm-sdk bench --sampler` measures the sampler's peak (BENCHMARKS.md).
"""
from __future__ import annotations

import torch

from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.sample.device_lists import to_device

CANDIDATES = 1024  # the top-p nucleus is looked for among this many most likely tokens first


def filtered_probs(logits: torch.Tensor,  # [rows, vocab] float32, not edited
                   params: list[SamplingParams], candidates: int = CANDIDATES,
                   device_cut: bool | None = None) -> torch.Tensor:
    """[rows, vocab] probabilities after temperature, top-k and top-p (zero outside what is kept).
    `device_cut`: cut the nuclei that pass the candidates on the device (`kernels/top_p_cut.py`, no
    host sync) instead of from a full sort; None: on CUDA (the CPU has no overlap to lose, and keeps
    the sort's exact prefix at ties)."""
    dev = logits.device
    vocab = logits.shape[1]
    probs = _tempered_probs(logits, params)  # [rows, vocab]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    rows = [i for i, (k, p) in enumerate(zip(top_ks, top_ps)) if k < vocab or p < 1.0]
    if not rows:
        return probs
    # enough candidates for the largest top-k, and `candidates` for rows with top-p alone
    kc = min(vocab, max(top_ks[i] if top_ks[i] < vocab else candidates for i in rows))
    every = len(rows) == len(params)
    rows_t = None if every else to_device(rows, torch.long, dev)  # [len(rows)]
    sub = probs if every else probs[rows_t]  # [len(rows), vocab]
    k_t = to_device([top_ks[i] for i in rows], torch.long, dev)[:, None]  # [len(rows), 1]
    p_t = to_device([_mass_cut(top_ps[i]) for i in rows], probs.dtype, dev)[:, None]  # [len(rows), 1]
    vals, idx = sub.topk(kc, dim=-1)  # [len(rows), kc] each, most likely first
    keep, mass = _keep(vals, k_t, p_t)  # [len(rows), kc], [len(rows)]
    far = None
    if kc < vocab and any(top_ks[i] > kc and top_ps[i] < 1.0 for i in rows):
        # the candidates may not hold the whole nucleus: no top-k within them and their mass below
        # top_p (then the first token past them would still be kept)
        short = (k_t[:, 0] > kc) & (mass < p_t[:, 0])  # [len(rows)]
        if device_cut if device_cut is not None else dev.type == "cuda":
            from vlm_sdk.kernels.top_p_cut import top_p_cut_  # Triton: imported where used
            top_p_cut_(sub, short, p_t[:, 0].contiguous())  # short rows cut, the others zeroed
            sub.scatter_(1, idx, vals.masked_fill_(~(keep | short[:, None]), 0.0))
            sub /= sub.sum(dim=-1, keepdim=True)
            if not every:
                probs[rows_t] = sub
            return probs
        # on the CPU: those rows sort everything
        if bool(short.any()):  # the host sync of the CPU path
            far = short.nonzero()[:, 0]  # [num_far]
            full = sub[far]  # [num_far, vocab], their tempered probabilities before the cut below
    sub = _scatter_kept(sub, vals, idx, keep)
    if far is not None:
        vals, idx = full.sort(dim=-1, descending=True)  # [num_far, vocab] each
        keep, _ = _keep(vals, k_t[far], p_t[far])
        sub[far] = _scatter_kept(full, vals, idx, keep)
    if not every:
        probs[rows_t] = sub
    return probs


def _keep(vals: torch.Tensor,  # [n, c] probabilities, most likely first
          k_t: torch.Tensor,  # [n, 1] top-k
          p_t: torch.Tensor,  # [n, 1] top-p mass cut
          ) -> tuple[torch.Tensor, torch.Tensor]:  # [n, c] bool, a prefix of each row; [n] mass of the c
    """Keep rank r while r < top_k and the mass before it is below top_p (the crossing token stays)."""
    mass_before = vals.cumsum(dim=-1)  # [n, c]
    total = mass_before[:, -1].clone()  # [n]
    mass_before -= vals
    keep = (torch.arange(vals.shape[1], device=vals.device)[None, :] < k_t) & (mass_before < p_t)
    return keep, total


def _scatter_kept(out: torch.Tensor,  # [n, vocab], overwritten
                  vals: torch.Tensor, idx: torch.Tensor,  # [n, c] each
                  keep: torch.Tensor) -> torch.Tensor:  # [n, c] bool
    """`out` zero but for the kept candidates, renormalised (vals is edited)."""
    out = out.zero_().scatter_(1, idx, vals.masked_fill_(~keep, 0.0))
    out /= out.sum(dim=-1, keepdim=True)
    return out


def _mass_cut(top_p: float) -> float:
    """top_p 1 cuts nothing: without this, a float32 cumsum that rounds up to 1.0 before the last
    tokens dropped a tail of a top-k row (the reference did, before issue 19)."""
    return top_p if top_p < 1.0 else float("inf")


def _tempered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """softmax(logits / temperature) in one [rows, vocab] buffer (softmax's own steps, in place)."""
    temps = to_device([p.temperature for p in params], logits.dtype, logits.device)[:, None]  # [rows, 1]
    x = logits / temps  # [rows, vocab], the only full-size allocation
    x -= x.amax(dim=-1, keepdim=True)
    x.exp_()
    x /= x.sum(dim=-1, keepdim=True)
    return x


def filtered_probs_reference(logits: torch.Tensor,  # [rows, vocab] float32
                             params: list[SamplingParams]) -> torch.Tensor:
    """The full-vocabulary sort (the sampler before issue 19): the oracle of `filtered_probs`."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)[:, None]
    logits = logits / temps
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [rows, vocab]
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= torch.tensor(top_ks, device=dev)[:, None]
        sorted_probs = sorted_logits.softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= torch.tensor([_mass_cut(p) for p in top_ps], dtype=logits.dtype, device=dev)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(dim=-1)
