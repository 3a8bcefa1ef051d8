"""InternVLVisionTower against transformers' InternVLModel.get_image_features, in both checkpoint layouts."""
from __future__ import annotations

import re

import pytest
import torch
from transformers import InternVLConfig, InternVLForConditionalGeneration, PretrainedConfig

from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.errors import CheckpointError
from vlm_sdk.weight_loading import load_checked
from vlm_sdk.models.cpu_layout import use_cpu_weight_layout
from vlm_sdk.models.internvl.vision import InternVisionConfig, InternVLVisionTower

TEXT_HIDDEN = 64
TEXT = dict(model_type="qwen2", hidden_size=TEXT_HIDDEN, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, vocab_size=64)
VISION = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
              image_size=32, patch_size=4)  # an 8x8 patch grid -> 16 tokens per 32px tile
# the towers' chain here (tests/tolerance.py): 4 x 4 x 3 = 48-input patches, at most 3 blocks of width 32
# (MLP 64) over at most 145 tokens a tile (48-pixel tiles), a projector of inputs 128 + 64
TERMS = forward_terms(layers=0, hidden=0, intermediate=0, tokens=0, patch=4 * 4 * 3, vision_layers=3,
                      vision_hidden=32, vision_intermediate=64, vision_tokens=145, merger=192)


def close(actual, expected):
    assert_reduction_close(actual, expected, TERMS)


PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")


def make_hf(seed: int = 0, vision_feature_layer: int = -1, **vision) -> InternVLForConditionalGeneration:
    """A tiny transformers InternVL whose vision and projector weights are all random (norms, layer
    scales, CLS and position embeddings included), so that a misplaced tensor changes the output."""
    cfg = InternVLConfig(vision_config={**VISION, **vision}, text_config=TEXT, downsample_ratio=0.5,
                         vision_feature_layer=vision_feature_layer, attn_implementation="eager")
    model = InternVLForConditionalGeneration(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    named = [*model.model.vision_tower.named_parameters(), *model.model.multi_modal_projector.named_parameters()]
    with torch.no_grad():
        for name, p in named:
            noise = torch.randn(p.shape, generator=gen)
            if re.search(r"(norm|layernorm_before|layernorm_after|layernorm|layer_norm)\.weight$", name):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith(("cls_token", "position_embeddings")):
                p.copy_(0.5 * noise)
            elif p.dim() >= 2:
                p.copy_(noise / p[0].numel() ** 0.5)
            else:  # biases and layer scales
                p.copy_(0.3 * noise)
    return model


def vision_weights(hf) -> dict[str, torch.Tensor]:
    return {k: v for k, v in hf.state_dict().items() if k.startswith(PREFIXES)}


def reference(hf, pixel_values: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        out = hf.model.get_image_features(pixel_values=pixel_values, **kwargs).pooler_output
    return out.reshape(-1, TEXT_HIDDEN)


def pixels(tiles: int, side: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(tiles, 3, side, side, generator=torch.Generator().manual_seed(seed))


def tower_for(cfg: InternVisionConfig, weights: dict[str, torch.Tensor], layout: str) -> InternVLVisionTower:
    tower = InternVLVisionTower(cfg)
    load_checked(tower, weights.items(), tower.checkpoint_map(layout))
    return tower


def hf_tower(hf) -> InternVLVisionTower:
    return tower_for(InternVisionConfig.from_hf(hf.config, TEXT_HIDDEN), vision_weights(hf), "hf")


# ----------------------------------------------------------------------------------------------
# transformers layout

HF_CASES = {
    "layer_norm-bias": dict(norm_type="layer_norm", attention_bias=True),
    "rms_norm-qk_norm": dict(norm_type="rms_norm", use_qk_norm=True),
    "layer_norm-qk_norm-bias-eps1e-5": dict(norm_type="layer_norm", use_qk_norm=True, attention_bias=True,
                                            layer_norm_eps=1e-5),
    "rms_norm-qk_norm-bias": dict(norm_type="rms_norm", use_qk_norm=True, attention_bias=True),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_layout_matches_transformers(case):
    hf = make_hf(seed=len(case), **HF_CASES[case])
    px = pixels(3, 32)
    out = hf_tower(hf)(px)
    assert out.shape == (3 * 16, TEXT_HIDDEN)
    close(out, reference(hf, px))


@pytest.mark.parametrize("layer, used", [(-2, 2), (1, 1), (0, 0), (-4, 0)])
def test_feature_layer_selects_hidden_state(layer, used):
    """hidden_states[0] is the embedding output, hidden_states[i] the output of layer i."""
    hf = make_hf(seed=3, vision_feature_layer=layer, norm_type="rms_norm", use_qk_norm=True)
    tower = hf_tower(hf)
    assert tower.cfg.layers_used == used and len(tower.layers) == 3
    px = pixels(2, 32)
    # transformers 5.23 turns vision_feature_layer 0 into output_hidden_states=0, which captures nothing
    # (hidden_states is None); asking for all hidden states gives the tuple it then indexes
    kwargs = {"output_hidden_states": True} if layer == 0 else {}
    close(tower(px), reference(hf, px, **kwargs))


@pytest.mark.parametrize("layer, norm_used", [(-1, True), (3, False), (-2, False)])
def test_final_layernorm_without_mean_pooling(layer, norm_used):
    """use_mean_pooling=False adds a final LayerNorm, applied only on the last_hidden_state path (-1)."""
    hf = make_hf(seed=4, vision_feature_layer=layer, use_mean_pooling=False, attention_bias=True)
    assert "model.vision_tower.layernorm.weight" in vision_weights(hf)
    tower = hf_tower(hf)
    assert tower.cfg.final_norm and tower.cfg.final_norm_used == norm_used
    px = pixels(2, 32)
    close(tower(px), reference(hf, px))


@pytest.mark.parametrize("config_side, tile_side", [(16, 32), (32, 16), (16, 48)])
def test_position_embedding_interpolation(config_side, tile_side):
    hf = make_hf(seed=5, image_size=config_side, attention_bias=True, use_qk_norm=True)
    tower = hf_tower(hf)
    px = pixels(2, tile_side)
    out = tower(px)
    assert out.shape == (2 * tower.tokens_per_tile(tile_side), TEXT_HIDDEN)
    close(out, reference(hf, px))


def test_tiles_are_independent_and_in_order():
    hf = make_hf(seed=6, norm_type="rms_norm", use_qk_norm=True)
    tower = hf_tower(hf)
    px = pixels(4, 32)
    out = tower(px)
    per_tile = torch.cat([tower(px[i:i + 1]) for i in range(4)])
    close(out, per_tile)


def test_cpu_weight_layout_keeps_results():
    hf = make_hf(seed=7, attention_bias=True, use_qk_norm=True)
    tower = hf_tower(hf)
    use_cpu_weight_layout(tower)
    assert not tower.layers[0].qkv.weight.is_contiguous()
    px = pixels(2, 32)
    close(tower(px), reference(hf, px))


# ----------------------------------------------------------------------------------------------
# original (internvl_chat) layout

_RENAMES = (
    (r"^model\.vision_tower\.", "vision_model."),
    (r"embeddings\.cls_token$", "embeddings.class_embedding"),
    (r"embeddings\.patch_embeddings\.projection\.", "embeddings.patch_embedding."),
    (r"embeddings\.position_embeddings$", "embeddings.position_embedding"),
    (r"\.encoder\.layer\.", ".encoder.layers."),
    (r"\.attention\.projection_layer\.", ".attn.proj."),
    (r"\.attention\.(q|k)_norm\.", r".attn.\1_norm."),
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
    (r"\.lambda_1$", ".ls1"),
    (r"\.lambda_2$", ".ls2"),
    (r"^model\.multi_modal_projector\.layer_norm\.", "mlp1.0."),
    (r"^model\.multi_modal_projector\.linear_1\.", "mlp1.1."),
    (r"^model\.multi_modal_projector\.linear_2\.", "mlp1.3."),
)


def _rename(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def to_original(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' names -> InternVLChatModel's, q/k/v packed into attn.qkv like the original."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        m = re.search(r"\.attention\.(q|k|v)_proj\.(weight|bias)$", name)
        if m is None:
            out[_rename(name)] = tensor
        elif m.group(1) == "q":
            parts = [weights[name.replace(".q_proj.", f".{x}_proj.")] for x in "qkv"]
            out[f"{_rename(name[:m.start()])}.attn.qkv.{m.group(2)}"] = torch.cat(parts)
    return out


def original_config(vision: dict, select_layer: int = -1, **top) -> PretrainedConfig:
    """What read_checkpoint makes of a published internvl_chat config.json (a generic config)."""
    raw = {
        "architectures": ["InternVLChatModel"], "model_type": "internvl_chat",
        "vision_config": {"architectures": ["InternVisionModel"], "model_type": "intern_vit_6b", "num_channels": 3,
                          "hidden_act": "gelu", "drop_path_rate": 0.0, "use_flash_attn": False, **vision},
        "llm_config": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": TEXT_HIDDEN},
        "select_layer": select_layer, "downsample_ratio": 0.5, "ps_version": "v2", "force_image_size": 32,
        "template": "internvl2_5", **top,
    }
    return PretrainedConfig.from_dict(raw)


ORIGINAL_CASES = {  # (transformers vision kwargs, original vision_config keys, select_layer)
    "300M-style": (dict(norm_type="layer_norm", attention_bias=True),
                   dict(norm_type="layer_norm", qkv_bias=True, qk_normalization=False), -1),
    "6B-style": (dict(norm_type="rms_norm", use_qk_norm=True),
                 dict(norm_type="rms_norm", qkv_bias=False, qk_normalization=True), -1),
    "select-2": (dict(norm_type="rms_norm", use_qk_norm=True, attention_bias=True),
                 dict(norm_type="rms_norm", qkv_bias=True, qk_normalization=True), -2),
}


@pytest.mark.parametrize("case", ORIGINAL_CASES)
def test_original_layout_matches_transformers(case):
    hf_kw, orig_kw, layer = ORIGINAL_CASES[case]
    hf = make_hf(seed=10 + len(case), vision_feature_layer=layer, **hf_kw)
    vision = {**VISION, "layer_norm_eps": 1e-6, **orig_kw}
    cfg = InternVisionConfig.from_hf(original_config(vision, select_layer=layer), TEXT_HIDDEN)
    assert cfg.layout == "original" and cfg.tile_size == 32
    weights = to_original(vision_weights(hf))
    assert "vision_model.encoder.layers.0.attn.qkv.weight" in weights and "mlp1.3.bias" in weights
    tower = tower_for(cfg, weights, "original")
    px = pixels(3, 32)
    close(tower(px), reference(hf, px))
    hf_cfg = InternVisionConfig.from_hf(hf.config, TEXT_HIDDEN)
    assert {f: getattr(cfg, f) for f in ("layers_used", "norm_type", "qkv_bias", "qk_norm", "image_size")} == \
        {f: getattr(hf_cfg, f) for f in ("layers_used", "norm_type", "qkv_bias", "qk_norm", "image_size")}


def test_original_layout_refuses_hf_names():
    hf = make_hf(seed=20, attention_bias=True)
    cfg = InternVisionConfig.from_hf(original_config({**VISION, "qkv_bias": True, "qk_normalization": False,
                                                      "norm_type": "layer_norm"}), TEXT_HIDDEN)
    tower = InternVLVisionTower(cfg)
    with pytest.raises(CheckpointError, match="unexpected tensor model.vision_tower"):
        load_checked(tower, vision_weights(hf).items(), tower.checkpoint_map("original"))


# ----------------------------------------------------------------------------------------------
# config errors and token counts

def test_tokens_per_tile():
    cfg = InternVisionConfig.from_hf(original_config({**VISION, "image_size": 448, "patch_size": 14,
                                                      "norm_type": "layer_norm", "qkv_bias": True,
                                                      "qk_normalization": False}, force_image_size=448), 896)
    tower = InternVLVisionTower(cfg)
    assert tower.tokens_per_tile(448) == 256
    assert tower.tokens_per_tile(224) == 64
    with pytest.raises(ValueError, match="multiple of"):
        tower.tokens_per_tile(440)


def test_ps_version_v1_refused():
    vision = {**VISION, "norm_type": "layer_norm"}
    with pytest.raises(CheckpointError, match=r"ps_version 'v1'.*only ps_version 'v2'"):
        InternVisionConfig.from_hf(original_config(vision, ps_version="v1"), TEXT_HIDDEN)
    cfg = original_config(vision)
    del cfg.ps_version  # InternVLChatConfig's default is v1
    with pytest.raises(CheckpointError, match="ps_version"):
        InternVisionConfig.from_hf(cfg, TEXT_HIDDEN)


def test_select_strategy_and_layer_list_refused():
    hf = make_hf()
    hf.config.vision_feature_select_strategy = "full"
    with pytest.raises(CheckpointError, match=r"vision_feature_select_strategy 'full'"):
        InternVisionConfig.from_hf(hf.config, TEXT_HIDDEN)
    hf.config.vision_feature_select_strategy = "default"
    hf.config.vision_feature_layer = [-1, -2]
    with pytest.raises(CheckpointError, match="vision_feature_layer"):
        InternVisionConfig.from_hf(hf.config, TEXT_HIDDEN)


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "image_size", "patch_size"])
def test_missing_vision_field_named(field):
    vision = {k: v for k, v in {**VISION, "norm_type": "layer_norm"}.items() if k != field}
    with pytest.raises(CheckpointError, match=rf"config\.json vision_config has no '{field}'"):
        InternVisionConfig.from_hf(original_config(vision), TEXT_HIDDEN)


def test_select_layer_out_of_range():
    with pytest.raises(CheckpointError, match="out of range"):
        InternVisionConfig.from_hf(original_config({**VISION, "norm_type": "layer_norm"}, select_layer=4),
                                   TEXT_HIDDEN)


def test_bad_tile_shape_refused():
    hf = make_hf(seed=21)
    tower = hf_tower(hf)
    with pytest.raises(ValueError, match="square"):
        tower(torch.zeros(1, 3, 32, 16))
    with pytest.raises(ValueError, match="multiple of"):
        tower(torch.zeros(1, 3, 36, 36))
