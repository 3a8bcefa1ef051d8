"""Tiny Qwen2.5-VL checkpoints with random weights, for tests and benchmarks without a model hub.

`make_tiny_qwen_checkpoint` writes a directory that transformers itself can load: `config.json`, safetensors
weights saved by `Qwen2_5_VLForConditionalGeneration.save_pretrained`, a small byte-level BPE tokenizer
with Qwen's special tokens and chat template, `generation_config.json` and `preprocessor_config.json`.
transformers' model on the same directory is the correctness oracle for our implementation.
Reached as `vlm_sdk.testing.make_tiny_checkpoint(path, family="qwen2_5_vl", ...)`.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping


from vlm_sdk.models.common.tiny_checkpoint import (QWEN_SPECIAL_TOKENS, QWEN_TEXT_TOKENS, TEXT_DEFAULTS,
                                                   build_tokenizer, checkpoint_options, floating_dtype,
                                                   save_random_model, vocab_size_for, write_json, write_tokenizer)

# The chat template published with Qwen2-VL / Qwen2.5-VL Instruct (their chat_template.json), which
# renders no tools, joined with the tool sections of the template their language model publishes
# (Qwen2.5-Instruct's tokenizer_config.json, also in Qwen2.5-VL's): the tools in the system turn, an
# assistant turn's calls as <tool_call> JSON, tool results as a user turn of <tool_response>s. Without
# tools and tool turns it renders exactly the published VL template.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% macro render_parts(content) %}{% if content is string %}{{ content }}{% else %}"
    "{% for content in content %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}"
    "{{ render_parts(messages[0]['content']) }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n\\n' }}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' and not tools %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% if message['content'] %}{{ '\\n' }}{{ render_parts(message['content']) }}{% endif %}"
    "{% for tool_call in message.tool_calls %}{% if tool_call.function is defined %}"
    "{% set tool_call = tool_call.function %}{% endif %}{{ '\\n' }}<tool_call>\n{\"name\": \"{{ tool_call.name }}\", "
    "\"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}{% if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "<|im_start|>user{% endif %}{{ '\\n' }}<tool_response>\n{{ render_parts(message['content']) }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ render_parts(message['content']) }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# As published (no tool sections): the template a Qwen2.5-VL checkpoint's chat_template.json holds.
QWEN2_VL_PUBLISHED_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

_DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    **TEXT_DEFAULTS,  # language model
    vision_depth=2,
    vision_hidden_size=32,
    vision_heads=2,
    vision_intermediate_size=64,
    fullatt_block_indexes=(1,),
    window_size=112,
    tie_word_embeddings=False,
    mrope_section=None,           # None: Qwen's 1/4, 3/8, 3/8 split of head_dim / 2
    max_position_embeddings=4096,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 256,
    init_std=0.2,
    config_layout="nested",
    preprocessor_layout="nested",
    max_shard_size=None,          # e.g. "200KB" forces sharded safetensors + model.safetensors.index.json
    dtype="float32",              # dtype of the saved weights ("bfloat16" for the benchmark checkpoint)
))

_FIXED: Mapping[str, Any] = MappingProxyType(dict(
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    tokens_per_second=2,
))


def make_tiny_qwen_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """Write a complete HF-format checkpoint with random weights to `path` and return it.

    Same arguments give byte-identical files. Accepted overrides: see `_DEFAULTS` (an unknown name
    raises TypeError). Layouts: config_layout "nested" is what transformers 5 writes, "flat" is the
    published Qwen2.5-VL layout (text fields top level, rope_scaling type mrope); preprocessor_layout
    "nested" writes size.shortest_edge/longest_edge, "flat" writes min_pixels/max_pixels.
    """
    opts = checkpoint_options(overrides, _DEFAULTS)
    for key, allowed in (("config_layout", ("nested", "flat")), ("preprocessor_layout", ("nested", "flat"))):
        if opts[key] not in allowed:
            raise ValueError(f"{key}={opts[key]!r}; use one of {allowed}")
    dtype = floating_dtype(opts["dtype"])

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer, ids, config = qwen_tokenizer_and_config(opts)
    from transformers import Qwen2_5_VLForConditionalGeneration
    save_random_model(Qwen2_5_VLForConditionalGeneration, config, out, seed=seed, init_std=float(opts["init_std"]), dtype=dtype,
                      max_shard_size=opts["max_shard_size"], norm_std=None)

    if opts["config_layout"] == "flat":
        nested = json.loads((out / "config.json").read_text())
        write_json(out / "config.json", _flat_qwen2_5_vl_config(nested, ids))
    write_qwen_side_files(out, tokenizer, ids, opts)
    return out


def qwen_tokenizer_and_config(opts: Mapping[str, Any]):
    """The test tokenizer, its special-token ids and the transformers `Qwen2_5_VLConfig` of `opts`
    (`_DEFAULTS` with overrides applied)."""
    tokenizer = build_tokenizer(QWEN_SPECIAL_TOKENS, QWEN_TEXT_TOKENS)
    ids = {tok: tokenizer.token_to_id(tok) for tok in QWEN_SPECIAL_TOKENS}
    vocab_size = vocab_size_for(tokenizer, opts["vocab_size"])
    return tokenizer, ids, _qwen2_5_vl_config(opts, vocab_size, ids)


def write_qwen_side_files(out: Path, tokenizer, ids: dict[str, int], opts: Mapping[str, Any]) -> None:
    """Everything of a Qwen2.5-VL checkpoint directory besides config.json and the weights: the
    tokenizer files, generation_config.json and preprocessor_config.json."""
    write_tokenizer(out, tokenizer, QWEN_SPECIAL_TOKENS, QWEN2_VL_CHAT_TEMPLATE)
    write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    })
    write_json(out / "preprocessor_config.json",
                _preprocessor_config(opts["min_pixels"], opts["max_pixels"], opts["preprocessor_layout"]))


def make_bench_qwen_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """The benchmark shape: Qwen2.5-VL architecture, 105,909,504 parameters, bfloat16 weights (212 MB).

    Text 101.4M (tied 151936 x 512 embedding = 77.8M of it), vision 4.5M. Speed does not depend on the
    weight values; vocab 151936 keeps the embedding and LM head as costly as the real ones.
    """
    bench = dict(
        text_hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408,
        vocab_size=151936, tie_word_embeddings=True, mrope_section=(8, 12, 12),
        max_position_embeddings=32768, min_pixels=56 * 56, max_pixels=28 * 28 * 1280,
        vision_depth=4, vision_hidden_size=256, vision_heads=4, vision_intermediate_size=512,
        fullatt_block_indexes=(3,), dtype="bfloat16",
    )
    return make_tiny_qwen_checkpoint(path, seed, **{**bench, **overrides})


# ----------------------------------------------------------------------------------------------
# config

def _qwen2_5_vl_config(o: dict, vocab_size: int, ids: dict[str, int]):
    from transformers import Qwen2_5_VLConfig

    hidden, heads, kv_heads = o["text_hidden_size"], o["num_heads"], o["num_kv_heads"]
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"text_hidden_size={hidden} must divide by num_heads={heads}, "
                         f"and num_heads by num_kv_heads={kv_heads}")
    half = hidden // heads // 2
    section = list(o["mrope_section"] or _default_mrope_section(half))
    if sum(section) != half:
        raise ValueError(f"mrope_section={section} must sum to head_dim/2 = {half}")
    if o["vision_hidden_size"] % o["vision_heads"]:
        raise ValueError(f"vision_hidden_size={o['vision_hidden_size']} must divide by vision_heads={o['vision_heads']}")
    bad = [i for i in o["fullatt_block_indexes"] if not 0 <= i < o["vision_depth"]]
    if bad:
        raise ValueError(f"fullatt_block_indexes {bad} outside vision_depth={o['vision_depth']}")

    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=o["intermediate_size"],
        num_hidden_layers=o["num_layers"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        hidden_act="silu", max_position_embeddings=o["max_position_embeddings"],
        rms_norm_eps=_FIXED["rms_norm_eps"], use_sliding_window=False,
        max_window_layers=o["num_layers"], attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": _FIXED["rope_theta"], "mrope_section": section},
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot,
    )
    vision = dict(
        depth=o["vision_depth"], hidden_size=o["vision_hidden_size"], hidden_act="silu",
        intermediate_size=o["vision_intermediate_size"], num_heads=o["vision_heads"], in_channels=3,
        patch_size=_FIXED["patch_size"], temporal_patch_size=_FIXED["temporal_patch_size"],
        spatial_merge_size=_FIXED["spatial_merge_size"], tokens_per_second=_FIXED["tokens_per_second"],
        window_size=o["window_size"], out_hidden_size=hidden,
        fullatt_block_indexes=list(o["fullatt_block_indexes"]),
    )
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=bool(o["tie_word_embeddings"]),
    )


def _default_mrope_section(half: int) -> list[int]:
    t = half // 4                      # Qwen2.5-VL: [16, 24, 24] of 64
    h = (half - t) // 2
    return [t, h, half - t - h]


def _flat_qwen2_5_vl_config(nested: dict, ids: dict[str, int]) -> dict:
    """The layout of the published Qwen2.5-VL config.json (written by transformers 4.4x)."""
    text = dict(nested["text_config"])
    rope = dict(text.pop("rope_parameters"))
    for key in ("model_type", "layer_types", "dtype", "sliding_window"):
        text.pop(key, None)
    vision = dict(nested["vision_config"])
    for key in ("model_type", "rope_parameters", "initializer_range", "in_channels", "dtype"):
        vision.pop(key, None)
    vision["in_chans"] = 3
    vision["spatial_patch_size"] = vision["patch_size"]
    flat = {
        "architectures": nested["architectures"],
        "model_type": "qwen2_5_vl",
        **text,
        "sliding_window": 32768,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": list(rope["mrope_section"])},
        "tie_word_embeddings": nested["tie_word_embeddings"],
        "torch_dtype": nested.get("dtype", "float32"),
        "image_token_id": nested["image_token_id"],
        "video_token_id": nested["video_token_id"],
        "vision_start_token_id": nested["vision_start_token_id"],
        "vision_end_token_id": nested["vision_end_token_id"],
        "vision_token_id": ids["<|vision_pad|>"],
        "vision_config": vision,
        "transformers_version": "4.49.0",
    }
    return dict(sorted(flat.items()))


def _preprocessor_config(min_pixels: int, max_pixels: int, layout: str) -> dict:
    common = {
        "image_mean": _OPENAI_CLIP_MEAN,
        "image_std": _OPENAI_CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "merge_size": _FIXED["spatial_merge_size"],
        "patch_size": _FIXED["patch_size"],
        "temporal_patch_size": _FIXED["temporal_patch_size"],
    }
    if layout == "flat":
        return {**common, "min_pixels": min_pixels, "max_pixels": max_pixels,
                "processor_class": "Qwen2_5_VLProcessor"}
    return {**common, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
            "resample": 3, "rescale_factor": 1 / 255,
            "size": {"longest_edge": max_pixels, "shortest_edge": min_pixels}}
