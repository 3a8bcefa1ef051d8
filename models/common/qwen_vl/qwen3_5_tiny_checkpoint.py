"""The writer of tiny checkpoints on the Qwen3.5 architecture, with random weights, for tests and benchmarks
without a model hub: `write_qwen3_5_checkpoint` on transformers' own model class (Qwen3.5's,
models/qwen3_5/tiny_checkpoint.py; Qwen3.5-MoE's, models/qwen3_5_moe/tiny_checkpoint.py).

It writes what transformers itself loads: `config.json` and safetensors from the class's `save_pretrained`
(the published names), the shared test tokenizer with Qwen's special tokens and Qwen3.5's chat template
(qwen3_5_chat_template.py), `generation_config.json` and the Qwen3-VL tower's `preprocessor_config.json`,
plus the multi-token-prediction head's tensors under the published `mtp.*` names (random; transformers
ignores them on load, as our loader skips them), so every test loads a checkpoint with them.

The tiny shape (`DEFAULTS`): four layers, three Gated DeltaNet and one gated full attention as the
published `[3 x linear + 1 x full]` block (transformers' default layer_types), head_dim 32 with
partial_rotary_factor 0.25 (8 rotated dims: interleaved M-RoPE over 4 frequencies, section (2, 1, 1)),
2 KV heads (so the only attention layer's KV block stays as small as the other families': 96 tokens
in 100,000 bytes), linear heads 2 key / 4 value (each key head serves two value heads) of 8 (a request's
state: 5,376 bytes, so a few slots fit beside that cache too). The
Gated DeltaNet decays are drawn slow (A_log = log U(0.02, 0.3), dt_bias ~ N(-1, 0.5)): the redraw's
1 + N(0, 0.1) would forget nearly everything after one token, and the state would then hide nothing.

`config_layout`: "nested" is what transformers 5 writes; "published" the file the Qwen3.5 repositories
ship (transformers 4.57.1 wrote it: the same nested text_config with `rope_parameters`, plus fields
transformers 5 derives or ignores: layer_types' source full_attention_interval, attn_output_gate,
mtp_num_hidden_layers, mamba_ssm_dtype, partial_rotary_factor beside rope_parameters; the vision
config's model_type "qwen3_5" and an empty deepstack_visual_indexes).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from vlm_sdk.models.common.qwen_vl.qwen3_5_chat_template import QWEN3_5_CHAT_TEMPLATE
from vlm_sdk.models.common.qwen_vl.qwen3_tiny_checkpoint import preprocessor_config
from vlm_sdk.models.common.tiny_checkpoint import (QWEN_SPECIAL_TOKENS, QWEN_TEXT_TOKENS, TEXT_DEFAULTS,
                                                   build_tokenizer, round_up, save_random_model, write_json,
                                                   write_tokenizer)

DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    **{**TEXT_DEFAULTS, "text_hidden_size": 48, "num_layers": 4},
    head_dim=32,
    partial_rotary_factor=0.25,
    mrope_section=(2, 1, 1),       # interleaved over the 4 rotated frequencies: t, h, w, t
    layer_types=None,              # None: transformers' default, every 4th layer full attention
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    vision_depth=3,
    vision_hidden_size=32,
    vision_heads=2,
    vision_intermediate_size=64,
    num_position_embeddings=64,    # an 8x8 learned grid (published: 48x48)
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    min_pixels=64 * 64,
    max_pixels=32 * 32 * 256,
    init_std=0.2,
    config_layout="nested",
    preprocessor_layout="nested",
    max_shard_size=None,
    dtype="float32",
    mtp=True,                      # write the mtp.* head's tensors too (as the published checkpoints carry)
))

# the benchmark shape (`make_bench_*`: Qwen3-VL's benchmark size, the Qwen3.5 layer mix)
BENCH_SHAPE: Mapping[str, Any] = MappingProxyType(dict(
    text_hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=128, intermediate_size=1408,
    mrope_section=(6, 5, 5), linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
    linear_value_head_dim=64, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
    min_pixels=64 * 64, max_pixels=32 * 32 * 1280, vision_depth=4, vision_hidden_size=256, vision_heads=4,
    vision_intermediate_size=512, num_position_embeddings=2304, dtype="bfloat16",
))

_ROPE_THETA, _EPS = 10_000_000.0, 1e-6


def write_qwen3_5_checkpoint(path, seed: int, defaults: Mapping[str, Any], overrides: Mapping[str, Any],
                             model_cls: type, config_cls: type, text_fields: Mapping[str, Any] = MappingProxyType({})
                             ) -> Path:
    """A tiny checkpoint of `model_cls` (`defaults`: the accepted options; `text_fields`: more text-config
    fields, the experts)."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise TypeError(f"make_tiny_checkpoint() got unknown override(s) {', '.join(unknown)}; "
                        f"accepted: {', '.join(sorted(defaults))}")
    opts = {**defaults, **overrides}
    for key, allowed in (("config_layout", ("nested", "published")), ("preprocessor_layout", ("nested", "flat"))):
        if opts[key] not in allowed:
            raise ValueError(f"{key}={opts[key]!r}; use one of {allowed}")
    dtype = getattr(torch, str(opts["dtype"]), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={opts['dtype']!r} is not a torch floating dtype name")

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(QWEN_SPECIAL_TOKENS, QWEN_TEXT_TOKENS)
    ids = {tok: tokenizer.token_to_id(tok) for tok in QWEN_SPECIAL_TOKENS}
    vocab_size = opts["vocab_size"] or round_up(tokenizer.get_vocab_size(), 64)
    if vocab_size < tokenizer.get_vocab_size():
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({tokenizer.get_vocab_size()} tokens)")
    config = _config(opts, vocab_size, ids, config_cls, text_fields)
    mtp: dict[str, torch.Tensor] = {}
    save_random_model(model_cls, config, out, seed=seed, init_std=float(opts["init_std"]), dtype=dtype,
                      max_shard_size=opts["max_shard_size"], norm_std=0.1,
                      adjust=lambda model, gen: _adjust(model, gen, mtp if opts["mtp"] else None))
    if mtp:
        _add_tensors(out, {k: v.to(dtype) for k, v in mtp.items()})
    if opts["config_layout"] == "published":
        write_json(out / "config.json", _published_config(json.loads((out / "config.json").read_text())))
    write_tokenizer(out, tokenizer, QWEN_SPECIAL_TOKENS, QWEN3_5_CHAT_TEMPLATE)
    write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    })
    write_json(out / "preprocessor_config.json",
               preprocessor_config(opts["min_pixels"], opts["max_pixels"], opts["preprocessor_layout"]))
    return out


def _config(o: Mapping[str, Any], vocab_size: int, ids: dict[str, int], config_cls: type,
            text_fields: Mapping[str, Any]):
    hidden, heads, kv_heads, head_dim = o["text_hidden_size"], o["num_heads"], o["num_kv_heads"], o["head_dim"]
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must divide by num_kv_heads={kv_heads}")
    rotary = int(head_dim * o["partial_rotary_factor"])
    if sum(o["mrope_section"]) != rotary // 2:
        raise ValueError(f"mrope_section={list(o['mrope_section'])} must sum to the rotated dims / 2 = {rotary // 2}")
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=o["num_layers"], num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, hidden_act="silu",
        max_position_embeddings=o["max_position_embeddings"], rms_norm_eps=_EPS, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": _ROPE_THETA, "partial_rotary_factor":
                         o["partial_rotary_factor"], "mrope_section": list(o["mrope_section"]),
                         "mrope_interleaved": True},
        linear_conv_kernel_dim=o["linear_conv_kernel_dim"], linear_key_head_dim=o["linear_key_head_dim"],
        linear_value_head_dim=o["linear_value_head_dim"], linear_num_key_heads=o["linear_num_key_heads"],
        linear_num_value_heads=o["linear_num_value_heads"],
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot, **text_fields)
    if not text_fields:  # the dense MLP (the MoE text config has none)
        text["intermediate_size"] = o["intermediate_size"]
    if o["layer_types"] is not None:
        text["layer_types"] = list(o["layer_types"])
    vision = dict(
        depth=o["vision_depth"], hidden_size=o["vision_hidden_size"], hidden_act="gelu_pytorch_tanh",
        intermediate_size=o["vision_intermediate_size"], num_heads=o["vision_heads"], in_channels=3,
        patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=hidden,
        num_position_embeddings=o["num_position_embeddings"])
    return config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                      video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                      vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=bool(o["tie_word_embeddings"]))


def _adjust(model, gen: torch.Generator, mtp: dict | None) -> None:
    """Slow Gated DeltaNet decays (module docstring); `mtp`: filled with the head's tensors (published
    names), drawn like the decoder's own (its layer: a copy of the first full-attention layer's shapes)."""
    text = model.model.language_model
    for layer in text.layers:
        attn = getattr(layer, "linear_attn", None)
        if attn is not None:
            n = attn.A_log.shape[0]
            attn.A_log.copy_(torch.empty(n).uniform_(0.02, 0.3, generator=gen).log())
            attn.dt_bias.copy_(torch.randn(n, generator=gen) * 0.5 - 1.0)
    if mtp is None:
        return
    hidden = text.config.hidden_size
    full = next(i for i, kind in enumerate(text.config.layer_types) if kind == "full_attention")
    drawn = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.2}
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        drawn[f"{name}.weight"] = torch.randn(hidden, generator=gen) * 0.1
    for name, p in text.layers[full].state_dict().items():
        drawn[f"layers.0.{name}"] = torch.randn(p.shape, generator=gen) * (0.2 if p.ndim >= 2 else 0.1)
    mtp.update({f"mtp.{k}": v for k, v in drawn.items()})


def _add_tensors(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` in a file of their own, named in the index (written when the checkpoint had none)."""
    from safetensors.torch import save_file

    index_path = out / "model.safetensors.index.json"
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if not index_path.exists():
        from safetensors import safe_open
        weight_map = {}
        for name in files:
            with safe_open(str(out / name), "pt") as f:
                weight_map.update({k: name for k in f.keys()})
        index = {"metadata": {}, "weight_map": weight_map}
    else:
        index = json.loads(index_path.read_text())
    save_file(tensors, out / "model-mtp.safetensors", metadata={"format": "pt"})
    index["weight_map"] = dict(sorted({**index["weight_map"], **{k: "model-mtp.safetensors" for k in tensors}}.items()))
    write_json(index_path, index)


def _published_config(nested: dict) -> dict:
    """The published config.json's layout (module docstring)."""
    text = dict(nested["text_config"])
    text.update(attn_output_gate=True, full_attention_interval=4, mamba_ssm_dtype="float32",
                mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False, output_gate_type="swish",
                partial_rotary_factor=text["rope_parameters"]["partial_rotary_factor"])
    vision = {**nested["vision_config"], "model_type": "qwen3_5", "deepstack_visual_indexes": []}
    vision.pop("rope_parameters", None)
    flat = {**nested, "text_config": dict(sorted(text.items())), "vision_config": dict(sorted(vision.items())),
            "language_model_only": False, "transformers_version": "4.57.1"}
    return dict(sorted(flat.items()))
