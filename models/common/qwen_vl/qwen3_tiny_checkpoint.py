"""The writer of tiny checkpoints on the Qwen3-VL architecture, with random weights, for tests and benchmarks
without a model hub: `write_qwen3_vl_checkpoint` on a transformers model class of that architecture
(Qwen3-VL's, models/qwen3_vl/tiny_checkpoint.py; Qwen3-VL-MoE's, models/qwen3_vl_moe/tiny_checkpoint.py).

It writes a directory transformers itself loads: `config.json`, safetensors saved by the model class's
`save_pretrained` (the published names: `model.language_model.*`, `model.visual.*`, `lm_head.weight`), the
shared test tokenizer with Qwen's special tokens and a published Qwen3-VL chat template
(qwen3_chat_templates.py: Instruct, or Thinking with `chat_template="thinking"`), `generation_config.json`
and `preprocessor_config.json` (patch 16).

The tiny shape (`DEFAULTS`) keeps what distinguishes Qwen3-VL: head_dim (16) differs from hidden / heads
(12), three decoder layers with two DeepStack levels (so one layer gets none), a DeepStack level that is
not the last vision block, and a learned position grid (8x8) that images both shrink and stretch.
`BENCH_SHAPE` is the benchmark's.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from vlm_sdk.models.common.tiny_checkpoint import (QWEN_SPECIAL_TOKENS, QWEN_TEXT_TOKENS, TEXT_DEFAULTS,
                                                   build_tokenizer, round_up, save_random_model, write_json,
                                                   write_tokenizer)
from vlm_sdk.models.common.qwen_vl.qwen3_chat_templates import CHAT_TEMPLATES

DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    # language model: one layer past the DeepStack levels; 16-wide heads keep a KV block as small as
    # the other families' (the shared capacity tests fit 96 tokens in 100,000 bytes)
    **{**TEXT_DEFAULTS, "text_hidden_size": 48, "num_layers": 3},
    head_dim=16,                  # not hidden / heads (12): Qwen3 sets it on its own (Qwen3-VL-4B: 128, not 80)
    mrope_section=(4, 2, 2),      # interleaved: h at frequencies 1, 4, w at 2, 5, t at the rest (0, 3, 6, 7)
    vision_depth=3,
    vision_hidden_size=32,
    vision_heads=2,
    vision_intermediate_size=64,
    deepstack_visual_indexes=(0, 1),
    num_position_embeddings=64,   # an 8x8 learned grid (published: 48x48)
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    min_pixels=64 * 64,
    max_pixels=32 * 32 * 256,
    init_std=0.2,
    config_layout="nested",
    preprocessor_layout="nested",
    max_shard_size=None,          # e.g. "200KB" forces sharded safetensors + model.safetensors.index.json
    dtype="float32",              # dtype of the saved weights ("bfloat16" for the benchmark checkpoint)
    chat_template="instruct",     # "instruct" or "thinking": which published template (CHAT_TEMPLATES)
))

_FIXED: Mapping[str, Any] = MappingProxyType(dict(
    rope_theta=5_000_000.0,
    rms_norm_eps=1e-6,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
))


def write_qwen3_vl_checkpoint(path, seed: int, defaults: Mapping[str, Any], overrides: Mapping[str, Any],
                              model_cls: type, config_cls: type, text_fields: Mapping[str, Any] = MappingProxyType({})
                              ) -> Path:
    """`make_tiny_qwen3_vl_checkpoint` for a model class of this architecture (Qwen3-VL-MoE's too):
    `defaults` are the accepted options (at least `DEFAULTS`' names), `text_fields` more text-config
    fields (the experts)."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise TypeError(f"make_tiny_checkpoint() got unknown override(s) {', '.join(unknown)}; "
                        f"accepted: {', '.join(sorted(defaults))}")
    opts = {**defaults, **overrides}
    for key, allowed in (("config_layout", ("nested", "flat")), ("preprocessor_layout", ("nested", "flat")),
                         ("chat_template", tuple(CHAT_TEMPLATES))):
        if opts[key] not in allowed:
            raise ValueError(f"{key}={opts[key]!r}; use one of {allowed}")
    dtype = getattr(torch, str(opts["dtype"]), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={opts['dtype']!r} is not a torch floating dtype name")

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(QWEN_SPECIAL_TOKENS, QWEN_TEXT_TOKENS)
    ids = {tok: tokenizer.token_to_id(tok) for tok in QWEN_SPECIAL_TOKENS}
    n_tokens = tokenizer.get_vocab_size()
    vocab_size = opts["vocab_size"] or round_up(n_tokens, 64)
    if vocab_size < n_tokens:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({n_tokens} tokens)")
    config = _config(opts, vocab_size, ids, config_cls, text_fields)
    save_random_model(model_cls, config, out, seed=seed, init_std=float(opts["init_std"]), dtype=dtype,
                      max_shard_size=opts["max_shard_size"], norm_std=0.1)
    if opts["config_layout"] == "flat":
        write_json(out / "config.json", _published_config(json.loads((out / "config.json").read_text())))

    write_tokenizer(out, tokenizer, QWEN_SPECIAL_TOKENS, CHAT_TEMPLATES[opts["chat_template"]])
    write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    })
    write_json(out / "preprocessor_config.json",
               preprocessor_config(opts["min_pixels"], opts["max_pixels"], opts["preprocessor_layout"]))
    return out


# the benchmark shape (`make_bench_qwen3_vl_checkpoint`; Qwen3-VL-MoE's adds its experts)
BENCH_SHAPE: Mapping[str, Any] = MappingProxyType(dict(
    text_hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1408,
    vocab_size=151936, tie_word_embeddings=True, mrope_section=(12, 10, 10),
    max_position_embeddings=32768, min_pixels=64 * 64, max_pixels=32 * 32 * 1280,
    vision_depth=4, vision_hidden_size=256, vision_heads=4, vision_intermediate_size=512,
    deepstack_visual_indexes=(1, 2), num_position_embeddings=2304, dtype="bfloat16",
))


def _config(o: Mapping[str, Any], vocab_size: int, ids: dict[str, int], config_cls: type,
            text_fields: Mapping[str, Any]):
    hidden, heads, kv_heads, head_dim = o["text_hidden_size"], o["num_heads"], o["num_kv_heads"], o["head_dim"]
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must divide by num_kv_heads={kv_heads}")
    section = list(o["mrope_section"])
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section={section} must sum to head_dim/2 = {head_dim // 2}")
    if o["vision_hidden_size"] % o["vision_heads"]:
        raise ValueError(f"vision_hidden_size={o['vision_hidden_size']} must divide by "
                         f"vision_heads={o['vision_heads']}")
    bad = [i for i in o["deepstack_visual_indexes"] if not 0 <= i < o["vision_depth"]]
    if bad or len(o["deepstack_visual_indexes"]) > o["num_layers"]:
        raise ValueError(f"deepstack_visual_indexes {list(o['deepstack_visual_indexes'])}: each must be a vision "
                         f"block (vision_depth={o['vision_depth']}), at most one per decoder layer "
                         f"(num_layers={o['num_layers']})")
    side = round(o["num_position_embeddings"] ** 0.5)
    if side * side != o["num_position_embeddings"]:
        raise ValueError(f"num_position_embeddings={o['num_position_embeddings']} must be a square")

    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=o["intermediate_size"],
        num_hidden_layers=o["num_layers"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, hidden_act="silu", max_position_embeddings=o["max_position_embeddings"],
        rms_norm_eps=_FIXED["rms_norm_eps"], attention_bias=False, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": _FIXED["rope_theta"], "mrope_section": section,
                         "mrope_interleaved": True},
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot, **text_fields,
    )
    vision = dict(
        depth=o["vision_depth"], hidden_size=o["vision_hidden_size"], hidden_act="gelu_pytorch_tanh",
        intermediate_size=o["vision_intermediate_size"], num_heads=o["vision_heads"], in_channels=3,
        patch_size=_FIXED["patch_size"], temporal_patch_size=_FIXED["temporal_patch_size"],
        spatial_merge_size=_FIXED["spatial_merge_size"], out_hidden_size=hidden,
        num_position_embeddings=o["num_position_embeddings"],
        deepstack_visual_indexes=list(o["deepstack_visual_indexes"]),
    )
    return config_cls(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=bool(o["tie_word_embeddings"]),
    )


def _published_config(nested: dict) -> dict:
    """The layout of the published Qwen3-VL config.json (transformers 4.57): the text config keeps its
    own section but spells RoPE as `rope_scaling` + `rope_theta`; the vision config's model_type is
    "qwen3_vl" and it carries no rope settings."""
    text = dict(nested["text_config"])
    rope = dict(text.pop("rope_parameters"))
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope  # rope_type, mrope_section, mrope_interleaved
    text["dtype"] = nested.get("dtype", "float32")
    vision = dict(nested["vision_config"])
    vision.pop("rope_parameters", None)
    vision["model_type"] = "qwen3_vl"
    flat = {**nested, "text_config": dict(sorted(text.items())), "vision_config": dict(sorted(vision.items())),
            "transformers_version": "4.57.0.dev0"}
    flat.pop("dtype", None)
    return dict(sorted(flat.items()))


def preprocessor_config(min_pixels: int, max_pixels: int, layout: str) -> dict:
    """The Qwen3-VL tower's preprocessor_config.json (patch 16, merge 2): `layout` "nested" (size.shortest_edge /
    longest_edge, as published) or "flat" (min_pixels / max_pixels)."""
    common = {
        "image_mean": list(_FIXED["image_mean"]),
        "image_std": list(_FIXED["image_std"]),
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "merge_size": _FIXED["spatial_merge_size"],
        "patch_size": _FIXED["patch_size"],
        "processor_class": "Qwen3VLProcessor",
        "temporal_patch_size": _FIXED["temporal_patch_size"],
    }
    if layout == "flat":
        return {**common, "min_pixels": min_pixels, "max_pixels": max_pixels}
    return {**common, "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels}}
