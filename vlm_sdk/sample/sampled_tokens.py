"""A step's sampled tokens (and asked-for logprobs) on the device, and their way to the host.

The sampler ends on the device (`SampledTokens.gather`); `start_copy` queues the copies into pinned
host memory without waiting, so under asynchronous scheduling the engine schedules and launches the
next step while this one still runs; `lists()` reads the host copies once they have landed (the
caller waits on the step's event first: `pending_output.DevicePendingOutput`). Without `start_copy`,
`lists()` reads the device tensors directly (a blocking copy, as a synchronous step wants).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vlm_sdk.outputs import TokenLogprob
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.sample.device_lists import to_device


@dataclass
class SampledTokens:
    tokens: torch.Tensor  # [rows] int64
    want: list[int]  # the rows asking for logprobs, and how many top entries each asks for
    num_top: list[int]
    chosen: torch.Tensor | None = None  # [len(want)] float32: the logprob of each drawn token
    top_vals: torch.Tensor | None = None  # [len(want), k] float32, k = max(num_top)
    top_ids: torch.Tensor | None = None  # [len(want), k] int64

    @classmethod
    def gather(cls, tokens: torch.Tensor,  # [rows] int64
               logprobs: torch.Tensor | None,  # [len(want), vocab] float32
               want: list[int], params: list[SamplingParams]) -> "SampledTokens":
        """Reduce the logprob rows to what is returned (the drawn token's, the top k), on the device."""
        out = cls(tokens, want, [params[i].logprobs for i in want])
        if want:
            k = max(out.num_top)
            out.chosen = logprobs.gather(1, tokens[to_device(want, torch.long, tokens.device)][:, None])[:, 0]
            out.top_vals, out.top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        return out

    def start_copy(self) -> None:
        """Queue the copies to pinned host memory (CUDA; nothing to do on the CPU). The caller records
        an event after this and waits on it before `lists()`."""
        if self.tokens.device.type != "cuda":
            return
        for name in ("tokens", "chosen", "top_vals", "top_ids"):
            t = getattr(self, name)
            if t is not None:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                setattr(self, name, host)

    def lists(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """The tokens, and a `TokenLogprob` for each row that asked (None for the others)."""
        tokens = self.tokens.tolist()
        out: list[TokenLogprob | None] = [None] * len(tokens)
        if not self.want:
            return tokens, out
        chosen, top_vals, top_ids = self.chosen.tolist(), self.top_vals.tolist(), self.top_ids.tolist()
        for j, (i, n) in enumerate(zip(self.want, self.num_top)):
            out[i] = TokenLogprob(tokens[i], chosen[j], tuple(zip(top_ids[j][:n], top_vals[j][:n])))
        return tokens, out
