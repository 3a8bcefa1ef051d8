"""Turn the logits of the sampled rows into next tokens: greedy, temperature, top-k, top-p, seed.

A request with a seed draws from its own `torch.Generator`, so its tokens depend only on its own
logits, never on which other requests share the batch. Requests without one share the engine's
generator.
"""
from __future__ import annotations

import torch

from vlm_sdk.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor,  # [num_seqs, vocab] float32
                 params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        greedy_tokens = logits.argmax(dim=-1).tolist()
        if all(p.greedy for p in params):
            return greedy_tokens
        tokens = list(greedy_tokens)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        # sample on the host: per-request generators are CPU generators, and rows are few
        probs = self._probs(logits[rows].float().cpu(), [params[i] for i in rows])  # [len(rows), vocab]
        for j, i in enumerate(rows):
            gen = generators[i] or self.generator
            # the exponential race (argmax p/q, q ~ Exp(1)) draws exactly from p with one RNG call per row
            q = torch.empty_like(probs[j]).exponential_(1.0, generator=gen)
            tokens[i] = int((probs[j] / q).argmax())
        return tokens

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
        logits = logits / temps
        vocab = logits.shape[-1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, order = logits.sort(dim=-1, descending=True)  # [rows, vocab]
            ranks = torch.arange(vocab)[None, :]
            drop = ranks >= torch.tensor(top_ks)[:, None]
            sorted_probs = sorted_logits.softmax(dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= torch.tensor(top_ps, dtype=logits.dtype)[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return logits.softmax(dim=-1)
