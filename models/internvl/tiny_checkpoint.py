"""Tiny InternVL 2 / 2.5 / 3 checkpoints with random weights, in both published layouts.

`make_tiny_internvl_checkpoint(path, layout="hf")` (also reached as
`vlm_sdk.testing.make_tiny_checkpoint(path, family="internvl", ...)`) builds transformers'
`InternVLForConditionalGeneration` (model_type "internvl") from a tiny `InternVLConfig`, redraws every
parameter from a private generator and saves it with `save_pretrained`, plus a tokenizer (the shared
byte-level BPE of `models/common/tiny_checkpoint.py` with Qwen's and InternVL's special tokens), the chat template transformers' InternVL
conversion writes, `generation_config.json` and a `GotOcr2ImageProcessor` `preprocessor_config.json`.
transformers loads that directory and is the correctness oracle.

`layout="original"` is OpenGVLab's remote-code layout (`InternVLChatModel`, model_type "internvl_chat",
`vision_model.*` / `mlp1.*` / `language_model.*` tensors, the tiling in config.json, a CLIP-style
preprocessor config): the same weights as the "hf" layout with the same seed, renamed and repacked
by `convert_to_original_layout`. No file of either layout imports remote code (no `*.py` is written).

Note: transformers 5 `save_pretrained` writes InternVL with its legacy tensor names
(`vision_tower.*`, `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.weight`),
not its in-memory ones (`model.vision_tower.*`, ..., `lm_head.weight`); the loader accepts both
(`vlm_sdk.models.internvl.model.hf_canonical_name`). A tied checkpoint has no lm_head tensor at all.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from vlm_sdk.models.internvl.tiny_checkpoint_original import (_IMAGENET_MEAN, _IMAGENET_STD, INTERNVL_CHATML_TEMPLATE,
                                                            INTERNVL_TOKENIZER_ATTRIBUTES, _llm_layout_for,
                                                            convert_to_original_layout)
from vlm_sdk.models.common.tiny_checkpoint import (QWEN_SPECIAL_TOKENS, TEXT_DEFAULTS, build_tokenizer,
                                                   checkpoint_options, floating_dtype, no_hf_progress_bars, redraw,
                                                   vocab_size_for, write_json, write_tokenizer)

__all__ = [
    "make_tiny_internvl_checkpoint", "make_bench_internvl_checkpoint", "convert_to_original_layout",
    "INTERNVL_SPECIAL_TOKENS", "INTERNVL_TOKENS", "INTERNVL_HF_TOKENS", "INTERNVL_HF_CHAT_TEMPLATE",
    "INTERNVL_CHATML_TEMPLATE", "INTERNVL_TOKENIZER_ATTRIBUTES",
]

# InternVL's tokens, in the order the published tokenizers add them, right after Qwen's.
INTERNVL_SPECIAL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>",
                           "</box>")
INTERNVL_TOKENS = QWEN_SPECIAL_TOKENS + INTERNVL_SPECIAL_TOKENS
# The -hf tokenizer also has "<video>" (the processor's video placeholder), last: transformers 5 adds a named
# special token missing from tokenizer.json on load anyway, so tokenizer.json carries it to agree with that.
INTERNVL_HF_TOKENS = INTERNVL_TOKENS + ("<video>",)

# The template transformers' convert_internvl_weights_to_hf.py writes (-hf checkpoints).
INTERNVL_HF_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)



_DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    **TEXT_DEFAULTS,  # language model
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    # vision tower (InternViT)
    vision_depth=2,
    vision_hidden_size=32,
    vision_heads=4,
    vision_intermediate_size=64,
    image_size=448,               # tile side; 448 / 14 = 32 patches a side, 256 tokens a tile after pixel shuffle
    patch_size=14,
    norm_type="layer_norm",       # "layer_norm" (300M InternViT) or "rms_norm" (InternViT-6B)
    use_qk_norm=False,
    qkv_bias=True,                # InternVLVisionConfig.attention_bias
    layer_scale_init_value=0.1,   # only written to config.json: the redraw replaces lambda_1 / lambda_2
    # preprocessing
    max_num=6,                    # max tiles: preprocessor max_patches ("hf"), config.json max_dynamic_patch ("original")
    # files
    llm_layout="auto",            # layout="original" only: see convert_to_original_layout
    init_std=0.2,
    max_shard_size=None,          # e.g. "200KB": sharded safetensors + model.safetensors.index.json
    dtype="float32",
))

_FIXED: Mapping[str, Any] = MappingProxyType(dict(
    rope_theta=1_000_000.0,
    qwen2_rms_norm_eps=1e-6,
    llama_rms_norm_eps=1e-5,      # InternLM2's; different from Qwen2's so a hard-coded eps shows
    llama_rope_scaling={"rope_type": "dynamic", "factor": 2.0},  # InternLM2 2.5's; plain RoPE below max positions
    vision_layer_norm_eps=1e-6,
    downsample_ratio=0.5,
    model_max_length=8192,        # what transformers' InternVL conversion sets
))

_LAYOUTS = ("hf", "original")
_LLMS = ("qwen2", "llama")
_LLM_LAYOUTS = ("auto", "qwen2", "internlm2", "llama")


def make_tiny_internvl_checkpoint(path, seed: int = 0, layout: str = "hf", llm: str = "qwen2",
                                  **overrides) -> Path:
    """Write a complete InternVL checkpoint with random weights to `path` and return it.

    layout "hf": transformers' `InternVLForConditionalGeneration` directory; "original": OpenGVLab's
    `InternVLChatModel` layout with the same weights (`convert_to_original_layout` of the "hf" one).
    llm "qwen2": a Qwen2 LLM (InternVL2.5 / 3, q/k/v biases); "llama": a Llama LLM without biases (what
    transformers' conversion makes of InternLM2-based checkpoints such as InternVL2-8B); in the original
    layout a llama LLM is written as InternLM2 (`llm_layout="auto"` or "internlm2") or kept as Llama
    (`llm_layout="llama"`). Accepted overrides: see `_DEFAULTS` (an unknown name raises TypeError).
    Same arguments give byte-identical files.

    Parameters are redrawn from `torch.Generator().manual_seed(seed)` in `named_parameters()` order:
    matrices (embeddings, conv, cls token, position embeddings included) ~ N(0, init_std), biases
    ~ N(0, 0.02), every other 1-D parameter (norm weights, layer scales) = 1 + 0.1 * N(0, 1).
    """
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r}; use one of {_LAYOUTS}")
    if llm not in _LLMS:
        raise ValueError(f"llm={llm!r}; use one of {_LLMS}")
    opts = checkpoint_options(overrides, _DEFAULTS, "make_tiny_checkpoint(family='internvl')", ("layout", "llm"))
    if opts["llm_layout"] not in _LLM_LAYOUTS:
        raise ValueError(f"llm_layout={opts['llm_layout']!r}; use one of {_LLM_LAYOUTS}")
    if layout == "hf" and opts["llm_layout"] != "auto":
        raise ValueError("llm_layout only applies to layout='original'")
    _llm_layout_for(llm, opts["llm_layout"])  # fails before any work on a bad combination
    dtype = floating_dtype(opts["dtype"])
    max_num = opts["max_num"]
    if isinstance(max_num, bool) or not isinstance(max_num, int) or max_num < 1:
        raise ValueError(f"max_num={max_num!r} must be a positive int")

    out = Path(path)
    if layout == "original":
        with tempfile.TemporaryDirectory(prefix="internvl_hf_") as tmp:
            hf_dir = make_tiny_internvl_checkpoint(tmp, seed=seed, layout="hf", llm=llm,
                                                   **{**overrides, "llm_layout": "auto"})
            return convert_to_original_layout(hf_dir, out, llm_layout=opts["llm_layout"],
                                              max_shard_size=opts["max_shard_size"])
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(INTERNVL_HF_TOKENS)
    ids = {tok: tokenizer.token_to_id(tok) for tok in INTERNVL_HF_TOKENS}
    vocab_size = vocab_size_for(tokenizer, opts["vocab_size"])

    config = _internvl_config(opts, llm, vocab_size, ids)
    _save_model(config, out, seed=seed, init_std=float(opts["init_std"]), dtype=dtype,
                max_shard_size=opts["max_shard_size"])
    write_tokenizer(out, tokenizer, INTERNVL_HF_TOKENS, INTERNVL_HF_CHAT_TEMPLATE,
                     extra_config={**INTERNVL_TOKENIZER_ATTRIBUTES, "model_max_length": _FIXED["model_max_length"]})
    write_json(out / "generation_config.json", _generation_config(ids))
    write_json(out / "preprocessor_config.json", _hf_preprocessor_config(opts["image_size"], max_num))
    return out


def make_bench_internvl_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """The benchmark shape in InternVL form: 105,765,120 parameters, bfloat16 weights (212 MB), max_num 6.

    Qwen2 LLM as in the Qwen2.5-VL bench checkpoint (hidden 512, 8 layers, 8 heads / 4 KV, intermediate 1408,
    tied 151936 x 512 embedding = 77.8M): 101,401,088; InternViT (hidden 256, 4 layers, 4 heads,
    intermediate 1024, 448 tiles of patch 14, 1025 positions): 3,574,528; projector (LayerNorm 1024,
    1024 -> 512 -> 512): 789,504. Each 448 tile is 256 image tokens.
    """
    bench = dict(
        text_hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408,
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
        vision_depth=4, vision_hidden_size=256, vision_heads=4, vision_intermediate_size=1024,
        image_size=448, patch_size=14, max_num=6, dtype="bfloat16",
    )
    return make_tiny_internvl_checkpoint(path, seed=seed, **{**bench, **overrides})


# ----------------------------------------------------------------------------------------------
# config


def _internvl_config(o: dict, llm: str, vocab_size: int, ids: dict[str, int]):
    from transformers import InternVLConfig, LlamaConfig, Qwen2Config

    hidden, heads, kv_heads = o["text_hidden_size"], o["num_heads"], o["num_kv_heads"]
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"text_hidden_size={hidden} must divide by num_heads={heads}, "
                         f"and num_heads by num_kv_heads={kv_heads}")
    if o["vision_hidden_size"] % o["vision_heads"]:
        raise ValueError(f"vision_hidden_size={o['vision_hidden_size']} must divide by "
                         f"vision_heads={o['vision_heads']}")
    if o["image_size"] % o["patch_size"] or (o["image_size"] // o["patch_size"]) % 2:
        raise ValueError(f"image_size={o['image_size']} must be an even multiple of patch_size={o['patch_size']} "
                         f"(pixel shuffle halves the patch grid)")
    if o["norm_type"] not in ("layer_norm", "rms_norm"):
        raise ValueError(f"norm_type={o['norm_type']!r}; use 'layer_norm' or 'rms_norm'")
    tied = bool(o["tie_word_embeddings"])
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=o["intermediate_size"],
        num_hidden_layers=o["num_layers"], num_attention_heads=heads, num_key_value_heads=kv_heads,
        hidden_act="silu", max_position_embeddings=o["max_position_embeddings"], attention_dropout=0.0,
        bos_token_id=eot, eos_token_id=im_end, pad_token_id=eot, tie_word_embeddings=tied,
    )
    if llm == "qwen2":
        text = Qwen2Config(**common, rms_norm_eps=_FIXED["qwen2_rms_norm_eps"], use_sliding_window=False,
                           max_window_layers=o["num_layers"],
                           rope_parameters={"rope_type": "default", "rope_theta": _FIXED["rope_theta"]})
    else:
        text = LlamaConfig(**common, rms_norm_eps=_FIXED["llama_rms_norm_eps"], attention_bias=False,
                           mlp_bias=False, head_dim=hidden // heads,
                           rope_parameters={**_FIXED["llama_rope_scaling"], "rope_theta": _FIXED["rope_theta"]})
    vision = dict(
        hidden_size=o["vision_hidden_size"], num_hidden_layers=o["vision_depth"],
        num_attention_heads=o["vision_heads"], intermediate_size=o["vision_intermediate_size"],
        image_size=o["image_size"], patch_size=o["patch_size"], norm_type=o["norm_type"],
        use_qk_norm=bool(o["use_qk_norm"]), attention_bias=bool(o["qkv_bias"]),
        layer_scale_init_value=float(o["layer_scale_init_value"]), layer_norm_eps=_FIXED["vision_layer_norm_eps"],
        hidden_act="gelu", use_mean_pooling=True, use_absolute_position_embeddings=True,
    )
    ratio = _FIXED["downsample_ratio"]
    return InternVLConfig(
        vision_config=vision, text_config=text, image_token_id=ids["<IMG_CONTEXT>"],
        image_seq_length=int((o["image_size"] // o["patch_size"]) ** 2 * ratio ** 2),
        downsample_ratio=ratio, vision_feature_layer=-1, vision_feature_select_strategy="default",
        projector_hidden_act="gelu", tie_word_embeddings=tied,
    )


def _generation_config(ids: dict[str, int]) -> dict:
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }


def _hf_preprocessor_config(image_size: int, max_num: int) -> dict:
    """What transformers' GotOcr2ImageProcessor(Fast/Pil).save_pretrained writes for an -hf InternVL checkpoint
    (crop_to_patches set: the published files say false and rely on InternVLProcessor's default)."""
    return {
        "crop_to_patches": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": _IMAGENET_MEAN,
        "image_processor_type": "GotOcr2ImageProcessor",
        "image_std": _IMAGENET_STD,
        "max_patches": max_num,
        "min_patches": 1,
        "processor_class": "InternVLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"height": image_size, "width": image_size},
    }


# ----------------------------------------------------------------------------------------------
# weights


def _save_model(config, out: Path, *, seed: int, init_std: float, dtype: torch.dtype, max_shard_size) -> None:
    from transformers import InternVLForConditionalGeneration
    from transformers.initialization import no_init_weights

    with no_hf_progress_bars():
        with no_init_weights():  # every parameter is redrawn below; skips ~4 s on the bench shape
            model = InternVLForConditionalGeneration(config)
        model.tie_weights()  # no_init_weights also skips the tying post_init does
        redraw(model, seed, init_std, norm_std=0.1)
        if config.tie_word_embeddings:
            emb, head = model.get_input_embeddings().weight, model.lm_head.weight
            if head is not emb:  # transformers ties them to one parameter; keep equal values if it ever does not
                with torch.no_grad():
                    head.copy_(emb)
        model.to(dtype)
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(out, **kwargs)
