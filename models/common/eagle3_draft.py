"""The EAGLE-3 draft head in its published layout (SpecForge's LlamaForCausalLMEagle3; vLLM's
`Eagle3LlamaForCausalLM`, llama_eagle3.py), config in models/common/eagle3_config.py:

    fc.weight                                  [hidden, 3 * target_hidden]  the target's aux states -> hidden
    midlayer.input_layernorm.weight            [hidden]       on the token embedding
    midlayer.hidden_norm.weight                [hidden]       on the hidden states
    midlayer.self_attn.{q,k,v}_proj.weight     [heads * D, 2 * hidden]  (embedding | hidden concatenated)
    midlayer.self_attn.o_proj.weight           [hidden, heads * D]
    midlayer.post_attention_layernorm.weight   [hidden]
    midlayer.mlp.{gate,up}_proj.weight         [inter, hidden];  midlayer.mlp.down_proj.weight [hidden, inter]
    norm.weight                                [hidden]
    lm_head.weight                             [draft_vocab, hidden]
    d2t                                        [draft_vocab] int64: target id = draft id + d2t[draft id]
    t2d                                        [vocab] bool (training only: skipped, as vLLM does)
    embed_tokens.weight                        [vocab, hidden], optional: without it the target's is used

One row of the draft at position t reads (token t + 1, hidden state h_t) and predicts token t + 2: h_t is
`fc(aux_t)` for a position the target computed, or the draft's own pre-norm output of the row before (its
autoregressive steps). Loading is strict (`load_checked`): a missing, unexpected or mis-shaped tensor is a
`CheckpointError` naming it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.layers.ops import KernelOps
from vlm_sdk.layers.rotary import MRotaryEmbedding
from vlm_sdk.model_loader import iter_safetensors
from vlm_sdk.models.common.eagle3_config import Eagle3Config, read_eagle3_config
from vlm_sdk.weight_loading import ParamSlot, load_checked

# (q [N, H, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, H, D]: the caller stores K/V and attends (worker side)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _weight(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config, dtype, device):
        super().__init__()
        d, b = c.head_dim, c.attention_bias
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * d, bias=b, dtype=dtype, device=device)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * d, bias=b, dtype=dtype, device=device)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * d, bias=b, dtype=dtype, device=device)
        self.o_proj = nn.Linear(c.num_heads * d, c.hidden_size, bias=b, dtype=dtype, device=device)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config, dtype, device):
        super().__init__()
        h, i = c.hidden_size, c.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype, device=device)


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config, dtype, device):
        super().__init__()
        h = c.hidden_size
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = _weight(h, dtype=dtype, device=device)
        self.hidden_norm = nn.Module()
        self.hidden_norm.weight = _weight(h, dtype=dtype, device=device)
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = _weight(h, dtype=dtype, device=device)
        self.self_attn = _Attention(c, dtype, device)
        self.mlp = _MLP(c, dtype, device)


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config, target_embedding: Callable[[torch.Tensor], torch.Tensor] | None,
                 ops: KernelOps, dtype: torch.dtype, device: torch.device | str):
        """`target_embedding`: the target's token embedding, used when the checkpoint ships none (None: it
        ships one, built here)."""
        super().__init__()
        c, h = cfg, cfg.hidden_size
        self.cfg, self.ops = cfg, ops
        self.fc = nn.Linear(3 * c.target_hidden_size, h, bias=False, dtype=dtype, device=device)
        self.midlayer = _MidLayer(c, dtype, device)
        self.norm = nn.Module()
        self.norm.weight = _weight(h, dtype=dtype, device=device)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False, dtype=dtype, device=device)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long, device=device))
        self.embed_tokens = nn.Embedding(c.vocab_size, h, dtype=dtype, device=device) \
            if target_embedding is None else None
        self._target_embedding = target_embedding
        self.rotary = MRotaryEmbedding(c.head_dim, c.rope_theta, c.mrope_section, device,
                                       interleaved=c.mrope_interleaved)
        self.position_rows = 3 if c.mrope_section is not None else 1
        self.requires_grad_(False)

    def checkpoint_map(self) -> dict[str, ParamSlot]:
        """Every persistent tensor under its published name (d2t optional when the vocabularies are one)."""
        same_vocab = self.cfg.draft_vocab_size == self.cfg.vocab_size
        return {name: ParamSlot(name, tuple(t.shape), optional=name == "d2t" and same_vocab)
                for name, t in self.state_dict(keep_vars=True).items()}

    def load(self, path: str | Path) -> None:
        load_checked(self, iter_safetensors(path, show_progress=False), self.checkpoint_map(),
                     ignore=frozenset({"t2d"}), source=path)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        return self.embed_tokens(input_ids) if self.embed_tokens is not None else self._target_embedding(input_ids)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:  # [N, 3 * target_hidden] -> [N, hidden]
        return F.linear(aux.to(self.fc.weight.dtype), self.fc.weight)

    def forward(self, input_ids: torch.Tensor,  # [N]: token t + 1 of each row
                hidden: torch.Tensor,  # [N, hidden]: h_t (combined aux states, or the draft's own pre-norm)
                positions: torch.Tensor,  # [3, N] (M-RoPE) or [N]
                attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed [N, hidden] for the head, pre-norm [N, hidden]: the next autoregressive row's h)."""
        ops, c, layer = self.ops, self.cfg, self.midlayer
        n, eps = input_ids.shape[0], c.rms_norm_eps
        embeds = ops.rms_norm(self.embed(input_ids).to(hidden.dtype), layer.input_layernorm.weight, eps)
        if c.norm_before_residual:
            hidden = residual = ops.rms_norm(hidden, layer.hidden_norm.weight, eps)
        else:
            residual, hidden = hidden, ops.rms_norm(hidden, layer.hidden_norm.weight, eps)
        x = torch.cat([embeds, hidden], dim=-1)  # [N, 2 * hidden]
        a = layer.self_attn
        q = a.q_proj(x).view(n, c.num_heads, c.head_dim)  # [N, H, D]
        k = a.k_proj(x).view(n, c.num_kv_heads, c.head_dim)  # [N, Hkv, D]
        v = a.v_proj(x).view(n, c.num_kv_heads, c.head_dim)  # [N, Hkv, D]
        rope = ops.rotary_inputs(positions, self.rotary, x.dtype)
        qk = ops.rotary(torch.cat([q, k], dim=1), c.num_heads, rope).to(x.dtype)  # [N, H + Hkv, D]
        out = attend(qk[:, :c.num_heads], qk[:, c.num_heads:], v)  # [N, H, D]
        o = a.o_proj(out.reshape(n, c.num_heads * c.head_dim))  # [N, hidden]
        normed, residual = ops.add_rms_norm(o, residual, layer.post_attention_layernorm.weight, eps)
        m = layer.mlp
        mlp = m.down_proj(F.silu(m.gate_proj(normed)) * m.up_proj(normed))  # [N, hidden]
        return ops.add_rms_norm(mlp, residual, self.norm.weight, eps)

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N] target ids
        """The head's argmax over the draft vocabulary, mapped to the target's (greedy drafts: the
        verification treats each as a point mass, which keeps the target distribution exact)."""
        best = self.lm_head(normed).argmax(dim=-1)  # [N] draft ids
        return best + self.d2t[best]


def load_eagle3_draft(path: str | Path, target, ops: KernelOps, dtype: torch.dtype,
                      device: torch.device | str) -> Eagle3Draft:
    """The draft of `target` (a `VisionLanguageModel`) from its checkpoint, checked against it and loaded;
    the target keeps the aux hidden states the draft reads from now on."""
    cfg = read_eagle3_config(path, target.vocab_size, target.hidden_size, target.num_layers)
    names = {name for name, _ in iter_safetensors(path, show_progress=False, lazy=True)}
    draft = Eagle3Draft(cfg, None if "embed_tokens.weight" in names else target.embed_tokens, ops, dtype, device)
    draft.load(path)
    target.set_aux_hidden_layers(cfg.aux_layer_ids)
    return draft
