"""Verify draft tokens against the target model's logits so that the output keeps the target's distribution.

A request verifying k drafts d_0..d_{k-1} has k + 1 rows of target logits: row j scores the token after
its j-th draft (row 0: after its last known token). With p_j the target's distribution at row j (after
the grammar mask, temperature, top-k and top-p, as the sampler would draw from) and q_j the draft's:

    greedy    accept d_j while d_j == argmax p_j; then the argmax of the first row not accepted
              (the correction, or after all k the bonus): exactly the tokens of decoding one at a time
    sampled   accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from
              norm(max(p_j - q_j, 0)), else (all accepted) draw the bonus from p_k. Leviathan et al. /
              vLLM's `v1/sample/rejection_sampler.py`: each output token is distributed as p.
              n-gram drafts have no distribution: q_j is a point mass at d_j, so d_j is accepted with
              probability p_j(d_j) and a rejection draws from p_j with d_j removed.

Seeds: a seeded request's output token i takes its uniform from (seed, i) and its draw from the sampler's
race keyed (seed, i) (`Sampler.draw`), so a seeded request verifying the same drafts gives the same tokens
whatever the batch; the bonus / correction is the draw the plain sampler would make at that index.
The accept decisions are read on the host (one small copy per step): the step's tokens are needed there.
"""
from __future__ import annotations

import torch

from vlm_sdk.outputs import TokenLogprob
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.sample.sampler import Sampler, draw_seed
from vlm_sdk.sample.top_k_top_p import filtered_probs

_UNIFORM_SALT = 0x5EC0DE  # a seeded request's uniforms apart from its race draws at the same index


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        """`sampler`: the step's sampler, whose race draws the corrections and bonus tokens."""
        self.sampler = sampler
        self._uniform = torch.Generator().manual_seed(sampler.seed ^ _UNIFORM_SALT)  # rows without a seed
        self._seeded = torch.Generator()

    def verify(self, logits: torch.Tensor,  # [sum(1 + k_i), vocab] float32, each request's rows back to back
               drafts: list[list[int]], params: list[SamplingParams], draws: list[int],
               draft_probs: list[torch.Tensor | None] | None = None,  # each [k_i, vocab]; None: point masses
               ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """Each request's tokens (its accepted drafts, then one drawn token) and, where its params ask,
        one `TokenLogprob` per token (in the target distribution of its row). `draws[i]`: the output index
        of request i's first token (its seed's key)."""
        targets = logits.argmax(dim=-1).tolist()  # [rows]: the greedy answer of every row, one copy
        out_tokens, out_logprobs = [], []
        o = 0
        for i, (d, p) in enumerate(zip(drafts, params)):
            k = len(d)
            rows = logits[o:o + k + 1]  # [k + 1, vocab]
            if p.greedy:
                a = 0
                while a < k and d[a] == targets[o + a]:
                    a += 1
                tokens, probs = d[:a] + [targets[o + a]], None
            else:
                q = draft_probs[i] if draft_probs is not None else None
                tokens, probs = self._sampled(rows, d, p, draws[i], q)
            out_tokens.append(tokens)
            out_logprobs.append(_logprobs(rows, probs, tokens, p) if p.wants_logprobs else None)
            o += k + 1
        return out_tokens, out_logprobs

    def _sampled(self, rows: torch.Tensor,  # [k + 1, vocab]
                 d: list[int], p: SamplingParams, first: int,
                 q: torch.Tensor | None) -> tuple[list[int], torch.Tensor]:  # q: [k, vocab] or None
        k = len(d)
        probs = filtered_probs(rows.float(), [p] * (k + 1), self.sampler.candidates)  # [k + 1, vocab]
        if k:
            at = torch.arange(k, device=probs.device)
            ids = torch.tensor(d, device=probs.device)
            ratio = probs[at, ids]  # [k]
            if q is not None:
                ratio = ratio / q[at, ids].clamp_min(torch.finfo(torch.float32).tiny)
            ratio = ratio.clamp(max=1.0).tolist()
        a = 0
        for j in range(k):
            if self._uniform_at(p.seed, first + j) >= ratio[j]:
                break
            a += 1
        if a < k:  # rejected at a: the residual of the target over the draft
            residual = probs[a].clone()  # [vocab]
            if q is None:
                residual[d[a]] = 0.0
            else:
                residual = (residual - q[a]).clamp_min_(0.0)
            if not bool(residual.sum() > 0):  # p <= q everywhere cannot reject; kept for rounding's sake
                residual = probs[a].clone()
            last = residual[None]
        else:
            last = probs[k][None]  # [1, vocab]: the bonus
        token = int(self.sampler.draw(last, [p.seed], [first + a])[0])
        return d[:a] + [token], probs

    def _uniform_at(self, seed: int | None, index: int) -> float:
        """U(0, 1) for output token `index`: keyed (seed, index) for a seeded request."""
        if seed is None:
            return float(torch.rand((), generator=self._uniform))
        g = self._seeded.manual_seed(draw_seed(seed ^ _UNIFORM_SALT, index) & 0xFFFF_FFFF_FFFF)
        return float(torch.rand((), generator=g))


def _logprobs(rows: torch.Tensor, probs: torch.Tensor | None, tokens: list[int],
              p: SamplingParams) -> list[TokenLogprob]:
    """Token j's logprob in row j's distribution: the log-softmax of the logits (greedy), or the log of the
    filtered probabilities drawn from (sampled), as the plain sampler reports them."""
    n = len(tokens)
    lp = rows[:n].float().log_softmax(dim=-1) if probs is None else probs[:n].log()  # [n, vocab]
    chosen = lp[torch.arange(n, device=lp.device), torch.tensor(tokens, device=lp.device)].tolist()
    top_vals, top_ids = lp.topk(p.logprobs, dim=-1) if p.logprobs else (lp[:, :0], lp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [TokenLogprob(t, c, tuple(zip(ti, tv))) for t, c, ti, tv in zip(tokens, chosen, top_ids, top_vals)]
