"""Turn the logits of the sampled rows into next tokens: penalties, greedy, temperature, top-k, top-p,
seed, and the logprobs of what was drawn.

Everything stays on the logits' device: on CUDA a batch of 64 sampled rows never copies its 64 x
vocab logits, nor any vocabulary of random draws, between host and device; the only copies to the
host are the tokens (and asked-for logprobs) at the end. A request with a seed draws token i of its
output with the key (seed, i) (`draw_seed`), so its tokens depend only on its own logits, never on
which other requests share the batch, and a request resumed after a preemption draws on as if
nothing happened, with nothing to replay or save. Requests without one share the engine's generator.
The draw is the exponential race: on CUDA one Triton launch for all rows (`kernels/exponential_race.py`,
Philox keyed per row), on the CPU torch generators (a device generator reseeded per seeded row).
Top-k / top-p look among the most likely tokens instead of sorting the whole vocabulary
(`top_k_top_p.py`, memory per row there).
"""
from __future__ import annotations

import torch

from vlm_sdk.outputs import TokenLogprob
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.sample.device_lists import to_device
from vlm_sdk.sample.penalties import apply_penalties, needs_edit
from vlm_sdk.sample.sampled_tokens import SampledTokens
from vlm_sdk.sample.top_k_top_p import CANDIDATES, filtered_probs

History = tuple  # (prompt + generated ids, number of prompt ids, min_tokens stop ids[, PenaltyTally])

# its [rows, vocab] temporaries at their peak, per row and vocabulary entry, are what the memory plan counts
# (vlm_sdk/memory/consumers/sampler.py WORST_BYTES_PER_ENTRY; `vlm-sdk bench --sampler` measures them)


class Sampler:
    def __init__(self, seed: int = 0, candidates: int = CANDIDATES, race_kernel: bool | None = None):
        """`seed`: the stream of the rows without a seed of their own. `candidates`: how many most
        likely tokens top-p looks among before it falls back to a full sort (see `top_k_top_p`).
        `race_kernel`: draw with the Triton exponential race (`kernels/exponential_race.py`: Philox in
        the kernel, one launch for every row, no [rows, vocab] of draws); None: on CUDA only."""
        self.seed = seed
        self.candidates = candidates
        self.race_kernel = race_kernel
        self.generators: dict[torch.device, torch.Generator] = {}  # the shared one, per logits device
        self.seeded: dict[torch.device, torch.Generator] = {}  # reseeded for each seeded row's draw

    def _generator(self, table: dict[torch.device, torch.Generator], device: torch.device) -> torch.Generator:
        if device not in table:
            table[device] = torch.Generator(device).manual_seed(self.seed)
        return table[device]

    def __call__(self, logits: torch.Tensor,  # [num_seqs, vocab] float32
                 params: list[SamplingParams],
                 histories: list[History] | None = None) -> list[int]:
        return self.sample(logits, params, histories)[0]

    def sample(self, logits: torch.Tensor,  # [num_seqs, vocab] float32
               params: list[SamplingParams],
               histories: list[History] | None = None,
               draws: list[int] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
        """The next token of each row, and its `TokenLogprob` where the row's params ask for one
        (`sample_on_device`, then read back: waits for the device)."""
        return self.sample_on_device(logits, params, histories, draws).lists()

    def sample_on_device(self, logits: torch.Tensor,  # [num_seqs, vocab] float32
                         params: list[SamplingParams],
                         histories: list[History] | None = None,
                         draws: list[int] | None = None, *,
                         may_edit: bool = True, may_want_logprobs: bool = True,
                         may_draw: bool = True) -> SampledTokens:
        """The rows' tokens (and asked-for logprobs) on the logits' device; nothing waits for the device.
        `draws[i]`: which output token of its request row i draws (a seeded row's key); default
        `len(token_ids) - num_prompt` of its history (0 without `histories`). Under asynchronous
        scheduling the runner passes it: the history then lacks the token still on its way.
        `may_*` False: the caller knows no row edits its logits / asks for logprobs / draws at random
        (the runner counts its requests' kinds), so the per-row scans for them are skipped."""
        if may_edit and histories is not None and any(needs_edit(p, len(h[0]) - h[1])
                                                      for p, h in zip(params, histories)):
            logits = logits.float().clone()  # [num_seqs, vocab]; the caller's logits stay as they were
            apply_penalties(logits, params, histories)
        tokens = logits.argmax(dim=-1)  # [num_seqs]
        want = [i for i, p in enumerate(params) if p.wants_logprobs] if may_want_logprobs else []
        if not may_draw or all(p.greedy for p in params):
            logprobs = logits[to_device(want, torch.long, logits.device)].float().log_softmax(dim=-1) \
                if want else None  # [len(want), vocab]
            return SampledTokens.gather(tokens, logprobs, want, params)
        dev = logits.device
        rows = [i for i, p in enumerate(params) if not p.greedy]
        every = len(rows) == len(params)
        mine = logits if every else logits[to_device(rows, torch.long, dev)]  # [len(rows), vocab]
        probs = filtered_probs(mine.float(), [params[i] for i in rows], self.candidates)  # [len(rows), vocab]
        seeds = [params[i].seed for i in rows]
        if draws is None:
            draws = [len(h[0]) - h[1] for h in histories] if histories is not None else [0] * len(params)
        sampled = self.draw(probs, seeds, [draws[i] for i in rows])  # [len(rows)]
        if every:
            tokens = sampled
        else:
            tokens[to_device(rows, torch.long, dev)] = sampled
        logprobs = None
        if want:
            # sampled rows: the log of what they were drawn from; greedy rows: their log-softmax
            logprobs = logits[to_device(want, torch.long, dev)].float().log_softmax(dim=-1)  # [len(want), vocab]
            pos = {i: j for j, i in enumerate(rows)}
            drawn = [k for k, i in enumerate(want) if i in pos]
            if drawn:
                src = to_device([pos[want[k]] for k in drawn], torch.long, dev)
                logprobs[to_device(drawn, torch.long, dev)] = probs[src].log_()  # a gathered copy: log in place
        return SampledTokens.gather(tokens, logprobs, want, params)

    def draw(self, probs: torch.Tensor,  # [rows, vocab] float32, each row's weights (need not sum to 1)
             seeds: list[int | None], draws: list[int]) -> torch.Tensor:  # [rows] int64
        """One token per row drawn in proportion to its weights, by the exponential race (argmax p/q with
        q ~ Exp(1) draws exactly from p): a seeded row's draw `draws[j]` is keyed (seed, draw), so the
        same row and index draw the same token whatever the batch."""
        dev = probs.device
        if self.race_kernel or (self.race_kernel is None and dev.type == "cuda"):
            from vlm_sdk.kernels.exponential_race import exponential_race  # Triton: imported where used
            return exponential_race(probs, self._race_keys(seeds, draws, dev))
        q = self._exponentials(probs.shape, seeds, draws, dev)  # [rows, vocab]
        return torch.div(probs, q, out=q).argmax(dim=-1)

    def _race_keys(self, seeds: list[int | None], draws: list[int], device: torch.device) -> torch.Tensor:
        """[rows] int64 Philox keys of the race kernel: a seeded row's is `draw_seed(seed, draw)`
        (the same token whatever the batch or a preemption); the others come from the shared generator
        on the device (no host draw)."""
        shared = [j for j, s in enumerate(seeds) if s is None]
        gen = self._generator(self.generators, device)
        if len(shared) == len(seeds):
            return torch.randint(-2 ** 63, 2 ** 63 - 1, (len(seeds),), generator=gen, device=device)
        keys = to_device([0 if s is None else _signed64(draw_seed(s, n)) for s, n in zip(seeds, draws)],
                         torch.int64, device)  # [rows]
        if shared:
            keys[to_device(shared, torch.long, device)] = torch.randint(
                -2 ** 63, 2 ** 63 - 1, (len(shared),), generator=gen, device=device)
        return keys

    def _exponentials(self, shape: torch.Size, seeds: list[int | None], draws: list[int],
                      device: torch.device) -> torch.Tensor:
        """[rows, vocab] Exp(1) draws on `device`. Rows without a seed draw together from the shared
        generator; a seeded row draws its `draws[j]`-th vector from a device generator seeded with
        (seed, draw index): its tokens depend on neither the batch nor a preemption (a resumed request
        draws its next token from the same seed and index), and no vocabulary of draws is made on the
        host or copied to the device."""
        q = torch.empty(shape, device=device)  # [rows, vocab]
        shared = [j for j, s in enumerate(seeds) if s is None]
        if len(shared) == len(seeds):  # the usual case: one call, no index tensors to upload
            return q.exponential_(1.0, generator=self._generator(self.generators, device))
        if shared:
            q[to_device(shared, torch.long, device)] = torch.empty(len(shared), shape[1], device=device).exponential_(
                1.0, generator=self._generator(self.generators, device))
        g = self._generator(self.seeded, device)
        for j, (seed, n) in enumerate(zip(seeds, draws)):
            if seed is not None:
                q[j].exponential_(1.0, generator=g.manual_seed(draw_seed(seed, n)))  # a view: fills q's row
        return q

_MASK64 = (1 << 64) - 1


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >> 63 else x


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of draw `index` of a request seeded `seed`: splitmix64 of seed + (index + 1)
    x the golden ratio, a bijection, so draws of seeds s and s + i (n samples) never share a seed
    within 2^64 / golden draws. CUDA's Philox takes all 64 bits; the CPU's mt19937 the low 32."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
