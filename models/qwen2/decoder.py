"""The Qwen2 decoder on the paged KV cache: embedding, pre-norm attention + SwiGLU layers, final norm.

Shared by Qwen2.5-VL (M-RoPE over three position axes) and any model whose LLM is a Qwen2, a Llama
or an InternLM2 (plain RoPE: `mrope_section=None`). The three differ only in which projections carry
a bias; InternLM2 checkpoints are renamed to the Llama names first (models/internlm2/weights.py).

Fused projections (the checkpoint keeps them apart; `checkpoint_map` says where each lands):

    qkv_proj.weight  rows [0, H*D) = q_proj | [H*D, (H+Hkv)*D) = k_proj | [(H+Hkv)*D, (H+2Hkv)*D) = v_proj
    gate_up_proj     rows [0, I) = gate_proj | [I, 2I) = up_proj
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_sdk.engine.attention_metadata import AttentionMetadata
from vlm_sdk.errors import CheckpointError
from vlm_sdk.kernels.ops import KernelOps, RotaryInputs, TorchOps
from vlm_sdk.model_loader import ParamSlot


# The LLM families this decoder serves; they differ only in which projections carry a bias.
LLM_FAMILIES = ("qwen2", "llama", "internlm2")
# RoPE types computed as plain RoPE. "dynamic" (dynamic NTK, InternLM2 / InternVL2-8B) rescales the
# base only for sequences longer than max_position_embeddings, and the engine caps max_model_len at
# max_position_embeddings, so for every position we run it is exactly default RoPE.
_PLAIN_ROPE_TYPES = ("default", "dynamic")
# Config defaults of each family's transformers / remote-code class, for configs that omit rope_theta.
_DEFAULT_ROPE_THETA = {"qwen2": 1e6, "llama": 1e4, "internlm2": 1e4}


def llm_family(text_config: Any) -> str:
    """Which of `LLM_FAMILIES` a text config is, from `model_type`, else `architectures`
    (a generic config built from a plain dict may lack either)."""
    model_type = getattr(text_config, "model_type", None) or ""
    archs = [str(a) for a in (getattr(text_config, "architectures", None) or [])]
    if model_type == "internlm2" or any(a.startswith("InternLM2") for a in archs):
        return "internlm2"
    if model_type == "llama" or any(a.startswith("Llama") for a in archs):
        return "llama"
    moe = "moe" in model_type.lower() or any("moe" in a.lower() for a in archs)  # Qwen2-MoE: other MLP
    if not moe and (model_type.startswith("qwen2") or any(a.startswith("Qwen2") for a in archs)):
        return "qwen2"
    raise CheckpointError(f"LLM config model_type {model_type!r} (architectures {archs}) is not supported by the "
                          f"Qwen2 decoder (supported: Qwen2, Llama, InternLM2)")


@dataclass(frozen=True)
class Qwen2DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None  # sums to head_dim // 2; None = 1-D RoPE
    tie_word_embeddings: bool
    attention_bias: bool = True  # q/k/v biases: Qwen2 always, Llama `attention_bias`, InternLM2 `bias`
    o_proj_bias: bool = False  # Qwen2 never; Llama `attention_bias` and InternLM2 `bias` cover o_proj too

    @classmethod
    def from_hf(cls, text_config: Any, tie_word_embeddings: bool, mrope: bool,
                family: str | None = None) -> "Qwen2DecoderConfig":
        """From a transformers text config, or a generic `PretrainedConfig` of a remote-code LLM
        (v5 `rope_parameters`, or the flat `rope_scaling`/`rope_theta`). `family` (one of
        `LLM_FAMILIES`) overrides what `llm_family` reads from the config.
        Raises `CheckpointError` for an LLM or RoPE variant this decoder does not implement."""
        family = family or llm_family(text_config)
        if family not in LLM_FAMILIES:
            raise ValueError(f"family {family!r} is not one of {LLM_FAMILIES}")
        hidden = text_config.hidden_size
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or hidden // heads
        act = getattr(text_config, "hidden_act", None) or "silu"
        if act != "silu":
            raise CheckpointError(f"config.json hidden_act {act!r} is not supported by the Qwen2 decoder "
                                  f"(its MLP is SwiGLU: 'silu')")
        rope = dict(getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        supported = _PLAIN_ROPE_TYPES + (("mrope",) if mrope else ())
        if rope_type not in supported:
            raise CheckpointError(f"config.json rope type {rope_type!r} is not supported by the Qwen2 decoder "
                                  f"(supported: {', '.join(repr(t) for t in supported)})")
        theta = rope.get("rope_theta", getattr(text_config, "rope_theta", None) or _DEFAULT_ROPE_THETA[family])
        section = None
        if mrope:
            section = tuple(rope.get("mrope_section") or (16, 24, 24))
            if sum(section) != head_dim // 2:
                raise CheckpointError(f"mrope_section {list(section)} sums to {sum(section)} but head_dim // 2 is "
                                 f"{head_dim // 2}; fix rope_parameters.mrope_section in config.json")
        if family == "qwen2":
            qkv_bias, o_bias = True, False
        elif family == "llama":
            if getattr(text_config, "mlp_bias", False):
                raise CheckpointError("config.json mlp_bias=true (biases on the Llama MLP projections) is not "
                                      "supported by the Qwen2 decoder")
            qkv_bias = o_bias = bool(getattr(text_config, "attention_bias", False))
        else:  # InternLM2's remote-code config defaults `bias` to True (wqkv and wo)
            qkv_bias = o_bias = bool(getattr(text_config, "bias", True))
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        return cls(vocab_size=text_config.vocab_size, hidden_size=hidden,
                   intermediate_size=text_config.intermediate_size, num_layers=text_config.num_hidden_layers,
                   num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   rms_norm_eps=text_config.rms_norm_eps, rope_theta=float(theta), mrope_section=section,
                   tie_word_embeddings=tie_word_embeddings, attention_bias=qkv_bias, o_proj_bias=o_bias)


class RMSNorm(nn.Module):
    """The weight and eps of an RMSNorm; the math is the kernel set's (`KernelOps.rms_norm`)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps


def linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
           device: torch.device | str) -> nn.Linear:
    """An `nn.Linear` with uninitialised storage (weights always come from a checkpoint)."""
    return torch.nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype, device=device)


class MRotaryEmbedding(nn.Module):
    """cos/sin `[num_tokens, 1, head_dim // 2]` for 3-axis positions (HF `Qwen2_5_VLRotaryEmbedding`).

    Frequency i of the half head dim takes its position from axis `axis_of_freq[i]`: the first
    mrope_section[0] frequencies from t, the next mrope_section[1] from h, the rest from w.
    """

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...] | None,
                 device: torch.device | str):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # [D/2]
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        axes = [0] * (head_dim // 2) if mrope_section is None else \
            [i % 3 for i, n in enumerate(mrope_section) for _ in range(n)]
        self.register_buffer("axis_of_freq", torch.tensor(axes, dtype=torch.long, device=device), persistent=False)
        self.mrope = mrope_section is not None
        self.mrope_section = mrope_section

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:  # [N] plain positions
            freqs = positions[:, None].float() * self.inv_freq  # [N, D/2]
        elif self.mrope:  # [3, N]
            pos = positions.gather(0, self.axis_of_freq[:, None].expand(-1, positions.shape[1]))  # [D/2, N]
            freqs = pos.t().float() * self.inv_freq  # [N, D/2]
        else:
            freqs = positions[0][:, None].float() * self.inv_freq
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]  # [N, 1, D/2]


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2DecoderConfig, dtype: torch.dtype, device: torch.device | str, ops: KernelOps):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, device)
        self.qkv_proj = linear(hidden, qkv_out, cfg.attention_bias, dtype, device)
        self.o_proj = linear(cfg.num_heads * cfg.head_dim, hidden, cfg.o_proj_bias, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, device)
        self.gate_up_proj = linear(hidden, 2 * inter, False, dtype, device)
        self.down_proj = linear(inter, hidden, False, dtype, device)

    def forward(self, x: torch.Tensor,  # [N, hidden]: the previous layer's output
                residual: torch.Tensor | None,  # [N, hidden]: the residual stream before it; None for layer 0
                rope: RotaryInputs, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it): the next norm adds them
        (fused with the add), as HF's `x = x + mlp(norm(x))` does in two steps."""
        ops, n = self.ops, x.shape[0]
        h, hkv = self.num_heads, self.num_kv_heads
        norm = self.input_layernorm
        if residual is None:
            residual, normed = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            normed, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        qkv = self.qkv_proj(normed).view(n, h + 2 * hkv, self.head_dim)  # [N, H+2Hkv, D]
        qk = ops.rotary(qkv[:, :h + hkv], h, rope)  # [N, H+Hkv, D]
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + hkv:]  # [N, H, D], [N, Hkv, D], [N, Hkv, D]
        ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale, k, v)  # [N, H, D]
        norm = self.post_attention_layernorm
        normed, residual = ops.add_rms_norm(self.o_proj(attn.reshape(n, h * self.head_dim)), residual,
                                            norm.weight, norm.eps)
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(normed))), residual


class Qwen2Decoder(nn.Module):
    def __init__(self, cfg: Qwen2DecoderConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", ops: KernelOps | None = None):
        super().__init__()
        self.cfg = cfg
        self.ops = ops or TorchOps()
        self.embed_tokens = torch.nn.utils.skip_init(nn.Embedding, cfg.vocab_size, cfg.hidden_size,
                                                     dtype=dtype, device=device)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, dtype, device, self.ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, device)
        self.lm_head = None if cfg.tie_word_embeddings else linear(cfg.hidden_size, cfg.vocab_size, False,
                                                                   dtype, device)
        self.packed_head = None
        self.requires_grad_(False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, hidden]
        return self.embed_tokens(input_ids)

    def forward(self, inputs_embeds: torch.Tensor,  # [N, hidden]
                positions: torch.Tensor,  # [3, N] (M-RoPE) or [N]
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:  # [N, hidden], after the final norm
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} decoder layers")
        rope = self.ops.rotary_inputs(positions, self.rotary, inputs_embeds.dtype)  # shared by every layer
        x, residual = inputs_embeds, None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, k_cache, v_cache, meta)
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def untie_lm_head(self, weight: torch.Tensor) -> None:
        """Give a tied decoder its own LM head (a checkpoint whose lm_head differs from the embedding)."""
        emb = self.embed_tokens.weight
        self.lm_head = linear(self.cfg.hidden_size, self.cfg.vocab_size, False, emb.dtype, emb.device)
        self.lm_head.requires_grad_(False)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] float32
        if self.packed_head is not None:  # set after loading on the CPU (models/cpu_layout.py)
            return self.packed_head(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def checkpoint_map(self, prefix: str = "model.", lm_head: str = "lm_head.weight") -> dict[str, ParamSlot]:
        """Checkpoint name -> where it goes, for the published HF layout (`model.layers.N.self_attn.q_proj...`).
        Our parameter names are relative to this module."""
        cfg = self.cfg
        hid, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
        out: dict[str, ParamSlot] = {
            f"{prefix}embed_tokens.weight": ParamSlot("embed_tokens.weight", (cfg.vocab_size, hid)),
            f"{prefix}norm.weight": ParamSlot("norm.weight", (hid,)),
        }
        if self.lm_head is not None:
            out[lm_head] = ParamSlot("lm_head.weight", (cfg.vocab_size, hid))
        for i in range(cfg.num_layers):
            src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
            shards = [("q_proj", 0, q_rows), ("k_proj", q_rows, kv_rows), ("v_proj", q_rows + kv_rows, kv_rows)]
            for name, start, rows in shards:
                out[f"{src}self_attn.{name}.weight"] = ParamSlot(f"{dst}qkv_proj.weight", (rows, hid), start)
                if cfg.attention_bias:
                    out[f"{src}self_attn.{name}.bias"] = ParamSlot(f"{dst}qkv_proj.bias", (rows,), start)
            out[f"{src}self_attn.o_proj.weight"] = ParamSlot(f"{dst}o_proj.weight", (hid, q_rows))
            if cfg.o_proj_bias:
                out[f"{src}self_attn.o_proj.bias"] = ParamSlot(f"{dst}o_proj.bias", (hid,))
            out[f"{src}mlp.gate_proj.weight"] = ParamSlot(f"{dst}gate_up_proj.weight", (inter, hid), 0)
            out[f"{src}mlp.up_proj.weight"] = ParamSlot(f"{dst}gate_up_proj.weight", (inter, hid), inter)
            out[f"{src}mlp.down_proj.weight"] = ParamSlot(f"{dst}down_proj.weight", (hid, inter))
            out[f"{src}input_layernorm.weight"] = ParamSlot(f"{dst}input_layernorm.weight", (hid,))
            out[f"{src}post_attention_layernorm.weight"] = ParamSlot(f"{dst}post_attention_layernorm.weight", (hid,))
        return out
