"""What the decoders of models/common share at their two ends: the embedding / final norm / LM head
slots, an attention layer's fused q | k | v and o_proj slots, untying a tied head, and the logits.

`DecoderHead` is mixed into a decoder (`LlamaDecoder`, `GemmaDecoder`) that sets `cfg` (with
`vocab_size`, `hidden_size`), `tp`, `embed_tokens` (a `VocabParallelEmbedding`), `norm`, `lm_head`
(None when tied) and `packed_head` (the CPU's packed product, models/cpu_layout.py, or None); a decoder
whose logits are soft-capped sets `logit_softcap` (Gemma's final_logit_softcapping)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.layers.embedding import ParallelLMHead, gather_vocab
from vlm_sdk.weight_loading import ParamSlot, SplitSlot


class DecoderHead:
    logit_softcap: float | None = None  # cap * tanh(logits / cap) when set

    def untie_lm_head(self, rows: torch.Tensor) -> None:
        """Give a tied decoder its own LM head (a checkpoint whose lm_head differs from the embedding);
        `rows` are this rank's rows `[stop - start, hidden]` of the checkpoint's `[vocab, hidden]` head."""
        emb = self.embed_tokens
        self.lm_head = ParallelLMHead(self.cfg.vocab_size, self.cfg.hidden_size, emb.weight.dtype,
                                      emb.weight.device, self.tp)
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
        logits = gather_vocab(local, self.tp, self.cfg.vocab_size)  # [S, vocab]
        cap = self.logit_softcap
        if cap is not None:  # in float32, as transformers caps the float logits
            logits = torch.tanh(logits.float() / cap) * cap
        return logits.float() if out is None else out.copy_(logits)

    def head_slots(self, prefix: str, lm_head: str) -> dict[str, ParamSlot]:
        """The embedding, final norm and (untied) LM head slots: `{prefix}embed_tokens.weight`,
        `{prefix}norm.weight`, `lm_head`."""
        out = {} if self.embed_tokens is None else \
            self.embed_tokens.slots("embed_tokens.weight", f"{prefix}embed_tokens.weight")
        out[f"{prefix}norm.weight"] = ParamSlot("norm.weight", (self.cfg.hidden_size,))
        if self.lm_head is not None:
            out.update(self.lm_head.slots("lm_head.weight", lm_head))
        return out


def attention_slots(layer: nn.Module, src: str, dst: str, qkv_bias: bool,
                    o_bias: bool) -> dict[str, ParamSlot | SplitSlot]:
    """One layer's `{src}self_attn.{q,k,v}_proj` into its fused `{dst}qkv_proj` (q | k | v rows, this
    rank's) and `{src}self_attn.o_proj` into `{dst}o_proj`, with their biases where the config has them."""
    attn = [f"{src}self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj")]
    out: dict[str, ParamSlot | SplitSlot] = {}
    out.update(layer.qkv_proj.slots(f"{dst}qkv_proj.", [f"{a}.weight" for a in attn],
                                    [f"{a}.bias" for a in attn] if qkv_bias else None))
    out.update(layer.o_proj.slots(f"{dst}o_proj.", f"{src}self_attn.o_proj.weight",
                                  f"{src}self_attn.o_proj.bias" if o_bias else None))
    return out
