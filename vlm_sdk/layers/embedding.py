"""The token embedding and LM head split over the vocabulary (vLLM's VocabParallelEmbedding).

Rank r holds rows [start, stop) = `TPGroup.range(vocab)` (ceil(vocab / tp) rows, fewer on the last
rank: the vocab need not divide):

    embedding:  ids outside [start, stop) give zero rows; the ranks' outputs are all-reduced (summed),
                so every rank gets the whole lookup
    LM head:    logits of this rank's vocab slice `[S, stop - start]`; `gather_vocab` pads it to
                ceil(vocab / tp) columns (all_gather needs equal shapes), gathers the ranks' slices in
                rank order and trims the padding: `[S, vocab]` on every rank

With one rank both are the plain `nn.Embedding` lookup / `F.linear` product. With a `TPGroup` that has no
process group (tests composing ranks by hand) the collectives are identities: each rank returns its
partial lookup and its own vocab slice.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.weight_loading import ParamSlot, Shard


def gather_vocab(logits: torch.Tensor, tp: TPGroup, vocab_size: int) -> torch.Tensor:
    """This rank's vocab slice of the logits `[S, stop - start]` -> the whole vocab `[S, vocab]` on every
    rank (unchanged without communication)."""
    if not tp.communicates:
        return logits
    per = -(-vocab_size // tp.size)  # ceil: rank 0's slice, the widest
    if logits.shape[-1] != per:  # the last rank's slice is narrower (or empty): pad to equal shapes
        logits = F.pad(logits, (0, per - logits.shape[-1]))  # [S, per]
    return tp.all_gather(logits, dim=-1)[..., :vocab_size]  # [S, tp * per] -> [S, vocab]


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup()):
        self.vocab_start, self.vocab_stop = tp.range(vocab_size)
        rows = self.vocab_stop - self.vocab_start
        # the weight is loaded from the checkpoint: allocated, never initialised (a meta-device init would
        # run torch's reference normal_, which imports torch._dynamo and triton: seconds at start-up)
        super().__init__(rows, hidden_size, _weight=torch.empty(rows, hidden_size, device=device, dtype=dtype))
        self.vocab_size, self.hidden_size, self.tp = vocab_size, hidden_size, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden], summed over the ranks
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_stop)  # [N]
        local = torch.where(inside, input_ids - self.vocab_start, 0)
        return self.tp.all_reduce(F.embedding(local, self.weight) * inside[:, None].to(self.weight.dtype))

    def slots(self, param: str, name: str) -> dict[str, ParamSlot]:
        """Checkpoint name `[vocab, hidden]` -> this rank's rows, into parameter `param`."""
        shard = None if self.tp.size == 1 else Shard(0, self.vocab_start, self.vocab_stop - self.vocab_start)
        return {name: ParamSlot(param, (self.vocab_size, self.hidden_size), shard=shard)}


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the weight of a vocab-parallel embedding, used as a product."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab], gathered
        return gather_vocab(F.linear(hidden, self.weight), self.tp, self.vocab_size)
