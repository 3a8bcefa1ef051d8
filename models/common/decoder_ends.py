"""The two ends every decoder here shares: the vocab-parallel token embedding and the LM head, either its
own matrix or tied to the embedding (`DecoderEnds`, which the Llama-style decoder and the models/common
decoders with other layer kinds subclass). A tied decoder may be untied once loaded (`untie_lm_head`:
models/common/lm_loading.py does it when a checkpoint ships a head that differs from its embedding); on
the CPU the head may be pre-packed (`packed_head`, set after loading by models/cpu_layout.py).

Tensor parallelism: both are split over the vocabulary (vlm_sdk/layers/embedding.py); `compute_logits`
gathers the whole vocab on every rank (one all-gather, in the model's dtype).
"""
from __future__ import annotations

import torch
from torch import nn

from vlm_sdk.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from vlm_sdk.layers.parallel_state import PPGroup, TPGroup
from vlm_sdk.models.common.lm_head import DecoderHead


class DecoderEnds(DecoderHead, nn.Module):
    """A subclass sets `cfg` (with `vocab_size`, `hidden_size`) and calls `_init_ends` in its constructor;
    untying, the logits and the head's slots are `DecoderHead`'s (models/common/lm_head.py)."""

    def _init_ends(self, vocab_size: int, hidden_size: int, tie_word_embeddings: bool, dtype: torch.dtype,
                   device: torch.device | str, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        """Under pipeline parallelism the embedding lives on the first stage (and on the last when the head
        is tied to it), the LM head on the last: elsewhere they are None."""
        self.vocab_size, self.tp, self.pp = vocab_size, tp, pp
        holds_embedding = pp.is_first or (pp.is_last and tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size, dtype, device, tp) \
            if holds_embedding else None
        self.lm_head = None if tie_word_embeddings or not pp.is_last else \
            ParallelLMHead(vocab_size, hidden_size, dtype, device, tp)
        self.packed_head = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        return self.embed_tokens(input_ids)
