"""An EAGLE-3 draft checkpoint's config.json, read and checked against its target (no torch).

The published layout (SpecForge's `LlamaForCausalLMEagle3`, which vLLM loads as `Eagle3LlamaForCausalLM`,
vllm/model_executor/models/llama_eagle3.py): a Llama config of ONE decoder layer (`num_hidden_layers: 1`,
its weights under `midlayer.`) plus

    draft_vocab_size                   the draft head's vocabulary (default: vocab_size); a draft id d is
                                       target id d + d2t[d] (the `d2t` tensor; `t2d` is not used to serve)
    target_hidden_size                 the target's hidden size (default: hidden_size): `fc` maps the three
                                       auxiliary hidden states [3 * target_hidden_size] to hidden_size
    eagle_aux_hidden_state_layer_ids   the target layers whose INPUT (the residual stream before layer j:
                                       the output of layer j - 1) the draft reads, top level or inside
                                       `eagle_config`; vLLM's default when absent: (2, L // 2, L - 3)
    norm_before_residual               hidden_norm before the residual is taken (default False)
    rope_scaling.mrope_section         M-RoPE over the target's 3-axis positions (the VL drafts:
                                       Qwen2.5-VL [16, 24, 24], Qwen3-VL [24, 20, 20] with mrope_interleaved)

Every refusal is a `CheckpointError` naming the field, both numbers and the draft's directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vlm_sdk.errors import CheckpointError

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None
    mrope_interleaved: bool
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # resolved against the target (vLLM's default when the config says none)
    norm_before_residual: bool
    attention_bias: bool
    source: str

    def page_bytes(self, block_size: int, dtype_bytes: int) -> int:
        """The draft layer's K and V page of one block."""
        return 2 * block_size * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_parameters(self, has_embedding: bool) -> int:
        """fc, the layer, the final norm, the head (and its own embedding when the checkpoint ships one)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        qkv = 2 * h * (self.num_heads + 2 * self.num_kv_heads) * d
        layer = qkv + self.num_heads * d * h + 3 * h * i + 3 * h
        if self.attention_bias:  # q, k, v and o_proj (vLLM's bias_o_proj follows attention_bias)
            layer += (self.num_heads + 2 * self.num_kv_heads) * d + h
        return (3 * self.target_hidden_size * h + layer + h + self.draft_vocab_size * h
                + (self.vocab_size * h if has_embedding else 0))


def draft_memory(path: str | Path, target, dtype_bytes: int, block_size: int) -> tuple[int, int]:
    """(the draft's weight bytes, its K/V page per block) for `target` (a model or its meta twin: vocab_size,
    hidden_size, num_layers): what the engine's worker holds (`vlm-sdk plan` counts the same). Reads the
    draft's config.json and its safetensors' names (whether it ships its own embedding)."""
    from vlm_sdk.model_loader import iter_safetensors
    cfg = read_eagle3_config(path, target.vocab_size, target.hidden_size, target.num_layers)
    names = {name for name, _ in iter_safetensors(path, show_progress=False, lazy=True)}
    weights = cfg.num_parameters("embed_tokens.weight" in names) * dtype_bytes + 8 * cfg.draft_vocab_size  # + d2t
    return weights, cfg.page_bytes(block_size, dtype_bytes)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's `get_eagle3_aux_hidden_state_layers`: early, middle and late."""
    return 2, num_layers // 2, num_layers - 3


def read_eagle3_config(path: str | Path, target_vocab_size: int, target_hidden_size: int,
                       target_num_layers: int) -> Eagle3Config:
    root = Path(path).expanduser()
    file = root / "config.json"
    if not file.is_file():
        raise CheckpointError(f"speculative_config model={str(path)!r}: no config.json in {root} (an EAGLE-3 draft "
                              f"checkpoint is a directory of config.json and safetensors)")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not JSON: {e}") from None
    where = f"in {file}"
    arch = (raw.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"the EAGLE-3 draft {where} has architectures {raw.get('architectures')!r}; "
                              f"speculative_config method='eagle3' loads {list(ARCHITECTURES)}")
    if raw.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"the EAGLE-3 draft {where} has num_hidden_layers={raw['num_hidden_layers']}; the "
                              f"published layout is one layer ('midlayer.*')")
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise CheckpointError(f"the draft {where} sets eagle_config.use_aux_hidden_state=false (an EAGLE-1/2 head): "
                              f"method='eagle3' needs the three auxiliary hidden states")
    hidden = _int(raw, "hidden_size", where)
    heads = _int(raw, "num_attention_heads", where)
    vocab = _int(raw, "vocab_size", where)
    if vocab != target_vocab_size:
        raise CheckpointError(f"the EAGLE-3 draft {where} has vocab_size={vocab} but the target's is "
                              f"{target_vocab_size}: a draft for another model?")
    t_hidden = raw.get("target_hidden_size") or hidden
    if t_hidden != target_hidden_size:
        raise CheckpointError(f"the EAGLE-3 draft {where} reads target hidden states of {t_hidden} "
                              f"(target_hidden_size, else hidden_size) but the target's hidden_size is "
                              f"{target_hidden_size}: a draft for another model?")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(ids) if ids else default_aux_layers(target_num_layers)
    if len(ids) != 3 or any(not isinstance(j, int) or not 0 <= j < target_num_layers for j in ids):
        said = "its eagle_aux_hidden_state_layer_ids" if raw.get("eagle_aux_hidden_state_layer_ids") or \
            eagle.get("eagle_aux_hidden_state_layer_ids") else "vLLM's default (2, L // 2, L - 3)"
        raise CheckpointError(f"the EAGLE-3 draft {where}: {said} = {list(ids)} must be three layer indices in "
                              f"0..{target_num_layers - 1} of the target's {target_num_layers} layers; write "
                              f"eagle_aux_hidden_state_layer_ids into its config.json")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    section = rope.get("mrope_section")
    head_dim = raw.get("head_dim") or hidden // heads
    return Eagle3Config(
        hidden, heads, raw.get("num_key_value_heads") or heads, head_dim, _int(raw, "intermediate_size", where),
        float(raw.get("rms_norm_eps", 1e-6)), float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
        tuple(section) if section else None, bool(rope.get("mrope_interleaved", False)), vocab,
        raw.get("draft_vocab_size") or vocab, t_hidden, ids, bool(raw.get("norm_before_residual", False)),
        bool(raw.get("attention_bias", False)), str(root))


def _int(raw: dict, key: str, where: str) -> int:
    v = raw.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise CheckpointError(f"the EAGLE-3 draft {where} needs a positive integer {key}, got {v!r}")
    return v
