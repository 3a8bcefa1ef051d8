"""The configuration of the Llama-style decoder (`LlamaDecoderConfig`) from a Qwen2, Qwen3, Llama or
InternLM2 text config: they share one shape (pre-norm attention + SwiGLU layers, RMSNorm, RoPE) and differ
only in which projections carry a bias, in their RoPE defaults and, for Qwen3, a per-head RMSNorm of q
and k (`qk_norm`). Qwen2.5-VL adds M-RoPE (`mrope_section`); Qwen3-VL interleaves its frequencies
(`mrope_interleaved`). Qwen3-MoE (the LLM of Qwen3-VL-MoE) routes its sparse layers' MLP through experts
(`moe`, read from `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`,
`decoder_sparse_step`, `mlp_only_layers`).

Both config.json layouts are read: transformers 5's `rope_parameters` (rope_theta, mrope_section,
mrope_interleaved inside) and the published files' `rope_scaling` + `rope_theta` beside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vlm_sdk.errors import CheckpointError
from vlm_sdk.kernels.rotary_torch import check_mrope_section
from vlm_sdk.layers.moe import MoeConfig
from vlm_sdk.layers.quantization import QuantScheme
from vlm_sdk.layers.quantization.fp8 import FP8BlockScheme


# The LLM families this decoder serves; they differ in which projections carry a bias and Qwen3's q/k norm.
LLM_FAMILIES = ("qwen2", "qwen3", "llama", "internlm2")
# RoPE types computed as plain RoPE. "dynamic" (dynamic NTK, InternLM2 / InternVL2-8B) rescales the
# base only for sequences longer than max_position_embeddings, and the engine caps max_model_len at
# max_position_embeddings, so for every position we run it is exactly default RoPE.
_PLAIN_ROPE_TYPES = ("default", "dynamic")
# Config defaults of each family's transformers / remote-code class, for configs that omit rope_theta.
_DEFAULT_ROPE_THETA = {"qwen2": 1e6, "qwen3": 1e4, "llama": 1e4, "internlm2": 1e4}
_DEFAULT_ROPE_THETA_OF_TYPE = {"qwen3_vl_text": 5e5}  # Qwen3VLTextConfig's, unlike plain Qwen3's
# The M-RoPE split transformers falls back to when rope parameters name none (Qwen2.5-VL's, Qwen3-VL's).
_DEFAULT_MROPE_SECTION = {"qwen2": (16, 24, 24), "qwen3": (24, 20, 20)}


def llm_family(text_config: Any) -> str:
    """Which of `LLM_FAMILIES` a text config is, from `model_type`, else `architectures`
    (a generic config built from a plain dict may lack either)."""
    model_type = getattr(text_config, "model_type", None) or ""
    archs = [str(a) for a in (getattr(text_config, "architectures", None) or [])]
    if model_type == "internlm2" or any(a.startswith("InternLM2") for a in archs):
        return "internlm2"
    if model_type == "llama" or any(a.startswith("Llama") for a in archs):
        return "llama"
    moe = "moe" in model_type.lower() or any("moe" in a.lower() for a in archs)  # Qwen2-MoE: shared experts
    if not moe and (model_type.startswith("qwen2") or any(a.startswith("Qwen2") for a in archs)):
        return "qwen2"
    if model_type.startswith("qwen3") or any(a.startswith("Qwen3") for a in archs):
        return "qwen3"  # Qwen3-MoE: experts without a shared one (`MoeConfig`)
    raise CheckpointError(f"LLM config model_type {model_type!r} (architectures {archs}) is not supported by the "
                          f"Llama-style decoder (supported: Qwen2, Qwen3, Qwen3-MoE, Llama, InternLM2)")


@dataclass(frozen=True)
class LlamaDecoderConfig:
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
    attention_bias: bool = True  # q/k/v biases: Qwen2 always, Qwen3 / Llama `attention_bias`, InternLM2 `bias`
    o_proj_bias: bool = False  # Qwen2 never; Qwen3 / Llama `attention_bias` and InternLM2 `bias` cover o_proj too
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of each q and k head before RoPE
    mrope_interleaved: bool = False  # Qwen3-VL's frequency layout (kernels/rotary_torch.py); M-RoPE only
    moe: MoeConfig | None = None  # Qwen3-MoE: the experts of the sparse layers; None: every MLP dense
    # the checkpoint's quantized Linear format (config.json quantization_config; None: float weights) and
    # the published name prefix of the decoder's modules ("model."), which its modules_to_not_convert name
    quantization: QuantScheme | None = None
    quant_prefix: str = ""

    @classmethod
    def from_hf(cls, text_config: Any, tie_word_embeddings: bool, mrope: bool,
                family: str | None = None, quantization: QuantScheme | None = None,
                quant_prefix: str = "") -> "LlamaDecoderConfig":
        """From a transformers text config, or a generic `PretrainedConfig` of a remote-code LLM
        (v5 `rope_parameters`, or the flat `rope_scaling`/`rope_theta`). `family` (one of
        `LLM_FAMILIES`) overrides what `llm_family` reads from the config; `quantization`: the
        checkpoint's format (`vlm_sdk.layers.quantization.quant_scheme` of the whole config).
        Raises `CheckpointError` for an LLM or RoPE variant this decoder does not implement."""
        family = family or llm_family(text_config)
        if family not in LLM_FAMILIES:
            raise ValueError(f"family {family!r} is not one of {LLM_FAMILIES}")
        hidden = text_config.hidden_size
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or hidden // heads
        act = getattr(text_config, "hidden_act", None) or "silu"
        if act != "silu":
            raise CheckpointError(f"config.json hidden_act {act!r} is not supported by the Llama-style decoder "
                                  f"(its MLP is SwiGLU: 'silu')")
        rope = dict(getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        supported = _PLAIN_ROPE_TYPES + (("mrope",) if mrope else ())
        if rope_type not in supported:
            raise CheckpointError(f"config.json rope type {rope_type!r} is not supported by the Llama-style decoder "
                                  f"(supported: {', '.join(repr(t) for t in supported)})")
        model_type = getattr(text_config, "model_type", None) or ""
        theta = rope.get("rope_theta", getattr(text_config, "rope_theta", None)
                         or _DEFAULT_ROPE_THETA_OF_TYPE.get(model_type, _DEFAULT_ROPE_THETA[family]))
        section, interleaved = _mrope_layout(rope, family, head_dim) if mrope else (None, False)
        if family == "qwen2":
            qkv_bias, o_bias = True, False
        elif family == "llama":
            if getattr(text_config, "mlp_bias", False):
                raise CheckpointError("config.json mlp_bias=true (biases on the Llama MLP projections) is not "
                                      "supported by the Llama-style decoder")
            qkv_bias = o_bias = bool(getattr(text_config, "attention_bias", False))
        elif family == "qwen3":  # one `attention_bias` for q/k/v/o, off in every published Qwen3
            qkv_bias = o_bias = bool(getattr(text_config, "attention_bias", False))
        else:  # InternLM2's remote-code config defaults `bias` to True (wqkv and wo)
            qkv_bias = o_bias = bool(getattr(text_config, "bias", True))
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        moe = moe_config(text_config) if family == "qwen3" else None
        if moe is not None and quantization is not None and not isinstance(quantization, FP8BlockScheme):
            raise CheckpointError(f"config.json quantization_config ({quantization.description}) on a mixture-of-"
                                  f"experts LLM: quantized experts are read in block-wise FP8 only (quant_method "
                                  f"fp8, as the published MoE FP8 checkpoints); use that or the unquantized checkpoint")
        if moe is not None and quantization is not None and moe.intermediate_size % math.lcm(*quantization.block):
            raise CheckpointError(f"config.json moe_intermediate_size ({moe.intermediate_size}) is not a multiple of "
                                  f"the FP8 weight_block_size {list(quantization.block)}: the fused MoE op reads "
                                  f"whole blocks of each expert's gate, up and down")
        return cls(vocab_size=text_config.vocab_size, hidden_size=hidden,
                   intermediate_size=text_config.intermediate_size, num_layers=text_config.num_hidden_layers,
                   num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   rms_norm_eps=text_config.rms_norm_eps, rope_theta=float(theta), mrope_section=section,
                   tie_word_embeddings=tie_word_embeddings, attention_bias=qkv_bias, o_proj_bias=o_bias,
                   qk_norm=family == "qwen3", mrope_interleaved=interleaved, quantization=quantization,
                   quant_prefix=quant_prefix, moe=moe)


def moe_config(text_config: Any) -> MoeConfig | None:
    """The experts of a Qwen3-MoE text config (transformers 5 spells `num_experts` `num_local_experts` in
    the file; both are read), or None for a dense one. `norm_topk_prob` absent means renormalised: what
    every published Qwen3-VL-MoE sets and what transformers' Qwen3-VL-MoE router always does."""
    experts = getattr(text_config, "num_experts", None) or getattr(text_config, "num_local_experts", None) or 0
    if not experts:
        return None
    fields = {"num_experts_per_tok": getattr(text_config, "num_experts_per_tok", None),
              "moe_intermediate_size": getattr(text_config, "moe_intermediate_size", None)}
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise CheckpointError(f"config.json text_config has num_experts={experts} but no {', '.join(missing)}: "
                              f"the experts' shape is unknown")
    try:
        return MoeConfig(num_experts=int(experts), top_k=int(fields["num_experts_per_tok"]),
                         intermediate_size=int(fields["moe_intermediate_size"]),
                         norm_topk_prob=bool(getattr(text_config, "norm_topk_prob", True)),
                         decoder_sparse_step=int(_or(getattr(text_config, "decoder_sparse_step", None), 1)),
                         mlp_only_layers=tuple(int(i) for i in _or(getattr(text_config, "mlp_only_layers", None), ())))
    except ValueError as e:
        raise CheckpointError(f"config.json text_config: {e}") from None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _mrope_layout(rope: dict, family: str, head_dim: int) -> tuple[tuple[int, ...], bool]:
    """(mrope_section, mrope_interleaved) from the rope parameters. transformers' Qwen3-VL interleaves
    whatever the config says, so a Qwen3 config that omits `mrope_interleaved` is interleaved; one that
    sets it is taken at its word, as vLLM does."""
    section = tuple(int(s) for s in rope.get("mrope_section") or _DEFAULT_MROPE_SECTION.get(family, (16, 24, 24)))
    interleaved = bool(rope.get("mrope_interleaved", family == "qwen3"))
    if sum(section) != head_dim // 2:
        raise CheckpointError(f"mrope_section {list(section)} sums to {sum(section)} but head_dim // 2 is "
                              f"{head_dim // 2}; fix rope_parameters.mrope_section in config.json")
    try:
        check_mrope_section(section, interleaved, head_dim // 2)
    except ValueError as e:
        raise CheckpointError(f"{e}; fix rope_parameters.mrope_section in config.json") from None
    return section, interleaved
