"""Tiny InternVL 2 / 2.5 / 3 checkpoints with random weights, in both published layouts.

`make_tiny_internvl_checkpoint(path, layout="hf")` (also reached as
`vlm_sdk.testing.make_tiny_checkpoint(path, family="internvl", ...)`) builds transformers'
`InternVLForConditionalGeneration` (model_type "internvl") from a tiny `InternVLConfig`, redraws every
parameter from a private generator and saves it with `save_pretrained`, plus a tokenizer (testing.py's
byte-level BPE with Qwen's and InternVL's special tokens), the chat template transformers' InternVL
conversion writes, `generation_config.json` and a `GotOcr2ImageProcessor` `preprocessor_config.json`.
transformers loads that directory and is the correctness oracle.

`layout="original"` is OpenGVLab's remote-code layout (`InternVLChatModel`, model_type "internvl_chat",
`vision_model.*` / `mlp1.*` / `language_model.*` tensors, the tiling in config.json, a CLIP-style
preprocessor config): the same weights as the "hf" layout with the same seed, renamed and repacked
by `convert_to_original_layout`. No file of either layout imports remote code (no `*.py` is written).

Note: transformers 5 `save_pretrained` writes InternVL with its legacy tensor names
(`vision_tower.*`, `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.weight`);
checkpoints converted with transformers 4.5x (the published `-hf` repos) use `model.vision_tower.*`,
`model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.weight`. `hf_canonical_name` maps
both spellings to the latter. A tied checkpoint has no lm_head tensor at all.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from vlm_sdk.testing import (QWEN_SPECIAL_TOKENS, _build_tokenizer, _no_hf_progress_bars, _round_up,
                             _write_json, _write_tokenizer)

__all__ = [
    "make_tiny_internvl_checkpoint", "make_bench_internvl_checkpoint", "convert_to_original_layout",
    "hf_canonical_name", "INTERNVL_SPECIAL_TOKENS", "INTERNVL_TOKENS", "INTERNVL_HF_TOKENS", "INTERNVL_HF_CHAT_TEMPLATE",
    "INTERNVL_CHATML_TEMPLATE", "INTERNVL_TOKENIZER_ATTRIBUTES",
]

# InternVL's tokens, in the order the published tokenizers add them, right after Qwen's.
INTERNVL_SPECIAL_TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>",
                           "</box>")
INTERNVL_TOKENS = QWEN_SPECIAL_TOKENS + INTERNVL_SPECIAL_TOKENS
# The -hf tokenizer also has "<video>" (the processor's video placeholder), last: transformers 5 adds a named
# special token missing from tokenizer.json on load anyway, so tokenizer.json carries it to agree with that.
INTERNVL_HF_TOKENS = INTERNVL_TOKENS + ("<video>",)

# Named tokens that transformers' InternVLProcessor reads from the tokenizer (tokenizer.start_image_token,
# ..._id); transformers 5 turns any top-level "*_token" string of tokenizer_config.json into one.
INTERNVL_TOKENIZER_ATTRIBUTES: Mapping[str, str] = MappingProxyType({
    "context_image_token": "<IMG_CONTEXT>",
    "end_image_token": "</img>",
    "start_image_token": "<img>",
    "video_token": "<video>",
})

# The template transformers' convert_internvl_weights_to_hf.py writes (-hf checkpoints).
INTERNVL_HF_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)

# The original checkpoints' tokenizer template: plain chatml over string contents.
INTERNVL_CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_IMAGENET_MEAN = [0.485, 0.456, 0.406]
_IMAGENET_STD = [0.229, 0.224, 0.225]

_DEFAULTS: Mapping[str, Any] = MappingProxyType(dict(
    # language model
    text_hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=None,              # None: tokenizer size rounded up to a multiple of 64
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
    unknown = sorted(set(overrides) - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"make_tiny_checkpoint(family='internvl') got unknown override(s) {', '.join(unknown)}; "
                        f"accepted: layout, llm, {', '.join(sorted(_DEFAULTS))}")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r}; use one of {_LAYOUTS}")
    if llm not in _LLMS:
        raise ValueError(f"llm={llm!r}; use one of {_LLMS}")
    opts = {**_DEFAULTS, **overrides}
    if opts["llm_layout"] not in _LLM_LAYOUTS:
        raise ValueError(f"llm_layout={opts['llm_layout']!r}; use one of {_LLM_LAYOUTS}")
    if layout == "hf" and opts["llm_layout"] != "auto":
        raise ValueError("llm_layout only applies to layout='original'")
    _llm_layout_for(llm, opts["llm_layout"])  # fails before any work on a bad combination
    dtype = getattr(torch, str(opts["dtype"]), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={opts['dtype']!r} is not a torch floating dtype name")
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

    tokenizer = _build_tokenizer(INTERNVL_HF_TOKENS)
    ids = {tok: tokenizer.token_to_id(tok) for tok in INTERNVL_HF_TOKENS}
    n_tokens = tokenizer.get_vocab_size()
    vocab_size = opts["vocab_size"] or _round_up(n_tokens, 64)
    if vocab_size < n_tokens:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({n_tokens} tokens)")

    config = _internvl_config(opts, llm, vocab_size, ids)
    _save_model(config, out, seed=seed, init_std=float(opts["init_std"]), dtype=dtype,
                max_shard_size=opts["max_shard_size"])
    _write_tokenizer(out, tokenizer, INTERNVL_HF_TOKENS, INTERNVL_HF_CHAT_TEMPLATE,
                     extra_config={**INTERNVL_TOKENIZER_ATTRIBUTES, "model_max_length": _FIXED["model_max_length"]})
    _write_json(out / "generation_config.json", _generation_config(ids))
    _write_json(out / "preprocessor_config.json", _hf_preprocessor_config(opts["image_size"], max_num))
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


def _original_preprocessor_config(image_size: int) -> dict:
    """The CLIP-style file of OpenGVLab's original checkpoints (the tiling lives in config.json)."""
    return {
        "crop_size": image_size,
        "do_center_crop": True,
        "do_normalize": True,
        "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor",
        "image_mean": _IMAGENET_MEAN,
        "image_std": _IMAGENET_STD,
        "resample": 3,
        "size": image_size,
    }


# ----------------------------------------------------------------------------------------------
# weights


def _save_model(config, out: Path, *, seed: int, init_std: float, dtype: torch.dtype, max_shard_size) -> None:
    from transformers import InternVLForConditionalGeneration
    from transformers.initialization import no_init_weights

    with _no_hf_progress_bars():
        with no_init_weights():  # every parameter is redrawn below; skips ~4 s on the bench shape
            model = InternVLForConditionalGeneration(config)
        model.tie_weights()  # no_init_weights also skips the tying post_init does
        _redraw(model, seed, init_std)
        if config.tie_word_embeddings:
            emb, head = model.get_input_embeddings().weight, model.lm_head.weight
            if head is not emb:  # transformers ties them to one parameter; keep equal values if it ever does not
                with torch.no_grad():
                    head.copy_(emb)
        model.to(dtype)
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(out, **kwargs)


@torch.no_grad()
def _redraw(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Matrices ~ N(0, init_std); biases ~ N(0, 0.02); other 1-D parameters = 1 + 0.1 * N(0, 1), so a norm
    weight or layer scale loaded into the wrong place (or not at all) changes the output."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():       # tied parameters appear once
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if p.ndim >= 2:
            p.copy_(noise * init_std)
        elif name.endswith("bias"):
            p.copy_(noise * 0.02)
        else:
            p.copy_(1.0 + 0.1 * noise)


# ----------------------------------------------------------------------------------------------
# original (remote-code) layout

_HF_PREFIXES = (  # transformers 5 save_pretrained spelling -> transformers 4.5x / in-memory spelling
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model.language_model."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)

_VISION_LAYER_RENAMES = {
    "attention.projection_layer.": "attn.proj.",
    "attention.q_norm.": "attn.q_norm.",
    "attention.k_norm.": "attn.k_norm.",
    "layernorm_before.": "norm1.",
    "layernorm_after.": "norm2.",
    "mlp.fc1.": "mlp.fc1.",
    "mlp.fc2.": "mlp.fc2.",
}
_VISION_TOP_RENAMES = {
    "embeddings.cls_token": "embeddings.class_embedding",
    "embeddings.patch_embeddings.projection.weight": "embeddings.patch_embedding.weight",
    "embeddings.patch_embeddings.projection.bias": "embeddings.patch_embedding.bias",
    "embeddings.position_embeddings": "embeddings.position_embedding",
}
_PROJECTOR_RENAMES = {"layer_norm.": "mlp1.0.", "linear_1.": "mlp1.1.", "linear_2.": "mlp1.3."}
_INTERNLM2_LAYER_RENAMES = {
    "self_attn.o_proj.": "attention.wo.",
    "mlp.gate_proj.": "feed_forward.w1.",
    "mlp.up_proj.": "feed_forward.w3.",
    "mlp.down_proj.": "feed_forward.w2.",
    "input_layernorm.": "attention_norm.",
    "post_attention_layernorm.": "ffn_norm.",
}
_VISION_LAYER = re.compile(r"model\.vision_tower\.encoder\.layer\.(\d+)\.(.+)")
_TEXT_LAYER = re.compile(r"model\.language_model\.layers\.(\d+)\.(.+)")
_QKV = re.compile(r"(.*)\.(q|k|v)_proj\.(weight|bias)")


def hf_canonical_name(name: str) -> str:
    """A tensor name of an -hf InternVL checkpoint in transformers' in-memory spelling (`model.vision_tower.*`,
    `model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.weight`); accepts both that and the
    legacy spelling transformers 5 `save_pretrained` writes."""
    for legacy, new in _HF_PREFIXES:
        if name.startswith(legacy):
            return new + name[len(legacy):]
    return name


def _llm_layout_for(llm: str, llm_layout: str) -> str:
    """The original-layout LLM naming for a text config family: "qwen2", "internlm2" or "llama"."""
    allowed = {"qwen2": ("auto", "qwen2"), "llama": ("auto", "internlm2", "llama")}[llm]
    if llm_layout not in allowed:
        raise ValueError(f"llm_layout={llm_layout!r} does not fit a {llm} LLM; use one of {allowed}")
    if llm_layout != "auto":
        return llm_layout
    return "qwen2" if llm == "qwen2" else "internlm2"


def convert_to_original_layout(hf_dir, out_dir, llm_layout: str = "auto", *, max_shard_size=None) -> Path:
    """Rewrite an -hf InternVL checkpoint directory (`hf_dir`, as `make_tiny_internvl_checkpoint` writes it)
    in OpenGVLab's original layout under `out_dir`; returns `out_dir`. Tensors are renamed and, for the
    vision q/k/v and InternLM2's wqkv, packed; values and dtypes are unchanged.

    llm_layout "auto": a qwen2 text config -> `Qwen2ForCausalLM` names (`language_model.model.*`,
    `language_model.lm_head.weight`), a llama one -> `InternLM2ForCausalLM` names (`tok_embeddings`,
    grouped `attention.wqkv`, `wo`, `feed_forward.w1/w3/w2`, `attention_norm`, `ffn_norm`, `output`);
    "llama" keeps a llama text config as `LlamaForCausalLM`. `max_shard_size` (bytes or e.g. "200KB")
    splits the weights into `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`.
    """
    from vlm_sdk.models.internlm2.weights import pack_wqkv

    src, out = Path(hf_dir), Path(out_dir)
    hf = json.loads((src / "config.json").read_text(encoding="utf-8"))
    text, vision = hf["text_config"], hf["vision_config"]
    llm = {"qwen2": "qwen2", "llama": "llama"}.get(text.get("model_type"))
    if llm is None:
        raise ValueError(f"{src}: text_config model_type {text.get('model_type')!r} is not qwen2 or llama")
    llm_out = _llm_layout_for(llm, llm_layout)
    tensors = {hf_canonical_name(k): v for k, v in _read_tensors(src).items()}

    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    result: dict[str, torch.Tensor] = {}
    qkv_parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (packed name, kind) -> {"q": .., "k": .., "v": ..}

    def put(name: str, tensor: torch.Tensor) -> None:
        if name in result:
            raise ValueError(f"two tensors map to {name}")
        result[name] = tensor

    for name, t in tensors.items():
        if name.startswith("model.vision_tower."):
            rel = name[len("model.vision_tower."):]
            m = _VISION_LAYER.fullmatch(name)
            if rel in _VISION_TOP_RENAMES:
                put("vision_model." + _VISION_TOP_RENAMES[rel], t)
            elif m is not None:
                layer, leaf = f"vision_model.encoder.layers.{m.group(1)}.", m.group(2)
                q = _QKV.fullmatch(leaf)
                if q is not None and q.group(1) == "attention":
                    qkv_parts.setdefault((layer + "attn.qkv." + q.group(3), "vision"), {})[q.group(2)] = t
                elif leaf in ("lambda_1", "lambda_2"):
                    put(layer + "ls" + leaf[-1], t)
                else:
                    put(layer + _rename(leaf, _VISION_LAYER_RENAMES, name), t)
            else:
                raise ValueError(f"unexpected vision tensor {name}")
        elif name.startswith("model.multi_modal_projector."):
            put(_rename(name[len("model.multi_modal_projector."):], _PROJECTOR_RENAMES, name), t)
        elif name.startswith("model.language_model.") or name == "lm_head.weight":
            if llm_out != "internlm2":  # Qwen2ForCausalLM / LlamaForCausalLM names
                put("language_model.lm_head.weight" if name == "lm_head.weight"
                    else "language_model.model." + name[len("model.language_model."):], t)
                continue
            m = _TEXT_LAYER.fullmatch(name)
            if name == "lm_head.weight":
                put("language_model.output.weight", t)
            elif name == "model.language_model.embed_tokens.weight":
                put("language_model.model.tok_embeddings.weight", t)
            elif name == "model.language_model.norm.weight":
                put("language_model.model.norm.weight", t)
            elif m is not None:
                layer, leaf = f"language_model.model.layers.{m.group(1)}.", m.group(2)
                q = _QKV.fullmatch(leaf)
                if q is not None and q.group(1) == "self_attn":
                    qkv_parts.setdefault((layer + "attention.wqkv." + q.group(3), "internlm2"), {})[q.group(2)] = t
                else:
                    put(layer + _rename(leaf, _INTERNLM2_LAYER_RENAMES, name), t)
            else:
                raise ValueError(f"unexpected language-model tensor {name}")
        else:
            raise ValueError(f"unexpected tensor {name} in {src}")

    for (packed, kind), parts in qkv_parts.items():
        if sorted(parts) != ["k", "q", "v"]:
            raise ValueError(f"{packed}: q/k/v incomplete (have {sorted(parts)})")
        if kind == "vision":
            put(packed, torch.cat([parts["q"], parts["k"], parts["v"]], dim=0))
        else:
            put(packed, pack_wqkv(parts["q"], parts["k"], parts["v"], heads, kv_heads, head_dim).contiguous())

    out.mkdir(parents=True, exist_ok=True)
    _write_tensors(out, result, max_shard_size)
    _write_json(out / "config.json", _original_config(hf, llm_out, _read_preprocessor_max_num(src)))

    _write_original_tokenizer(src, out)
    shutil.copyfile(src / "generation_config.json", out / "generation_config.json")
    _write_json(out / "preprocessor_config.json", _original_preprocessor_config(_side(vision["image_size"])))
    return out


def _write_original_tokenizer(src: Path, out: Path) -> None:
    """The -hf tokenizer without what transformers' conversion added: the named image/video tokens, the
    "<video>" token (the original tokenizers do not have it) and the content-list template (chatml instead)."""
    from tokenizers import Tokenizer

    tok_json = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    video = [t for t in tok_json.get("added_tokens", []) if t["content"] == "<video>"]
    top = max(t["id"] for t in tok_json.get("added_tokens", [])) if tok_json.get("added_tokens") else None
    if video and video[0]["id"] == top:  # the last id: dropping it leaves no hole
        tok_json["added_tokens"] = [t for t in tok_json["added_tokens"] if t["content"] != "<video>"]
    Tokenizer.from_str(json.dumps(tok_json)).save(str(out / "tokenizer.json"))
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key in INTERNVL_TOKENIZER_ATTRIBUTES:
        tok_cfg.pop(key, None)
    if video and video[0]["id"] == top:
        tok_cfg["added_tokens_decoder"].pop(str(top), None)
        tok_cfg["additional_special_tokens"] = [t for t in tok_cfg["additional_special_tokens"] if t != "<video>"]
    tok_cfg["chat_template"] = INTERNVL_CHATML_TEMPLATE
    _write_json(out / "tokenizer_config.json", dict(sorted(tok_cfg.items())))
    (out / "chat_template.jinja").write_text(INTERNVL_CHATML_TEMPLATE, encoding="utf-8")


def _rename(leaf: str, table: Mapping[str, str], full: str) -> str:
    for old, new in table.items():
        if leaf.startswith(old):
            return new + leaf[len(old):]
    raise ValueError(f"no original-layout name for tensor {full}")


def _side(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def _read_preprocessor_max_num(src: Path) -> int:
    pre = json.loads((src / "preprocessor_config.json").read_text(encoding="utf-8"))
    return int(pre.get("max_patches", 12))


def _original_config(hf: dict, llm_out: str, max_num: int) -> dict:
    """config.json of a published InternVL2 / 2.5 checkpoint, from the -hf config dict."""
    text, vision = hf["text_config"], hf["vision_config"]
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    rope = dict(text.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", 10000.0)
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope_scaling = None if rope_type == "default" else {"type": rope_type, **rope}
    tied = bool(hf.get("tie_word_embeddings", False))
    common = {
        "vocab_size": text["vocab_size"], "hidden_size": text["hidden_size"],
        "intermediate_size": text["intermediate_size"], "num_hidden_layers": text["num_hidden_layers"],
        "num_attention_heads": text["num_attention_heads"], "num_key_value_heads": text["num_key_value_heads"],
        "hidden_act": text.get("hidden_act", "silu"), "max_position_embeddings": text["max_position_embeddings"],
        "rms_norm_eps": text["rms_norm_eps"], "rope_theta": rope_theta, "rope_scaling": rope_scaling,
        "initializer_range": text.get("initializer_range", 0.02), "tie_word_embeddings": tied,
        "bos_token_id": text.get("bos_token_id"), "eos_token_id": text.get("eos_token_id"),
        "pad_token_id": text.get("pad_token_id"), "use_cache": True, "torch_dtype": dtype,
    }
    if llm_out == "qwen2":
        llm_config = {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common,
            "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": 32768,
            "max_window_layers": text.get("max_window_layers", text["num_hidden_layers"]),
        }
    elif llm_out == "internlm2":
        llm_config = {
            "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", **common,
            "bias": bool(text.get("attention_bias", False)), "pretraining_tp": 1, "attn_implementation": "eager",
            "auto_map": {
                "AutoConfig": "configuration_internlm2.InternLM2Config",
                "AutoModel": "modeling_internlm2.InternLM2ForCausalLM",
                "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
            },
        }
    else:
        llm_config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "attention_bias": bool(text.get("attention_bias", False)), "mlp_bias": bool(text.get("mlp_bias", False)),
            "head_dim": text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            "attention_dropout": 0.0, "pretraining_tp": 1,
        }
    vision_config = {
        "architectures": ["InternVisionModel"], "model_type": "intern_vit_6b",
        "hidden_size": vision["hidden_size"], "num_attention_heads": vision["num_attention_heads"],
        "intermediate_size": vision["intermediate_size"], "num_hidden_layers": vision["num_hidden_layers"],
        "qkv_bias": bool(vision["attention_bias"]), "qk_normalization": bool(vision["use_qk_norm"]),
        "norm_type": vision["norm_type"], "layer_norm_eps": vision["layer_norm_eps"],
        "image_size": _side(vision["image_size"]), "patch_size": _side(vision["patch_size"]),
        "hidden_act": vision.get("hidden_act", "gelu"), "num_channels": vision.get("num_channels", 3),
        "drop_path_rate": 0.0, "dropout": 0.0, "attention_dropout": 0.0, "use_flash_attn": False,
        "initializer_factor": 1.0, "initializer_range": vision.get("initializer_range", 0.02),
        "torch_dtype": dtype,
    }
    config = {
        "architectures": ["InternVLChatModel"],
        "auto_map": {
            "AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
            "AutoModel": "modeling_internvl_chat.InternVLChatModel",
            "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel",
        },
        "downsample_ratio": hf.get("downsample_ratio", 0.5),
        "dynamic_image_size": True,
        "force_image_size": _side(vision["image_size"]),
        "llm_config": dict(sorted(llm_config.items())),
        "max_dynamic_patch": max_num,
        "min_dynamic_patch": 1,
        "model_type": "internvl_chat",
        "pad2square": False,
        "ps_version": "v2",
        "select_layer": hf.get("vision_feature_layer", -1),
        "template": "internvl2_5",
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "transformers_version": None,
        "use_backbone_lora": 0,
        "use_llm_lora": 0,
        "use_thumbnail": True,
        "vision_config": dict(sorted(vision_config.items())),
    }
    return config


def _read_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {src}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(src / f)).items():
            if name in tensors:
                raise ValueError(f"tensor {name} is stored twice in {src}")
            tensors[name] = t
    return tensors


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?B)\s*", str(size).upper())
    if m is None:
        raise ValueError(f"max_shard_size={size!r}: use an int or e.g. '200KB', '5MB', '1GB'")
    return int(m.group(1)) * {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9}[m.group(2)]


def _write_tensors(out: Path, tensors: dict[str, torch.Tensor], max_shard_size) -> None:
    """One `model.safetensors`, or greedy shards in name order + an index when `max_shard_size` is given."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    if max_shard_size is None:
        save_file({n: tensors[n].contiguous() for n in names}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    limit = _parse_size(max_shard_size)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:
        nbytes = tensors[n].numel() * tensors[n].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in shard}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
