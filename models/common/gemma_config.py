"""The configuration of the Gemma decoder (`GemmaDecoderConfig`) from a Gemma 3 text config: the layer
pattern (sliding-window and global layers), the two RoPE bases, the attention scale and the norms that
set it apart from the Llama-style decoder (models/common/llama_config.py).

Both config.json layouts are read, through transformers' own `Gemma3TextConfig` (which the loader
builds for model_type "gemma3_text") or from the fields themselves:
- transformers 5: `layer_types` and `rope_parameters` = {"sliding_attention": {rope_theta ...},
  "full_attention": {rope_type, factor, rope_theta}};
- the published files (transformers 4.50): `sliding_window_pattern` (6: every 6th layer global), the
  global base in `rope_theta` (default 1e6), the local one in `rope_local_base_freq` (default 1e4), and
  `rope_scaling` (linear, factor 8 in the 4B / 12B / 27B configs) for the global layers only.
Absent fields take `Gemma3TextConfig`'s defaults (the published configs name few keys).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.quantization import QuantScheme

SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma3TextConfig's defaults (transformers 5.24, configuration_gemma3.py), for fields a config omits
_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
             "query_pre_attn_scalar": 256, "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh",
             "max_position_embeddings": 131_072}
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
_ROPE_TYPES = ("default", "linear")  # linear: positions / factor, i.e. inv_freq / factor


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    linear_factor: float = 1.0  # "linear" scaling: inv_freq / factor (1.0: plain RoPE)


@dataclass(frozen=True)
class GemmaDecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    query_pre_attn_scalar: float  # the attention scale is its -1/2 power, not head_dim's
    layer_types: tuple[str, ...]  # SLIDING or FULL per layer
    sliding_window: int | None  # keys p - W < k <= p for a query at p in a SLIDING layer (HF's convention)
    rope: dict[str, RopeConfig]  # per layer type
    tie_word_embeddings: bool
    final_logit_softcapping: float | None = None  # cap * tanh(logits / cap), where the config sets it
    attention_bias: bool = False
    quantization: QuantScheme | None = None
    quant_prefix: str = ""  # the published name prefix of the decoder's modules (modules_to_not_convert)
    moe: None = None  # no experts (the memory package reads a decoder config's `moe`, as LlamaDecoderConfig's)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    @classmethod
    def from_hf(cls, text_config: Any, tie_word_embeddings: bool, quantization: QuantScheme | None = None,
                quant_prefix: str = "") -> "GemmaDecoderConfig":
        """From a `Gemma3TextConfig` (or a generic config / dict with its fields). Raises `CheckpointError`
        for what this decoder does not implement, naming the field."""
        def get(name: str, default: Any = None) -> Any:
            value = text_config.get(name) if isinstance(text_config, dict) else getattr(text_config, name, None)
            if value is None:
                return _DEFAULTS.get(name, default)
            return value

        act = get("hidden_activation") or get("hidden_act")
        if act != "gelu_pytorch_tanh":
            raise CheckpointError(f"config.json text_config.hidden_activation {act!r} is not supported by the Gemma "
                                  f"decoder (its MLP is GeGLU with the tanh GELU: 'gelu_pytorch_tanh')")
        if get("attn_logit_softcapping") is not None:
            raise CheckpointError(f"config.json text_config.attn_logit_softcapping {get('attn_logit_softcapping')} "
                                  f"is not supported: this decoder caps no attention logit (transformers' attention of this "
                                  f"generation ignores the field and no published checkpoint of it sets it); set it to null")
        if get("use_bidirectional_attention"):
            raise CheckpointError("config.json text_config.use_bidirectional_attention=true (an encoder such as "
                                  "EmbeddingGemma) is not served: this decoder is causal")
        layers = int(get("num_hidden_layers"))
        types = tuple(get("layer_types") or _pattern(int(get("sliding_window_pattern", None)
                                                             or get("_sliding_window_pattern", None) or 6), layers))
        if len(types) != layers or set(types) - {SLIDING, FULL}:
            raise CheckpointError(f"config.json text_config.layer_types must name {layers} layers, each "
                                  f"{SLIDING!r} or {FULL!r}; got {list(types)}")
        window = get("sliding_window") if SLIDING in types else None
        if window is not None and int(window) < 1:
            raise CheckpointError(f"config.json text_config.sliding_window {window} must be a positive token count")
        heads = int(get("num_attention_heads"))
        return cls(vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
                   intermediate_size=int(get("intermediate_size")), num_layers=layers, num_heads=heads,
                   num_kv_heads=int(get("num_key_value_heads") or heads), head_dim=int(get("head_dim")),
                   rms_norm_eps=float(get("rms_norm_eps")), query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
                   layer_types=types, sliding_window=None if window is None else int(window),
                   rope=_rope(text_config, get), tie_word_embeddings=bool(tie_word_embeddings),
                   final_logit_softcapping=_float_or_none(get("final_logit_softcapping")),
                   attention_bias=bool(get("attention_bias", False)), quantization=quantization,
                   quant_prefix=quant_prefix)


def _pattern(every: int, layers: int) -> list[str]:
    """transformers' rule for configs without layer_types: layer i is global when (i + 1) % every == 0."""
    return [SLIDING if (i + 1) % every else FULL for i in range(layers)]


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _rope(text_config: Any, get) -> dict[str, RopeConfig]:
    """The RoPE of each layer type, from `rope_parameters` per type (transformers 5) or the flat fields."""
    params = get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        per_type = {t: dict(params.get(t) or {}) for t in (FULL, SLIDING)}
    else:  # the published layout: rope_scaling applies to the global layers only
        per_type = {FULL: dict(get("rope_scaling") or {}), SLIDING: {}}
        per_type[FULL].setdefault("rope_theta", get("rope_theta"))
        per_type[SLIDING]["rope_theta"] = get("rope_local_base_freq")
    out = {}
    for layer_type, p in per_type.items():
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in _ROPE_TYPES:
            raise CheckpointError(f"config.json rope type {kind!r} of the {layer_type} layers is not supported by the "
                                  f"Gemma decoder (supported: {', '.join(map(repr, _ROPE_TYPES))})")
        theta = p.get("rope_theta")
        factor = float(p.get("factor", 1.0)) if kind == "linear" else 1.0
        if factor <= 0:
            raise CheckpointError(f"config.json linear rope factor {factor} of the {layer_type} layers must be > 0")
        out[layer_type] = RopeConfig(float(theta if theta is not None else _DEFAULT_THETA[layer_type]), factor)
    return out
