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
import torch.nn.functional as F
from torch import nn

from vlm_sdk.layers.embedding import ParallelLMHead, VocabParallelEmbedding, gather_vocab
from vlm_sdk.layers.parallel_state import TPGroup


class DecoderEnds(nn.Module):
    """A subclass calls `_init_ends` in its constructor."""

    def _init_ends(self, vocab_size: int, hidden_size: int, tie_word_embeddings: bool, dtype: torch.dtype,
                   device: torch.device | str, tp: TPGroup) -> None:
        self.vocab_size, self.tp = vocab_size, tp
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size, dtype, device, tp)
        self.lm_head = None if tie_word_embeddings else ParallelLMHead(vocab_size, hidden_size, dtype, device, tp)
        self.packed_head = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        return self.embed_tokens(input_ids)

    def untie_lm_head(self, rows: torch.Tensor) -> None:
        """Give a tied decoder its own LM head (a checkpoint whose lm_head differs from the embedding);
        `rows` are this rank's rows `[stop - start, hidden]` of the checkpoint's `[vocab, hidden]` head."""
        emb = self.embed_tokens
        self.lm_head = ParallelLMHead(self.vocab_size, emb.hidden_size, emb.weight.dtype, emb.weight.device, self.tp)
        self.lm_head.requires_grad_(False)
        with torch.no_grad():
            self.lm_head.weight.copy_(rows)

    def compute_logits(self, hidden: torch.Tensor,  # [S, hidden]
                       out: torch.Tensor | None = None) -> torch.Tensor:  # [S, vocab] float32 (into `out`)
        if self.packed_head is not None:  # set after loading on the CPU (models/cpu_layout.py)
            local = self.packed_head(hidden)  # [S, vocab / tp]
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [vocab / tp, hidden]
            local = F.linear(hidden, weight)  # [S, vocab / tp]
        # gathered in the model's dtype (half the bytes of float32 in bf16; the cast is exact either way)
        logits = gather_vocab(local, self.tp, self.vocab_size)  # [S, vocab]
        return logits.float() if out is None else out.copy_(logits)
