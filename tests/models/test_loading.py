"""Checkpoint reading: both config layouts, sharded safetensors, strict weight loading, tokenizer,
error messages, and the tiny-checkpoint factory itself (determinism, overrides)."""
from __future__ import annotations

import json
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from vlm_sdk.errors import CheckpointError
from vlm_sdk.model_loader import _safetensors_files, iter_safetensors, load_tokenizer, read_checkpoint, text_config
from vlm_sdk.weight_loading import ParamSlot, load_checked
from vlm_sdk.testing import make_tiny_checkpoint

TEXT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings", "hidden_act")
VISION_FIELDS = ("depth", "hidden_size", "num_heads", "intermediate_size", "fullatt_block_indexes",
                 "window_size", "patch_size", "spatial_merge_size", "temporal_patch_size", "out_hidden_size",
                 "tokens_per_second")
TOP_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
              "tie_word_embeddings")


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*skip))
    return dst


def _text_messages():
    return [{"role": "user", "content": "Tell me a short story about a red boat on a lake."}]


# ---------------------------------------------------------------------------------------------
# config layouts

def test_layouts_are_really_different_on_disk(tiny_ckpt, tiny_ckpt_flat):
    nested = json.loads((tiny_ckpt / "config.json").read_text())
    flat = json.loads((tiny_ckpt_flat / "config.json").read_text())
    assert "text_config" in nested and "rope_parameters" in nested["text_config"]
    assert "text_config" not in flat and flat["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    assert flat["rope_theta"] == 1e6 and flat["hidden_size"] == 64 and "vision_config" in flat
    pre_nested = json.loads((tiny_ckpt / "preprocessor_config.json").read_text())
    pre_flat = json.loads((tiny_ckpt_flat / "preprocessor_config.json").read_text())
    assert pre_nested["size"] == {"longest_edge": 28 * 28 * 256, "shortest_edge": 56 * 56}
    assert (pre_flat["min_pixels"], pre_flat["max_pixels"]) == (56 * 56, 28 * 28 * 256)


def test_both_layouts_parse_to_the_same_settings(tiny_ckpt, tiny_ckpt_flat):
    a, b = read_checkpoint(tiny_ckpt), read_checkpoint(tiny_ckpt_flat)
    assert a.architecture == b.architecture == "Qwen2_5_VLForConditionalGeneration"
    ta, tb = text_config(a.hf_config), text_config(b.hf_config)
    assert ta is a.hf_config.text_config and tb is b.hf_config.text_config
    for field in TEXT_FIELDS:
        assert getattr(ta, field) == getattr(tb, field), field
    for key in ("mrope_section", "rope_theta", "rope_type"):
        assert ta.rope_parameters[key] == tb.rope_parameters[key], key
    assert ta.rope_parameters["mrope_section"] == [2, 3, 3] and ta.rope_parameters["rope_theta"] == 1e6
    va, vb = a.hf_config.vision_config, b.hf_config.vision_config
    for field in VISION_FIELDS:
        assert getattr(va, field) == getattr(vb, field), field
    assert list(va.fullatt_block_indexes) == [1]
    for field in TOP_FIELDS:
        assert getattr(a.hf_config, field) == getattr(b.hf_config, field), field
    assert (ta.hidden_size, ta.num_attention_heads, ta.num_key_value_heads, va.out_hidden_size) == (64, 4, 2, 64)
    assert a.torch_dtype == b.torch_dtype == "float32"
    assert a.eos_token_ids == b.eos_token_ids


def test_image_processor_reads_both_preprocessor_layouts(tiny_ckpt, tiny_ckpt_flat):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    sizes = []
    for d in (tiny_ckpt, tiny_ckpt_flat):
        proc = Qwen2VLImageProcessorPil.from_pretrained(str(d))
        sizes.append((proc.size["shortest_edge"], proc.size["longest_edge"], proc.patch_size, proc.merge_size))
    assert sizes[0] == sizes[1] == (3136, 200704, 14, 2)


def test_transformers_gives_identical_logits_for_both_layouts(tiny_ckpt, tiny_ckpt_flat):
    from transformers import Qwen2_5_VLForConditionalGeneration

    tok = load_tokenizer(tiny_ckpt)
    text = tok.apply_chat_template(_text_messages(), tokenize=False, add_generation_prompt=True)
    inputs = tok(text, return_tensors="pt")
    logits = []
    for d in (tiny_ckpt, tiny_ckpt_flat):
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(**inputs).logits)
    assert logits[0].shape == (1, inputs["input_ids"].shape[1], 1024)
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1])


def test_random_weights_give_varied_greedy_tokens(tiny_ckpt):
    from transformers import Qwen2_5_VLForConditionalGeneration

    tok = load_tokenizer(tiny_ckpt)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    text = tok.apply_chat_template(_text_messages(), tokenize=False, add_generation_prompt=True)
    inputs = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(new) == 24 and len(set(new)) >= 12, new
    assert Counter(new).most_common(1)[0][1] <= 4, new


# ---------------------------------------------------------------------------------------------
# safetensors

def test_sharded_checkpoint_yields_every_tensor_once(tiny_ckpt, tiny_ckpt_flat):
    index = json.loads((tiny_ckpt_flat / "model.safetensors.index.json").read_text())
    shards = sorted(tiny_ckpt_flat.glob("*.safetensors"))
    assert len(shards) >= 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    names = Counter(name for name, _ in iter_safetensors(tiny_ckpt_flat, show_progress=False))
    assert set(names) == set(index["weight_map"]) and set(names.values()) == {1}
    for expected in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
                     "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
                     "visual.patch_embed.proj.weight", "visual.blocks.0.attn.qkv.weight",
                     "visual.blocks.1.mlp.gate_proj.bias", "visual.merger.mlp.0.weight"):
        assert expected in names, expected
    assert not any(n.startswith(("model.language_model.", "model.visual.")) for n in names)
    # same seed -> the single-file checkpoint holds the same tensors
    single = dict(iter_safetensors(tiny_ckpt, show_progress=False))
    sharded = dict(iter_safetensors(tiny_ckpt_flat, show_progress=False))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_shards_are_read_in_file_name_order_whatever_order_the_index_lists(tmp_path):
    for name in ("b.safetensors", "a.safetensors", "c.safetensors"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "c.safetensors", "y": "a.safetensors", "z": "b.safetensors", "w": "c.safetensors"}}))
    assert [p.name for p in _safetensors_files(tmp_path)] == ["a.safetensors", "b.safetensors", "c.safetensors"]


def test_index_naming_a_missing_shard_is_an_error(tiny_ckpt_flat, tmp_path):
    d = _copy(tiny_ckpt_flat, tmp_path / "ck", skip=("model-00002-of-*",))
    with pytest.raises(CheckpointError, match="model-00002-of-"):
        list(iter_safetensors(d, show_progress=False))


def _hf5_to_published(name: str) -> str:
    """transformers 5 module names -> published Qwen2.5-VL weight names."""
    if name.startswith("model.visual."):
        return name[len("model."):]
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "tiny_ckpt_flat"])
def test_load_checked_fills_a_transformers_model_like_from_pretrained(ckpt, request):
    from transformers import Qwen2_5_VLForConditionalGeneration

    d = request.getfixturevalue(ckpt)
    info = read_checkpoint(d)
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(d), dtype=torch.float32).eval()
    torch.manual_seed(123)
    ours = Qwen2_5_VLForConditionalGeneration(info.hf_config).eval()
    slots = {_hf5_to_published(n): ParamSlot(n, tuple(t.shape)) for n, t in ours.state_dict().items()}
    load_checked(ours, iter_safetensors(d, show_progress=False), slots, source=d)
    ids = torch.tensor([[1001, 343, 271, 198, 40, 41, 42, 1002]])
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, reference(input_ids=ids).logits)


# ---------------------------------------------------------------------------------------------
# load_checked on a small module

class Small(nn.Module):
    def __init__(self, tie: bool = False):
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.proj = nn.Linear(3, 2)
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 5, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.zeros(2))                          # persistent
        self.register_buffer("cache", torch.zeros(2), persistent=False)       # never loaded


def _weights(**changes) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {"embed.weight": torch.randn(5, 3, generator=g), "proj.weight": torch.randn(2, 3, generator=g),
         "proj.bias": torch.randn(2, generator=g), "norm.weight": torch.randn(3, generator=g),
         "norm.bias": torch.randn(3, generator=g), "head.weight": torch.randn(5, 3, generator=g),
         "scale": torch.randn(2, generator=g)}
    for k, v in changes.items():
        k = k.replace("__", ".")
        if v is None:
            w.pop(k)
        else:
            w[k] = v
    return w


def _slots(module: nn.Module, *, skip: tuple[str, ...] = ()) -> dict[str, ParamSlot]:
    """One whole-tensor slot per state_dict entry, under its own name (tied aliases included)."""
    return {n: ParamSlot(n, tuple(t.shape)) for n, t in module.state_dict().items() if n not in skip}


def test_load_checked_copies_everything_with_dtype_conversion():
    m = Small()
    w = _weights(proj__weight=torch.randn(2, 3).to(torch.bfloat16))
    load_checked(m, w.items(), _slots(m))
    for k, v in w.items():
        got = m.state_dict()[k]
        assert got.dtype == torch.float32 and torch.equal(got, v.float()), k


def test_missing_tensor_is_named():
    m = Small()
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) of Small missing from the checkpoint in ckpt-x: "
                                              r"norm\.bias \[3\]"):
        load_checked(m, _weights(norm__bias=None).items(), _slots(m), source="ckpt-x")


def test_buffer_without_a_slot_is_left_alone():
    # what `ignore_missing` did for a target the checkpoint lacks: a persistent buffer gets no slot
    m = Small()
    load_checked(m, _weights(scale=None).items(), _slots(m, skip=("scale",)))
    assert torch.equal(m.scale, torch.zeros(2))


def test_missing_list_is_truncated():
    class Many(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(8))

    m = Many()
    with pytest.raises(CheckpointError) as exc:
        load_checked(m, [], _slots(m))
    msg = str(exc.value)
    assert "16 tensor(s)" in msg and "(and 6 more)" in msg and "layers.0.weight [2, 2]" in msg


def test_unexpected_tensor_is_named_with_its_shape():
    m = Small()
    w = _weights()
    w["extra.weight"] = torch.zeros(4, 7)
    with pytest.raises(CheckpointError, match=r"unexpected tensor extra\.weight \(shape \[4, 7\]\) in ckpt-x"):
        load_checked(m, w.items(), _slots(m), source="ckpt-x")


def test_canonicalised_unexpected_tensor_names_both_names():
    m = Small()
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.proj\.weight.*'proj\.weights'"):
        load_checked(m, [("model.proj.weight", torch.zeros(2, 3))], _slots(m),
                     canonical=lambda n: n.removeprefix("model.") + "s")


def test_canonical_aliases_load_and_two_spellings_of_one_tensor_are_an_error():
    m = Small()
    w = {"model." + k: v for k, v in _weights().items()}
    strip = lambda n: n.removeprefix("model.")  # noqa: E731
    load_checked(m, w.items(), _slots(m), canonical=strip)
    assert torch.equal(m.proj.weight, w["model.proj.weight"])
    both = [*w.items(), ("proj.weight", torch.zeros(2, 3))]
    with pytest.raises(CheckpointError, match=r"tensors model\.proj\.weight and proj\.weight both load into"):
        load_checked(Small(), both, _slots(m), canonical=strip)


def test_misshaped_tensor_names_both_shapes():
    m = Small()
    with pytest.raises(CheckpointError) as exc:
        load_checked(m, _weights(proj__weight=torch.zeros(3, 3)).items(), _slots(m), source="ckpt-x")
    msg = str(exc.value)
    assert "proj.weight in ckpt-x" in msg and "[3, 3]" in msg and "[2, 3]" in msg


def test_same_tensor_twice_is_an_error():
    m = Small()
    w = [*_weights().items(), ("norm.bias", torch.zeros(3))]
    with pytest.raises(CheckpointError, match=r"tensor norm\.bias appears twice"):
        load_checked(m, w, _slots(m))


def test_ignore_skips_and_tied_weights_load_through_one_alias():
    m = Small(tie=True)
    w = _weights()
    load_checked(m, w.items(), _slots(m), ignore=frozenset({"head.weight"}))
    assert torch.equal(m.head.weight, w["embed.weight"])
    # the alias need not have a slot at all
    m = Small(tie=True)
    load_checked(m, w.items(), _slots(m, skip=("head.weight",)), ignore=frozenset({"head.weight"}))
    assert torch.equal(m.head.weight, w["embed.weight"])


def test_two_tensors_into_one_target_is_an_error():
    m = Small(tie=True)
    with pytest.raises(CheckpointError, match=r"embed\.weight and head\.weight.*both load into"):
        load_checked(m, _weights().items(), _slots(m))


class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 8)          # rows: q [0, 4) | k [4, 6) | v [6, 8)
        self.patch = nn.Linear(2 * 3 * 3, 4, bias=False)  # a Conv2d(2, 4, 3) weight, flattened


_QKV = {"q": (0, 4), "k": (4, 2), "v": (6, 2)}


def _fused_slots() -> dict[str, ParamSlot]:
    slots = {}
    for name, (start, rows) in _QKV.items():
        slots[f"attn.{name}_proj.weight"] = ParamSlot("qkv.weight", (rows, 4), start)
        slots[f"attn.{name}_proj.bias"] = ParamSlot("qkv.bias", (rows,), start)
    slots["patch_embed.weight"] = ParamSlot("patch.weight", (4, 2, 3, 3))
    return slots


def _fused_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    w = {}
    for name, (_, rows) in _QKV.items():
        w[f"attn.{name}_proj.weight"] = torch.randn(rows, 4, generator=g)
        w[f"attn.{name}_proj.bias"] = torch.randn(rows, generator=g)
    w["patch_embed.weight"] = torch.randn(4, 2, 3, 3, generator=g)
    return w


def test_row_shards_fill_a_fused_parameter_and_reshape():
    m = Fused()
    w = _fused_weights()
    load_checked(m, reversed(list(w.items())), _fused_slots())   # order does not matter
    qkv = [f"attn.{n}_proj" for n in "qkv"]
    assert torch.equal(m.qkv.weight, torch.cat([w[f"{p}.weight"] for p in qkv]))
    assert torch.equal(m.qkv.bias, torch.cat([w[f"{p}.bias"] for p in qkv]))
    assert torch.equal(m.patch.weight, w["patch_embed.weight"].reshape(4, 18))


def test_missing_and_misshaped_row_shards_are_named():
    w = _fused_weights()
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) of Fused missing.*attn\.k_proj\.weight \[2, 4\]"):
        load_checked(Fused(), [kv for kv in w.items() if kv[0] != "attn.k_proj.weight"], _fused_slots())
    w["attn.v_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(CheckpointError, match=r"attn\.v_proj\.weight has shape \[4, 4\] but Fused expects "
                                              r"\[2, 4\].*qkv\.weight rows \[6, 8\)"):
        load_checked(Fused(), w.items(), _fused_slots())


def test_slot_map_bugs_are_caught_before_loading():
    slots = _fused_slots()
    gap = {k: v for k, v in slots.items() if k != "attn.v_proj.bias"}
    with pytest.raises(ValueError, match=r"leave 1 parameter\(s\) of Fused unloaded: qkv\.bias rows \[6, 8\)"):
        load_checked(Fused(), [], gap)
    with pytest.raises(ValueError, match=r"overlap"):
        load_checked(Fused(), [], dict(slots, extra=ParamSlot("qkv.weight", (2, 4), 5)))
    with pytest.raises(ValueError, match=r"outside qkv\.weight"):
        load_checked(Fused(), [], dict(slots, extra=ParamSlot("qkv.weight", (2, 4), 7)))
    with pytest.raises(ValueError, match=r"does not have"):
        load_checked(Fused(), [], dict(slots, extra=ParamSlot("qkv.scale", (8,))))
    with pytest.raises(ValueError, match=r"does not reshape"):
        load_checked(Fused(), [], dict(slots, **{"patch_embed.weight": ParamSlot("patch.weight", (4, 2, 3, 2))}))


# ---------------------------------------------------------------------------------------------
# read_checkpoint errors

def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "nope")


def test_file_instead_of_directory(tiny_ckpt):
    with pytest.raises(CheckpointError, match="not a directory"):
        read_checkpoint(tiny_ckpt / "config.json")


def test_missing_config(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "ck", skip=("config.json",))
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        read_checkpoint(d)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "preprocessor_config.json"])
def test_broken_json_names_the_file_and_position(tiny_ckpt, tmp_path, name):
    d = _copy(tiny_ckpt, tmp_path / "ck")
    (d / name).write_text('{"architectures": ["X"],\n  "oops" }')
    with pytest.raises(CheckpointError, match=re.escape(name) + r" is not valid JSON: .* line 2"):
        read_checkpoint(d)


def test_no_architectures(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["architectures"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json has no 'architectures'"):
        read_checkpoint(d)


def test_no_safetensors(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "ck", skip=("*.safetensors",))
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors.*pytorch_model\.bin.*only safetensors"):
        read_checkpoint(d)


def test_missing_tokenizer(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "ck", skip=("tokenizer*",))
    with pytest.raises(CheckpointError, match="no tokenizer"):
        load_tokenizer(d)


# ---------------------------------------------------------------------------------------------
# eos ids

def test_eos_ids_from_generation_config(tiny_ckpt):
    info = read_checkpoint(tiny_ckpt)
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    tok = load_tokenizer(tiny_ckpt)
    assert info.eos_token_ids == tuple(gen["eos_token_id"])
    assert info.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))


def test_eos_ids_fall_back_to_config_then_tokenizer(tiny_ckpt_flat, tmp_path):
    d = _copy(tiny_ckpt_flat, tmp_path / "ck", skip=("generation_config.json",))
    im_end = load_tokenizer(d).convert_tokens_to_ids("<|im_end|>")
    assert read_checkpoint(d).eos_token_ids == (im_end,)            # config.json eos_token_id
    cfg = json.loads((d / "config.json").read_text())
    del cfg["eos_token_id"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert read_checkpoint(d).eos_token_ids == (im_end,)            # tokenizer_config.json eos_token


# ---------------------------------------------------------------------------------------------
# tokenizer and chat template

def test_chat_template_renders_qwen_format(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    assert tok.is_fast and type(tok).__name__ == "Qwen2Tokenizer"
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe this image.<|im_end|>\n"
        "<|im_start|>assistant\n")
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "A"},
                                         {"type": "image_url", "image_url": {"url": "data:..."}},
                                         {"type": "text", "text": "B"}]},
            {"role": "assistant", "content": "C"},
            {"role": "user", "content": "D"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nA<|vision_start|><|image_pad|><|vision_end|>B<|im_end|>\n"
        "<|im_start|>assistant\nC<|im_end|>\n<|im_start|>user\nD<|im_end|>\n")


def test_template_is_stored_where_transformers_and_others_look(tiny_ckpt):
    from transformers import AutoTokenizer

    cfg = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    jinja = (tiny_ckpt / "chat_template.jinja").read_text()
    assert cfg["chat_template"] == jinja == AutoTokenizer.from_pretrained(str(tiny_ckpt)).chat_template


def test_special_tokens_are_single_ids_matching_the_config(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    cfg = read_checkpoint(tiny_ckpt).hf_config
    expect = {"<|image_pad|>": cfg.image_token_id, "<|video_pad|>": cfg.video_token_id,
              "<|vision_start|>": cfg.vision_start_token_id, "<|vision_end|>": cfg.vision_end_token_id,
              "<|im_end|>": text_config(cfg).eos_token_id, "<|endoftext|>": text_config(cfg).pad_token_id}
    for token, token_id in expect.items():
        assert tok.encode(token, add_special_tokens=False) == [token_id], token
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [tok.convert_tokens_to_ids("<|im_start|>")]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    # 8 special tokens after the 1000 BPE ones, then the tool-call and think tags (added, not special)
    assert len(tok) == 1012 and text_config(cfg).vocab_size == 1024
    for i, tag in enumerate(("<tool_call>", "</tool_call>", "<think>", "</think>")):
        assert tok.encode(tag, add_special_tokens=False) == [1008 + i] and tok.decode([1008 + i],
                                                                                     skip_special_tokens=True) == tag


def test_tokenizer_round_trips_arbitrary_text(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    text = "Describe  this image:\n\tünïcode — 😀, 12:30, 日本語 <|image_pad|> done."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())           # merges were learned


# ---------------------------------------------------------------------------------------------
# the factory

@pytest.mark.timing  # a wall-clock bound: run alone
def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    start = time.perf_counter()
    a = make_tiny_checkpoint(tmp_path / "a", seed=7)
    elapsed = time.perf_counter() - start
    b = make_tiny_checkpoint(tmp_path / "b", seed=7)
    c = make_tiny_checkpoint(tmp_path / "c", seed=8)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    assert elapsed < 5.0, f"make_tiny_checkpoint took {elapsed:.2f}s"


def test_unknown_override_and_family(tmp_path):
    with pytest.raises(TypeError, match=r"hiden_size.*accepted: .*text_hidden_size"):
        make_tiny_checkpoint(tmp_path / "x", hiden_size=32)
    with pytest.raises(ValueError, match=r"llava.*qwen2_5_vl, internvl"):
        make_tiny_checkpoint(tmp_path / "y", family="llava")


def test_overrides_reach_the_config(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "o", text_hidden_size=96, num_heads=6, num_kv_heads=3, num_layers=3,
                             vision_depth=3, fullatt_block_indexes=[0, 2], tie_word_embeddings=True,
                             min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64, vocab_size=1100)
    info = read_checkpoint(d)
    t, v = text_config(info.hf_config), info.hf_config.vision_config
    assert (t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.num_hidden_layers) == (96, 6, 3, 3)
    assert t.rope_parameters["mrope_section"] == [2, 3, 3] and t.vocab_size == 1100   # head_dim 16
    assert (v.depth, list(v.fullatt_block_indexes), v.out_hidden_size) == (3, [0, 2], 96)
    assert info.hf_config.tie_word_embeddings
    names = {n for n, _ in iter_safetensors(d, show_progress=False)}
    assert "lm_head.weight" not in names                                            # tied: not saved
    assert info.preprocessor["size"] == {"longest_edge": 28 * 28 * 64, "shortest_edge": 28 * 28 * 4}
    with pytest.raises(ValueError, match="mrope_section"):
        make_tiny_checkpoint(tmp_path / "bad", mrope_section=[2, 2, 2])
