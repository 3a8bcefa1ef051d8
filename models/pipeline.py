"""What a pipeline stage's model holds in place of the parts other stages run (vLLM's `PPMissingLayer`,
`IntermediateTensors`), and which checkpoint tensors a stage leaves to the others.

A stage (`ParallelGroups.pp`) builds only its decoder layers (`PPGroup.layer_range`); the others are
`PPMissingLayer`s, which hold no weights and must never run. The first stage holds the embeddings and
the vision tower; the last the final norm, the LM head (and, tied, the embedding it reads) and samples.
Between stages travel the hidden states and the residual stream of every token of the step
(`IntermediateTensors`, both `[num_tokens, hidden]`): the layers' outputs before the next layer's
add + norm, so the next stage continues the sum exactly where the previous one stopped.

`StageWeights` is the load filter: a checkpoint tensor of another stage's layers, of the vision tower
on a later stage, of the embedding or LM head where this stage holds neither, is skipped and counted
(logged as skipped, by kind); everything else still goes through the strict loader, so a tensor that
belongs to no stage is still refused.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IntermediateTensors:
    """One step's tensors from one stage to the next: the last layer's output and the residual before it."""
    hidden: torch.Tensor  # [num_tokens, hidden]
    residual: torch.Tensor  # [num_tokens, hidden]


class PPMissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no weights; running it is a bug."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"decoder layer {self.index} belongs to another pipeline stage")


@dataclass
class StageWeights:
    """The checkpoint tensors this stage skips (module docstring). `layer_prefixes`: the checkpoint
    prefixes of decoder layers ("model.layers."); `held`: this stage's [start, stop); `other_prefixes`:
    `other_names`: exact names it does not hold (the vision tower's on a later stage, the embedding,
    the LM head)."""
    layer_prefixes: tuple[str, ...]
    held: tuple[int, int]
    other_names: frozenset[str] = frozenset()
    skipped: dict[str, int] = field(default_factory=dict)  # kind -> tensors skipped

    def __post_init__(self):
        self._layer = re.compile("|".join(re.escape(p) + r"(\d+)\." for p in self.layer_prefixes))

    def kind(self, name: str) -> str | None:
        """Why `name` (canonical) is another stage's, or None when this stage loads it."""
        if name in self.other_names:
            return "vision tower / embedding / LM head tensors of other stages"
        m = self._layer.match(name)
        if m is not None:
            i = int(next(g for g in m.groups() if g is not None))
            return None if self.held[0] <= i < self.held[1] else "decoder layer tensors of other stages"
        return None

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]], canonical) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            why = self.kind(canonical(name))
            if why is None:
                yield name, tensor
            else:
                self.skipped[why] = self.skipped.get(why, 0) + 1

    def log(self, stage: int, stages: int) -> None:
        if self.skipped:
            logger.info("pipeline stage %d of %d (layers %d..%d) skipped the tensors of other stages: %s", stage,
                        stages, self.held[0], self.held[1] - 1,
                        ", ".join(f"{n} {k}" for k, n in sorted(self.skipped.items())))
