"""The tiny InternVL checkpoint factory: transformers' -hf layout (loaded back by transformers itself),
OpenGVLab's original layout (the same weights renamed and repacked), the bench shape, determinism."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from einops import rearrange
from safetensors import safe_open

from vlm_sdk.model_loader import iter_safetensors, read_checkpoint, text_config
from vlm_sdk.testing import make_bench_checkpoint, make_tiny_checkpoint
from vlm_sdk.models.internvl.tiny_checkpoint import (INTERNVL_CHATML_TEMPLATE, INTERNVL_HF_CHAT_TEMPLATE,
                                                     INTERNVL_SPECIAL_TOKENS, convert_to_original_layout)
from vlm_sdk.models.internvl.model import hf_canonical_name

HEADS, KV_HEADS, HIDDEN, HEAD_DIM = 4, 2, 64, 16
V_HIDDEN, V_LAYERS = 32, 2


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(d, show_progress=False))


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _count(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors.values())


# the session checkpoints of conftest.py, under the names these tests read best with
@pytest.fixture
def hf_qwen(internvl_ckpt) -> Path:
    return internvl_ckpt


@pytest.fixture
def hf_llama(internvl_llama_ckpt) -> Path:
    return internvl_llama_ckpt


@pytest.fixture
def orig_qwen(internvl_original_ckpt) -> Path:
    return internvl_original_ckpt


@pytest.fixture
def orig_internlm2(internvl_internlm2_ckpt) -> Path:
    return internvl_internlm2_ckpt


@pytest.fixture
def hf_dirs(hf_qwen, hf_llama):
    return {"qwen2": hf_qwen, "llama": hf_llama}


# ---------------------------------------------------------------------------------------------
# hf layout


@pytest.mark.parametrize("llm", ["qwen2", "llama"])
def test_transformers_loads_hf_layout_with_the_saved_weights(hf_dirs, llm):
    from transformers import InternVLForConditionalGeneration

    d = hf_dirs[llm]
    model = InternVLForConditionalGeneration.from_pretrained(str(d))
    cfg = model.config
    assert cfg.model_type == "internvl" and cfg.text_config.model_type == llm
    assert cfg.architectures == ["InternVLForConditionalGeneration"]
    assert (cfg.image_seq_length, cfg.downsample_ratio, cfg.vision_feature_layer) == (256, 0.5, -1)
    assert list(cfg.vision_config.image_size) == [448, 448] and list(cfg.vision_config.patch_size) == [14, 14]
    assert cfg.vision_config.attention_bias and not cfg.vision_config.use_qk_norm
    assert cfg.text_config.vocab_size == 1024 and cfg.tie_word_embeddings is False
    if llm == "llama":
        assert cfg.text_config.attention_bias is False and cfg.text_config.rope_parameters["rope_type"] == "dynamic"

    saved = _tensors(d)
    state = model.state_dict()
    assert {hf_canonical_name(k) for k in saved} == set(state)
    for name, t in saved.items():
        assert torch.equal(state[hf_canonical_name(name)], t), name

    # the redraw: 1-D non-bias parameters are 1 + 0.1 N(0, 1), not transformers' 1 / 0.1 init
    for name in ("model.vision_tower.encoder.layer.0.lambda_1", "model.language_model.norm.weight",
                 "model.vision_tower.encoder.layer.1.layernorm_after.weight"):
        p = state[name]
        assert 0.8 < p.mean() < 1.2 and p.std() > 0.05, name
    assert abs(state["model.language_model.embed_tokens.weight"].std() - 0.2) < 0.01


def test_hf_layout_runs_in_transformers_with_an_image(hf_qwen):
    from PIL import Image
    from transformers import AutoTokenizer, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(hf_qwen))
    proc = GotOcr2ImageProcessorPil.from_pretrained(str(hf_qwen))
    model = InternVLForConditionalGeneration.from_pretrained(str(hf_qwen)).eval()
    image = Image.new("RGB", (448, 448), (200, 30, 90))
    pixels = proc(images=[image], return_tensors="pt")["pixel_values"]
    assert pixels.shape == (1, 3, 448, 448)
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                     tokenize=False, add_generation_prompt=True)
    prompt = prompt.replace("<IMG_CONTEXT>", "<img>" + "<IMG_CONTEXT>" * 256 + "</img>")  # InternVLProcessor's expansion
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    assert int((ids == model.config.image_token_id).sum()) == 256
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels).logits
    assert logits.shape == (1, ids.shape[1], 1024) and torch.isfinite(logits).all()


def test_hf_tokenizer_and_chat_template(hf_qwen):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_qwen))
    config = json.loads((hf_qwen / "config.json").read_text())
    assert tok.convert_tokens_to_ids("<IMG_CONTEXT>") == config["image_token_id"] == 1010
    for t in INTERNVL_SPECIAL_TOKENS + ("<video>",):
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    assert tok.encode("<img><IMG_CONTEXT></img>", add_special_tokens=False) == [1008, 1010, 1009]
    # the named tokens transformers' InternVLProcessor reads
    assert (tok.start_image_token, tok.end_image_token, tok.context_image_token, tok.video_token) == (
        "<img>", "</img>", "<IMG_CONTEXT>", "<video>")
    assert (tok.start_image_token_id, tok.end_image_token_id, tok.context_image_token_id) == (1008, 1009, 1010)
    assert tok.video_token_id == 1017 and len(tok) == 1018  # in tokenizer.json: transformers adds nothing
    assert len(json.loads((hf_qwen / "tokenizer.json").read_text())["added_tokens"]) == 18
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"

    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare."}, {"type": "image"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<IMG_CONTEXT>\nCompare.<IMG_CONTEXT>\n<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_template == INTERNVL_HF_CHAT_TEMPLATE
    assert (hf_qwen / "chat_template.jinja").read_text() == INTERNVL_HF_CHAT_TEMPLATE
    gen = json.loads((hf_qwen / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]


def test_image_processors_read_both_layouts(hf_qwen, orig_qwen):
    from PIL import Image
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from vlm_sdk.models.internvl.image_processor import InternVLImageProcessor

    ref = GotOcr2ImageProcessorPil.from_pretrained(str(hf_qwen))
    assert (ref.crop_to_patches, ref.min_patches, ref.max_patches) == (True, 1, 6)
    assert (ref.size.height, ref.size.width) == (448, 448)
    image = Image.new("RGB", (700, 300), (10, 120, 240))
    expected = ref(images=[image], return_tensors="pt")["pixel_values"]
    assert expected.shape == (3, 3, 448, 448)  # 2 tiles + thumbnail

    pre_orig = json.loads((orig_qwen / "preprocessor_config.json").read_text())
    assert pre_orig == {"crop_size": 448, "do_center_crop": True, "do_normalize": True, "do_resize": True,
                        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.485, 0.456, 0.406],
                        "image_std": [0.229, 0.224, 0.225], "resample": 3, "size": 448}
    for d in (hf_qwen, orig_qwen):
        info = read_checkpoint(d)
        ours = InternVLImageProcessor.from_preprocessor_config(info.preprocessor, info.hf_config)
        assert (ours.image_size, ours.min_num, ours.max_num, ours.use_thumbnail) == (448, 1, 6, True), d
        assert torch.equal(ours(image), expected), d
    # the original layout's max_num is in config.json only
    info = read_checkpoint(orig_qwen)
    assert InternVLImageProcessor.from_preprocessor_config(info.preprocessor).max_num == 12


def test_same_arguments_give_identical_files(tmp_path, hf_qwen, orig_internlm2):
    a = make_tiny_checkpoint(tmp_path / "a", family="internvl")
    assert _hashes(a) == _hashes(hf_qwen)
    b = make_tiny_checkpoint(tmp_path / "b", family="internvl", llm="llama", layout="original")
    assert _hashes(b) == _hashes(orig_internlm2)
    c = make_tiny_checkpoint(tmp_path / "c", family="internvl", seed=1)
    assert _hashes(c)["model.safetensors"] != _hashes(hf_qwen)["model.safetensors"]
    assert _hashes(c)["tokenizer.json"] == _hashes(hf_qwen)["tokenizer.json"]


def test_overrides_are_checked(tmp_path):
    with pytest.raises(TypeError, match="window_size"):
        make_tiny_checkpoint(tmp_path / "x", family="internvl", window_size=112)
    with pytest.raises(TypeError, match="layout"):  # the Qwen family keeps refusing InternVL's arguments
        make_tiny_checkpoint(tmp_path / "y", layout="original")
    with pytest.raises(ValueError, match="llm_layout"):
        make_tiny_checkpoint(tmp_path / "z", family="internvl", layout="original", llm_layout="internlm2")
    with pytest.raises(ValueError, match="llm="):
        make_tiny_checkpoint(tmp_path / "w", family="internvl", llm="mistral")
    assert not any(tmp_path.iterdir())


def test_tied_embeddings_store_no_lm_head(tmp_path):
    from transformers import InternVLForConditionalGeneration

    d = make_tiny_checkpoint(tmp_path / "tied", family="internvl", tie_word_embeddings=True)
    names = set(_tensors(d))
    assert not any("lm_head" in n for n in names)
    model = InternVLForConditionalGeneration.from_pretrained(str(d))
    assert torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)
    o = make_tiny_checkpoint(tmp_path / "tied_orig", family="internvl", tie_word_embeddings=True, layout="original")
    onames = set(_tensors(o))
    assert "language_model.lm_head.weight" not in onames and len(onames) == len(names) - 8  # 2 layers x 4 (qkv)
    assert json.loads((o / "config.json").read_text())["llm_config"]["tie_word_embeddings"] is True


# ---------------------------------------------------------------------------------------------
# original layout


def test_original_layout_names_and_values(hf_qwen, orig_qwen):
    hf = {hf_canonical_name(k): v for k, v in _tensors(hf_qwen).items()}
    og = _tensors(orig_qwen)
    assert _count(hf) == _count(og)
    assert len(og) == len(hf) - 2 * 2 * V_LAYERS  # q/k/v weight + bias -> one qkv weight + bias per layer
    same = {
        "vision_model.embeddings.class_embedding": "model.vision_tower.embeddings.cls_token",
        "vision_model.embeddings.patch_embedding.weight": "model.vision_tower.embeddings.patch_embeddings.projection.weight",
        "vision_model.embeddings.patch_embedding.bias": "model.vision_tower.embeddings.patch_embeddings.projection.bias",
        "vision_model.embeddings.position_embedding": "model.vision_tower.embeddings.position_embeddings",
        "vision_model.encoder.layers.1.attn.proj.weight": "model.vision_tower.encoder.layer.1.attention.projection_layer.weight",
        "vision_model.encoder.layers.0.norm1.weight": "model.vision_tower.encoder.layer.0.layernorm_before.weight",
        "vision_model.encoder.layers.0.norm2.bias": "model.vision_tower.encoder.layer.0.layernorm_after.bias",
        "vision_model.encoder.layers.1.mlp.fc2.weight": "model.vision_tower.encoder.layer.1.mlp.fc2.weight",
        "vision_model.encoder.layers.0.ls1": "model.vision_tower.encoder.layer.0.lambda_1",
        "vision_model.encoder.layers.1.ls2": "model.vision_tower.encoder.layer.1.lambda_2",
        "mlp1.0.weight": "model.multi_modal_projector.layer_norm.weight",
        "mlp1.1.weight": "model.multi_modal_projector.linear_1.weight",
        "mlp1.3.bias": "model.multi_modal_projector.linear_2.bias",
        "language_model.model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
        "language_model.model.layers.1.self_attn.k_proj.bias": "model.language_model.layers.1.self_attn.k_proj.bias",
        "language_model.model.layers.0.mlp.down_proj.weight": "model.language_model.layers.0.mlp.down_proj.weight",
        "language_model.model.norm.weight": "model.language_model.norm.weight",
        "language_model.lm_head.weight": "lm_head.weight",
    }
    for o, h in same.items():
        assert torch.equal(og[o], hf[h]), o
    for i in range(V_LAYERS):
        for kind in ("weight", "bias"):
            parts = [hf[f"model.vision_tower.encoder.layer.{i}.attention.{p}_proj.{kind}"] for p in "qkv"]
            assert torch.equal(og[f"vision_model.encoder.layers.{i}.attn.qkv.{kind}"], torch.cat(parts)), (i, kind)
    assert og["vision_model.encoder.layers.0.attn.qkv.weight"].shape == (3 * V_HIDDEN, V_HIDDEN)
    assert not any(k.startswith(("model.", "vision_tower", "multi_modal_projector", "lm_head")) for k in og)
    assert not list(orig_qwen.glob("*.py"))  # auto_map names modules that are not there: nothing to import


def _internlm2_split(wqkv: torch.Tensor):
    """InternLM2Attention.forward's split, applied to the weight rows (modeling_internlm2.py)."""
    groups = HEADS // KV_HEADS
    qkv = rearrange(wqkv, "(h gs d) z -> h gs d z", gs=2 + groups, d=HEAD_DIM)
    q = rearrange(qkv[:, :groups], "h gs d z -> (h gs d) z")
    return q, qkv[:, -2].reshape(-1, wqkv.shape[1]), qkv[:, -1].reshape(-1, wqkv.shape[1])


def test_original_internlm2_layout(hf_llama, orig_internlm2):
    hf = {hf_canonical_name(k): v for k, v in _tensors(hf_llama).items()}
    og = _tensors(orig_internlm2)
    assert _count(hf) == _count(og) and len(og) == len(hf) - 4 * V_LAYERS - 2 * 2
    p, q = "language_model.model.layers.{}.", "model.language_model.layers.{}."
    renames = {
        "language_model.model.tok_embeddings.weight": "model.language_model.embed_tokens.weight",
        "language_model.model.norm.weight": "model.language_model.norm.weight",
        "language_model.output.weight": "lm_head.weight",
    }
    for i in range(2):
        renames.update({
            p.format(i) + "attention.wo.weight": q.format(i) + "self_attn.o_proj.weight",
            p.format(i) + "feed_forward.w1.weight": q.format(i) + "mlp.gate_proj.weight",
            p.format(i) + "feed_forward.w3.weight": q.format(i) + "mlp.up_proj.weight",
            p.format(i) + "feed_forward.w2.weight": q.format(i) + "mlp.down_proj.weight",
            p.format(i) + "attention_norm.weight": q.format(i) + "input_layernorm.weight",
            p.format(i) + "ffn_norm.weight": q.format(i) + "post_attention_layernorm.weight",
        })
    for o, h in renames.items():
        assert torch.equal(og[o], hf[h]), o
    for i in range(2):
        wqkv = og[p.format(i) + "attention.wqkv.weight"]
        assert wqkv.shape == ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        for got, proj in zip(_internlm2_split(wqkv), ("q", "k", "v")):
            assert torch.equal(got, hf[q.format(i) + f"self_attn.{proj}_proj.weight"]), (i, proj)
        # and as InternLM2 runs it: project, then split the activations
        x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(i))
        states = rearrange(x @ wqkv.T, "b (h gs d) -> b h gs d", gs=2 + HEADS // KV_HEADS, d=HEAD_DIM)
        query = rearrange(states[:, :, :HEADS // KV_HEADS], "b h gs d -> b (h gs d)")
        assert torch.allclose(query, x @ hf[q.format(i) + "self_attn.q_proj.weight"].T, atol=1e-5)
        assert torch.allclose(states[:, :, -2].flatten(1), x @ hf[q.format(i) + "self_attn.k_proj.weight"].T, atol=1e-5)
        assert not any(k.endswith("wqkv.bias") or "wo.bias" in k for k in og)  # InternLM2 "bias": false

    cfg = json.loads((orig_internlm2 / "config.json").read_text())
    llm = cfg["llm_config"]
    assert llm["architectures"] == ["InternLM2ForCausalLM"] and llm["model_type"] == "internlm2"
    assert llm["bias"] is False and llm["rope_theta"] == 1e6 and "rope_parameters" not in llm
    assert llm["rope_scaling"] == {"type": "dynamic", "factor": 2.0}
    assert (llm["num_attention_heads"], llm["num_key_value_heads"], llm["rms_norm_eps"]) == (HEADS, KV_HEADS, 1e-5)
    assert llm["auto_map"]["AutoModelForCausalLM"] == "modeling_internlm2.InternLM2ForCausalLM"
    tc = text_config(read_checkpoint(orig_internlm2).hf_config)
    assert (tc.model_type, tc.hidden_size, tc.num_key_value_heads, tc.bias) == ("internlm2", HIDDEN, KV_HEADS, False)


def test_original_llama_llm_layout_keeps_llama_names(tmp_path, hf_llama):
    d = convert_to_original_layout(hf_llama, tmp_path / "llama", llm_layout="llama")
    og = _tensors(d)
    hf = {hf_canonical_name(k): v for k, v in _tensors(hf_llama).items()}
    assert torch.equal(og["language_model.model.layers.0.self_attn.q_proj.weight"],
                       hf["model.language_model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(og["language_model.lm_head.weight"], hf["lm_head.weight"])
    llm = json.loads((d / "config.json").read_text())["llm_config"]
    assert llm["architectures"] == ["LlamaForCausalLM"] and llm["model_type"] == "llama"
    assert llm["attention_bias"] is False and llm["head_dim"] == HEAD_DIM


def test_original_config_json(orig_qwen):
    cfg = json.loads((orig_qwen / "config.json").read_text())
    assert cfg["architectures"] == ["InternVLChatModel"] and cfg["model_type"] == "internvl_chat"
    assert cfg["auto_map"]["AutoConfig"] == "configuration_internvl_chat.InternVLChatConfig"
    for key, value in {"downsample_ratio": 0.5, "dynamic_image_size": True, "force_image_size": 448,
                       "max_dynamic_patch": 6, "min_dynamic_patch": 1, "ps_version": "v2", "select_layer": -1,
                       "template": "internvl2_5", "use_thumbnail": True, "torch_dtype": "float32"}.items():
        assert cfg[key] == value, key
    v = cfg["vision_config"]
    assert (v["architectures"], v["model_type"]) == (["InternVisionModel"], "intern_vit_6b")
    assert (v["hidden_size"], v["num_attention_heads"], v["intermediate_size"], v["num_hidden_layers"]) == (32, 4, 64, 2)
    assert (v["image_size"], v["patch_size"], v["qkv_bias"], v["qk_normalization"], v["norm_type"]) == (
        448, 14, True, False, "layer_norm")
    assert v["use_flash_attn"] is False and v["hidden_act"] == "gelu"
    llm = cfg["llm_config"]
    assert (llm["architectures"], llm["model_type"]) == (["Qwen2ForCausalLM"], "qwen2")
    assert llm["rope_theta"] == 1e6 and llm["rope_scaling"] is None and "rope_parameters" not in llm

    info = read_checkpoint(orig_qwen)
    assert info.architecture == "InternVLChatModel" and info.torch_dtype == "float32"
    assert info.eos_token_ids == (1002, 1000)
    tc = info.text_config
    assert (tc.model_type, tc.hidden_size, tc.intermediate_size, tc.num_hidden_layers) == ("qwen2", 64, 128, 2)
    assert (tc.num_attention_heads, tc.num_key_value_heads, tc.vocab_size, tc.rms_norm_eps) == (4, 2, 1024, 1e-6)
    assert tc.rope_theta == 1e6 and tc.tie_word_embeddings is False
    assert info.hf_config.max_dynamic_patch == 6 and info.hf_config.vision_config["image_size"] == 448


def test_original_tokenizer(orig_qwen, hf_qwen):
    from transformers import AutoTokenizer

    # trust_remote_code=False: config.json's auto_map would otherwise make transformers ask on stdin
    tok = AutoTokenizer.from_pretrained(str(orig_qwen), trust_remote_code=False)
    assert len(tok) == 1017 and tok.convert_tokens_to_ids("<IMG_CONTEXT>") == 1010  # no "<video>"
    assert tok.encode("<img><IMG_CONTEXT></img>", add_special_tokens=False) == [1008, 1010, 1009]
    text = tok.apply_chat_template([{"role": "user", "content": "<image>\nWhat is it?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\n<image>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_template == INTERNVL_CHATML_TEMPLATE
    tok_cfg = json.loads((orig_qwen / "tokenizer_config.json").read_text())
    assert not {"context_image_token", "start_image_token", "end_image_token", "video_token"} & set(tok_cfg)
    assert (orig_qwen / "generation_config.json").read_bytes() == (hf_qwen / "generation_config.json").read_bytes()


def test_sharded_original_layout(tmp_path, orig_qwen):
    d = make_tiny_checkpoint(tmp_path / "sharded", family="internvl", layout="original", max_shard_size="200KB")
    assert len(list(d.glob("model-*-of-*.safetensors"))) > 1 and (d / "model.safetensors.index.json").is_file()
    got, want = _tensors(d), _tensors(orig_qwen)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert read_checkpoint(d).architecture == "InternVLChatModel"


# ---------------------------------------------------------------------------------------------
# bench shape


def test_bench_checkpoint_shape(tmp_path):
    d = make_bench_checkpoint(tmp_path / "bench", family="internvl")
    total, dtypes = 0, set()
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                total += math.prod(sl.get_shape())
                dtypes.add(sl.get_dtype())
    assert total == 105_765_120 and 90e6 <= total <= 120e6
    assert dtypes == {"BF16"}
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    assert cfg["text_config"]["vocab_size"] == 151936 and cfg["vision_config"]["hidden_size"] == 256
    assert json.loads((d / "preprocessor_config.json").read_text())["max_patches"] == 6


def test_internvit_6b_options_convert(tmp_path):
    """RMSNorm, q/k norm and no qkv bias (InternViT-6B): names in both layouts, transformers loads the hf one."""
    from transformers import InternVLForConditionalGeneration

    opts = dict(family="internvl", norm_type="rms_norm", use_qk_norm=True, qkv_bias=False)
    hf = make_tiny_checkpoint(tmp_path / "hf", **opts)
    og = _tensors(make_tiny_checkpoint(tmp_path / "orig", layout="original", **opts))
    layer0 = sorted(k.removeprefix("vision_model.encoder.layers.0.") for k in og
                    if k.startswith("vision_model.encoder.layers.0."))
    assert layer0 == ["attn.k_norm.weight", "attn.proj.bias", "attn.proj.weight", "attn.q_norm.weight",
                      "attn.qkv.weight", "ls1", "ls2", "mlp.fc1.bias", "mlp.fc1.weight", "mlp.fc2.bias",
                      "mlp.fc2.weight", "norm1.weight", "norm2.weight"]
    model = InternVLForConditionalGeneration.from_pretrained(str(hf))
    assert torch.equal(model.state_dict()["model.vision_tower.encoder.layer.0.attention.q_norm.weight"],
                       og["vision_model.encoder.layers.0.attn.q_norm.weight"])
    v = json.loads((tmp_path / "orig" / "config.json").read_text())["vision_config"]
    assert (v["norm_type"], v["qk_normalization"], v["qkv_bias"]) == ("rms_norm", True, False)
