"""Turn the logits of the sampled rows into next tokens: penalties, greedy, temperature, top-k, top-p,
seed, and the logprobs of what was drawn.

A request with a seed draws from its own `torch.Generator`, so its tokens depend only on its own
logits, never on which other requests share the batch. Requests without one share the engine's
generator. Everything but the seeded draws stays on the logits' device: on CUDA a batch of 64
sampled rows never copies its 64 x vocab logits to the host.
"""
from __future__ import annotations

import torch

from vlm_sdk.outputs import TokenLogprob
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.worker.penalties import apply_penalties, needs_edit

# per row: (prompt + generated token ids, number of prompt tokens, the ids min_tokens masks)
History = tuple[list[int], int, tuple[int, ...]]


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}  # the shared one, per logits device

    def _shared(self, device: torch.device) -> torch.Generator:
        if device not in self.generators:
            self.generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self.generators[device]

    def __call__(self, logits: torch.Tensor,  # [num_seqs, vocab] float32
                 params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 histories: list[History] | None = None) -> list[int]:
        return self.sample(logits, params, generators, histories)[0]

    def sample(self, logits: torch.Tensor,  # [num_seqs, vocab] float32
               params: list[SamplingParams],
               generators: list[torch.Generator | None],
               histories: list[History] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """The next token of each row, and its `TokenLogprob` where the row's params ask for one."""
        if histories is not None and any(needs_edit(p, len(h[0]) - h[1]) for p, h in zip(params, histories)):
            logits = logits.float().clone()  # [num_seqs, vocab]; the caller's logits stay as they were
            apply_penalties(logits, params, histories)
        tokens = logits.argmax(dim=-1)  # [num_seqs]
        want = [i for i, p in enumerate(params) if p.wants_logprobs]
        if all(p.greedy for p in params):
            logprobs = logits[want].float().log_softmax(dim=-1) if want else None  # [len(want), vocab]
            return tokens.tolist(), self._pack(tokens, logprobs, want, params)
        dev = logits.device
        rows = [i for i, p in enumerate(params) if not p.greedy]
        probs = self._probs(logits[rows].float(), [params[i] for i in rows])  # [len(rows), vocab], on dev
        # the exponential race (argmax p/q, q ~ Exp(1)) draws exactly from p with one RNG call per row:
        # rows without a seed draw together from the shared generator; a seeded row draws from its own
        # (CPU) generator, so its tokens do not depend on the batch or the device
        shared = [j for j, i in enumerate(rows) if generators[i] is None]
        if shared:
            draws = torch.empty(len(shared), probs.shape[1], device=dev).exponential_(1.0, generator=self._shared(dev))
        if len(shared) == len(rows):  # the usual case: no index tensors to upload
            q = draws
        else:
            q = torch.empty_like(probs)
            if shared:
                q[torch.tensor(shared, device=dev)] = draws
            for j, i in enumerate(rows):
                if generators[i] is not None:
                    q[j] = torch.empty(probs.shape[1]).exponential_(1.0, generator=generators[i]).to(dev)
        sampled = (probs / q).argmax(dim=-1)  # [len(rows)]
        if len(rows) == len(params):
            tokens = sampled
        else:
            tokens[torch.tensor(rows, device=dev)] = sampled
        logprobs = None
        if want:
            # sampled rows: the log of what they were drawn from; greedy rows: their log-softmax
            logprobs = logits[want].float().log_softmax(dim=-1)  # [len(want), vocab]
            pos = {i: j for j, i in enumerate(rows)}
            drawn = [k for k, i in enumerate(want) if i in pos]
            if drawn:
                src = torch.tensor([pos[want[k]] for k in drawn], device=dev)
                logprobs[torch.tensor(drawn, device=dev)] = probs[src].log()
        return tokens.tolist(), self._pack(tokens, logprobs, want, params)

    @staticmethod
    def _pack(tokens: torch.Tensor,  # [num_seqs]
              logprobs: torch.Tensor | None,  # [len(want), vocab]
              want: list[int], params: list[SamplingParams]) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(params)
        if not want:
            return out
        k = max(params[i].logprobs for i in want)
        chosen = logprobs.gather(1, tokens[want][:, None])[:, 0].tolist()  # [len(want)]
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()  # one copy to the host for all rows
        token_list = tokens.tolist()
        for j, i in enumerate(want):
            n = params[i].logprobs
            out[i] = TokenLogprob(token_list[i], chosen[j], tuple(zip(top_ids[j][:n], top_vals[j][:n])))
        return out

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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
            drop |= mass_before >= torch.tensor(top_ps, dtype=logits.dtype, device=dev)[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return logits.softmax(dim=-1)


def skip_draws(generator: torch.Generator, num_draws: int, vocab: int) -> None:
    """Advance a seeded request's generator past `num_draws` draws of `vocab` exponentials, the
    draws its tokens generated before a preemption used (`Sampler` draws one per sampled token)."""
    for _ in range(num_draws):
        torch.empty(vocab).exponential_(1.0, generator=generator)
