"""The original (remote-code) InternVL layout, made from a transformers-layout checkpoint.

`convert_to_original_layout(hf_dir, out_dir)` renames and repacks the tensors of an
`InternVLForConditionalGeneration` directory into OpenGVLab's `InternVLChatModel` layout
(`vision_model.*`, `mlp1.*`, `language_model.*`; an InternLM2 LLM gets its packed, grouped `wqkv`)
and writes the config.json, tokenizer and CLIP-style preprocessor config that layout ships with.
The same weights in both layouts let the tests check that both load to the same model.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch

from vlm_sdk.model_loader import iter_safetensors
from vlm_sdk.models.internvl.model import hf_canonical_name
from vlm_sdk.models.common.tiny_checkpoint import write_json

__all__ = ["convert_to_original_layout", "INTERNVL_CHATML_TEMPLATE", "INTERNVL_TOKENIZER_ATTRIBUTES"]

# Named tokens that transformers' InternVLProcessor reads from the tokenizer (tokenizer.start_image_token,
# ..._id); transformers 5 turns any top-level "*_token" string of tokenizer_config.json into one.
INTERNVL_TOKENIZER_ATTRIBUTES: Mapping[str, str] = MappingProxyType({
    "context_image_token": "<IMG_CONTEXT>",
    "end_image_token": "</img>",
    "start_image_token": "<img>",
    "video_token": "<video>",
})

# The original checkpoints' tokenizer template: plain chatml over string contents.
INTERNVL_CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_IMAGENET_MEAN = [0.485, 0.456, 0.406]
_IMAGENET_STD = [0.229, 0.224, 0.225]


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
    from vlm_sdk.models.common.internlm2_weights import pack_wqkv

    src, out = Path(hf_dir), Path(out_dir)
    hf = json.loads((src / "config.json").read_text(encoding="utf-8"))
    text, vision = hf["text_config"], hf["vision_config"]
    llm = {"qwen2": "qwen2", "llama": "llama"}.get(text.get("model_type"))
    if llm is None:
        raise ValueError(f"{src}: text_config model_type {text.get('model_type')!r} is not qwen2 or llama")
    llm_out = _llm_layout_for(llm, llm_layout)
    tensors = {hf_canonical_name(k): v for k, v in iter_safetensors(src, show_progress=False)}

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
    write_json(out / "config.json", _original_config(hf, llm_out, _read_preprocessor_max_num(src)))

    _write_original_tokenizer(src, out)
    shutil.copyfile(src / "generation_config.json", out / "generation_config.json")
    write_json(out / "preprocessor_config.json", _original_preprocessor_config(_side(vision["image_size"])))
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
    write_json(out / "tokenizer_config.json", dict(sorted(tok_cfg.items())))
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


def _write_tensors(out: Path, tensors: dict[str, torch.Tensor], max_shard_size) -> None:
    """One `model.safetensors`, or shards + an index when `max_shard_size` (e.g. "200KB") is given."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors = {n: tensors[n].contiguous() for n in sorted(tensors)}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size or "1000GB")
    for fname, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, str(out / fname), metadata={"format": "pt"})
    if split.is_sharded:
        write_json(out / "model.safetensors.index.json",
                    {"metadata": split.metadata, "weight_map": split.tensor_to_filename})
