"""Tiny Gemma 3 checkpoints with random weights, for tests and benchmarks without a model hub.

`make_tiny_gemma3_checkpoint` writes a directory transformers itself loads: `config.json` and safetensors
saved by `Gemma3ForConditionalGeneration.save_pretrained` (transformers 5.24 writes `language_model.model.*`,
`vision_tower.*`, `multi_modal_projector.*`; `layout="published"` writes the published 4.50 spelling,
`vision_tower.vision_model.*`, and the flat config), the shared test BPE with
Gemma's special tokens and Gemma 3's chat template, `generation_config.json` and
`preprocessor_config.json`. Reached as `vlm_sdk.testing.make_tiny_checkpoint(path, family="gemma3", ...)`.

The tiny shape keeps what distinguishes Gemma 3: two sliding-window layers and a global one (the
published 5:1 pattern, shortened), a window (12) shorter than every test prompt, head_dim (16) unlike
hidden / heads (12), query_pre_attn_scalar (24) unlike head_dim, the global layers' linear RoPE factor (8)
and bases of the published configs, and a SigLIP tower at 112x112 (patch 14: an 8x8 grid pooled 2x2 to 16
tokens a frame: longer than the window, and across a KV block boundary in the shared tests' prompts;
`mm_tokens_per_image=4` pools 4x4).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping


from vlm_sdk.models.common.tiny_checkpoint import (build_tokenizer, checkpoint_options, floating_dtype, save_random_model,
                                                   vocab_size_for, write_json)

# Gemma's special tokens, in Gemma's order where it has one (pad 0, eos 1, bos 2, unk 3); ids 1000+ here
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                  "<end_of_image>", "<image_soft_token>")

# Gemma 3's chat template: the `chat_template` of google/gemma-3-*-it's tokenizer_config.json, as transcribed
# (JSON-escaped) in the Berkeley function-calling leaderboard's Gemma handler (gorilla, bfcl
# model_handler/local_inference/gemma.py), found with the search tool; an image part renders <start_of_image>
CHAT_TEMPLATE = json.loads(
    r'''"{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"''')

_DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    text_hidden_size=48, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
    vocab_size=None,              # None: tokenizer size rounded up to a multiple of 64
    layer_types=None,             # None: every `sliding_window_pattern`-th layer global (transformers' rule)
    sliding_window_pattern=3,
    sliding_window=12,
    query_pre_attn_scalar=24,
    rope_local_base_freq=10_000.0, rope_theta=1_000_000.0, rope_linear_factor=8.0,
    final_logit_softcapping=None,
    max_position_embeddings=4096,
    vision_layers=2, vision_hidden_size=32, vision_heads=2, vision_intermediate_size=64,
    image_size=112, patch_size=14, mm_tokens_per_image=16,
    tie_word_embeddings=True,
    # the other families' 0.2 gives Gemma's sandwich-normed stream near-constant greedy tokens; 0.08 varies them
    # (24 distinct of 24 on the test prompts) with a top-2 logprob gap of at least 0.004
    init_std=0.08,
    layout="transformers5",       # or "published": the 4.50 tensor names and the flat config.json
    max_shard_size=None,
    dtype="float32",
    pan_and_scan=None,            # preprocessor_config.json's pan_and_scan_* (None: null, as published; transformers'
                                  # Gemma3Processor ignores them either way)
))


def make_tiny_gemma3_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """Write a complete HF-format Gemma 3 checkpoint with random weights to `path` and return it. Same
    arguments give byte-identical files; an unknown override raises TypeError (accepted: `_DEFAULTS`)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    o = checkpoint_options(overrides, _DEFAULTS)
    if o["layout"] not in ("transformers5", "published"):
        raise ValueError(f"layout={o['layout']!r}; use 'transformers5' or 'published'")
    dtype = floating_dtype(o["dtype"])
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(SPECIAL_TOKENS)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    vocab_size = vocab_size_for(tokenizer, o["vocab_size"])
    config = Gemma3Config(text_config=_text_config(o, vocab_size, ids), vision_config=_vision_config(o),
                          mm_tokens_per_image=o["mm_tokens_per_image"], boi_token_index=ids["<start_of_image>"],
                          eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"],
                          tie_word_embeddings=bool(o["tie_word_embeddings"]),
                          eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    save_random_model(Gemma3ForConditionalGeneration, config, out, seed=seed, init_std=float(o["init_std"]),
                      dtype=dtype, max_shard_size=o["max_shard_size"], norm_std=0.1)
    if o["layout"] == "published":
        _publish(out)
    _write_tokenizer(out, tokenizer)
    write_json(out / "generation_config.json", {"bos_token_id": ids["<bos>"], "pad_token_id": ids["<pad>"],
                                                "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]]})
    write_json(out / "preprocessor_config.json", _preprocessor_config(o))
    return out


# the benchmark shape (`make_bench_gemma3_checkpoint`): Gemma 3's vocabulary and head sizes, fewer layers
BENCH_SHAPE: Mapping[str, Any] = MappingProxyType(dict(
    text_hidden_size=640, num_layers=6, num_heads=4, num_kv_heads=1, head_dim=256, intermediate_size=2048,
    vocab_size=262_208, sliding_window_pattern=6, sliding_window=512, query_pre_attn_scalar=256,
    max_position_embeddings=32768, vision_layers=4, vision_hidden_size=384, vision_heads=6,
    vision_intermediate_size=1536, image_size=448, patch_size=14, mm_tokens_per_image=256, dtype="bfloat16",
))


def make_bench_gemma3_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """The benchmark shape: Gemma 3's architecture at ~200M parameters (the tied 262,208 x 640 embedding is
    168M of them: as costly a head as gemma-3-270m's), bfloat16; 448x448 images of 256 tokens."""
    return make_tiny_gemma3_checkpoint(path, seed, **{**BENCH_SHAPE, **overrides})


def _text_config(o: Mapping[str, Any], vocab_size: int, ids: dict[str, int]) -> dict:
    if o["num_heads"] % o["num_kv_heads"]:
        raise ValueError(f"num_heads={o['num_heads']} must divide by num_kv_heads={o['num_kv_heads']}")
    full = {"rope_type": "default", "rope_theta": o["rope_theta"]}
    if o["rope_linear_factor"] != 1.0:
        full = {"rope_type": "linear", "factor": o["rope_linear_factor"], "rope_theta": o["rope_theta"]}
    text = dict(vocab_size=vocab_size, hidden_size=o["text_hidden_size"], intermediate_size=o["intermediate_size"],
                num_hidden_layers=o["num_layers"], num_attention_heads=o["num_heads"],
                num_key_value_heads=o["num_kv_heads"], head_dim=o["head_dim"], hidden_activation="gelu_pytorch_tanh",
                max_position_embeddings=o["max_position_embeddings"], rms_norm_eps=1e-6,
                query_pre_attn_scalar=o["query_pre_attn_scalar"], sliding_window=o["sliding_window"],
                final_logit_softcapping=o["final_logit_softcapping"], attn_logit_softcapping=None,
                rope_parameters={"full_attention": full,
                                 "sliding_attention": {"rope_type": "default", "rope_theta": o["rope_local_base_freq"]}},
                pad_token_id=ids["<pad>"], bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                sliding_window_pattern=o["sliding_window_pattern"])
    if o["layer_types"] is not None:
        text["layer_types"] = list(o["layer_types"])
    return text


def _vision_config(o: Mapping[str, Any]) -> dict:
    if o["vision_hidden_size"] % o["vision_heads"]:
        raise ValueError(f"vision_hidden_size={o['vision_hidden_size']} must divide by vision_heads={o['vision_heads']}")
    return dict(model_type="siglip_vision_model", hidden_size=o["vision_hidden_size"],
                intermediate_size=o["vision_intermediate_size"], num_hidden_layers=o["vision_layers"],
                num_attention_heads=o["vision_heads"], image_size=o["image_size"], patch_size=o["patch_size"],
                hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False)


def _publish(out: Path) -> None:
    """transformers 5.24's save -> the published layout: `language_model.model.*`, `vision_tower.vision_model.*`
    (5.24 saves `vision_tower.*`), `multi_modal_projector.*` tensors and a config.json with the flat text config (`rope_theta`,
    `rope_local_base_freq`, `rope_scaling` of the global layers, `sliding_window_pattern`)."""
    from safetensors.torch import load_file, save_file
    renames = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
               ("vision_tower.", "vision_tower.vision_model."), ("model.multi_modal_projector.", "multi_modal_projector."))
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(f)
        renamed = {}
        for name, t in tensors.items():
            for old, new in renames:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            renamed[name] = t
        save_file(renamed, f, metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.is_file():
        raise ValueError("layout='published' with sharded weights is not written (rename the index too)")
    cfg = json.loads((out / "config.json").read_text())
    text = dict(cfg["text_config"])
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope["full_attention"]["rope_theta"]
    text["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    scaling = {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
    text["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    text.pop("layer_types", None)
    cfg["text_config"] = dict(sorted(text.items()))
    cfg["transformers_version"] = "4.50.0.dev0"
    write_json(out / "config.json", dict(sorted(cfg.items())))


def _write_tokenizer(out: Path, tok) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": False, "model_max_length": 32768,
              "tokenizer_class": "PreTrainedTokenizerFast", "padding_side": "left",
              # Gemma3Processor reads these (tokenizer.boi_token, .eoi_token, .image_token)
              "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                       "image_token": "<image_soft_token>"}}
    write_json(out / "tokenizer_config.json", dict(sorted(config.items())))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def _preprocessor_config(o: Mapping[str, Any]) -> dict:
    pas = dict(o["pan_and_scan"] or {})
    return {"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": pas.get("do_pan_and_scan"),
            "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
            "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": o["mm_tokens_per_image"],
            "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": pas.get("pan_and_scan_max_num_crops"),
            "pan_and_scan_min_crop_size": pas.get("pan_and_scan_min_crop_size"),
            "pan_and_scan_min_ratio_to_activate": pas.get("pan_and_scan_min_ratio_to_activate"),
            "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 1 / 255,
            "size": {"height": o["image_size"], "width": o["image_size"]}}
