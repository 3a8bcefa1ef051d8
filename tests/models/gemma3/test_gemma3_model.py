"""Gemma 3's model against transformers' Gemma3ForConditionalGeneration on the tiny checkpoint (window 12):
the vision path (SigLIP tower + average-pool projector), the decoder's logits on text within and past the
window and on image prompts (images shorter and longer than the window, pan-and-scan crops: the spans'
bidirectional attention), both checkpoint spellings, strict loading, the config fields this decoder
refuses, the softcap and the embedding factor's rounding."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tolerance import assert_reduction_close, forward_terms, reduction_atol
from vlm_sdk.attention.metadata import AttentionMetadata, StepMetadata
from vlm_sdk.errors import CheckpointError
from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.common.gemma_config import GemmaDecoderConfig
from vlm_sdk.models.gemma3.model import Gemma3ForConditionalGeneration
from vlm_sdk.models.base import StepImages
from vlm_sdk.multimodal.inputs import ImageInput
from vlm_sdk.protocol.cache_spec import AttentionSpec
from vlm_sdk.testing import make_tiny_checkpoint

# the tiny Gemma 3's chain (tests/tolerance.py): 588-input patches, 2 SigLIP layers of width 32 over 64 patches,
# the projector (32 in), 3 decoder layers of width 48 (MLP 96) over at most 64 tokens, head_dim 16, the head
TERMS = forward_terms(layers=3, hidden=48, intermediate=96, tokens=64, head_dim=16, patch=588, vision_layers=2,
                      vision_hidden=32, vision_intermediate=64, vision_tokens=64, merger=32)


def load_ours(ckpt, dtype=torch.float32) -> Gemma3ForConditionalGeneration:
    model = Gemma3ForConditionalGeneration(read_checkpoint(ckpt).hf_config, dtype=dtype)
    model.load_weights(iter_safetensors(ckpt, show_progress=False), source=ckpt)
    return model


@pytest.fixture(scope="module")
def hf(gemma3_ckpt):
    from vlm_sdk.models.gemma3.reference import hf_model
    return hf_model(str(gemma3_ckpt))


@pytest.fixture(scope="module")
def ours(gemma3_ckpt):
    return load_ours(gemma3_ckpt)


@torch.no_grad()
def prefill_logits(model, ids: torch.Tensor, images: list[ImageInput] = (), image_token_id: int | None = None,
                   block: int = 16) -> torch.Tensor:  # [L] -> [L, vocab]
    """Logits of every prompt position from one prefill on a fresh paged cache, one metadata per cache
    group as the runner builds them (the sliding layers' with their window)."""
    n = ids.numel()
    blocks = -(-n // block)
    shape = (blocks, block, model.num_kv_heads, model.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
    windows = sorted({s.window for s in model.cache_specs(torch.float32)}, key=lambda w: w is None)
    metas = tuple(model.decoder.ops.attention.prepare(AttentionMetadata(
        slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        query_lens_cpu=[n], seq_lens_cpu=[n], max_query_len=n, max_seq_len=n, window=w), caches[0][0])
        for w in windows)
    meta = StepMetadata(metas, tuple(windows.index(s.window) for s in model.cache_specs(torch.float32)))
    step = None
    if images:
        rows = (ids == image_token_id).nonzero()[:, 0]
        step = StepImages(rows, model.encode_images(list(images)))
    hidden = model(model.embed_tokens(ids), torch.arange(n)[None], caches, meta, step)
    return model.compute_logits(hidden)


def test_cache_specs_declare_the_window(ours):
    assert ours.cache_specs(torch.float32) == [AttentionSpec(2, 16, "float32", 12), AttentionSpec(2, 16, "float32", 12),
                                               AttentionSpec(2, 16, "float32", None)]
    assert ours.cache_specs(torch.float8_e4m3fn)[2].dtype == "float8_e4m3fn"


@pytest.mark.parametrize("tokens_per_image", [4, 16])  # the 8x8 patch grid pooled 4x4 and 2x2
@torch.no_grad()
def test_vision_features_equal_transformers(tmp_path, tokens_per_image):
    from vlm_sdk.models.gemma3.reference import hf_model
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="gemma3", mm_tokens_per_image=tokens_per_image)
    ours, hf = load_ours(ckpt), hf_model(str(ckpt))
    pixels = torch.randn(3, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    expected = hf.model.get_image_features(pixels).pooler_output.reshape(-1, 48)  # [3 * tokens, hidden]
    got = ours.encode_images([ImageInput(pixels[i:i + 1], tokens_per_image) for i in range(3)])
    assert got.shape == (3 * tokens_per_image, 48)
    assert_reduction_close(got, expected, TERMS)


@pytest.mark.parametrize("length", [11, 40])  # within the window of 12, and past it
@torch.no_grad()
def test_text_logits_equal_transformers(ours, hf, length):
    ids = torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(length))
    ids[0] = 1002  # <bos>
    expected = hf(input_ids=ids[None]).logits[0]
    got = prefill_logits(ours, ids)
    assert got.shape == expected.shape and expected.std() > 1
    assert_reduction_close(got, expected, TERMS)


@pytest.mark.parametrize("tokens_per_image", [4, 16])  # an image shorter and longer than the window (12)
@pytest.mark.parametrize("crops", [False, True])
@torch.no_grad()
def test_image_prompts_past_the_window_equal_transformers(tmp_path, tokens_per_image, crops):
    """Whole-prompt logits with the bidirectional image spans and the window, against transformers'
    forward given token_type_ids (its AND(window, OR(causal, image block)) mask)."""
    from helpers import image
    from transformers import AutoTokenizer
    from vlm_sdk.config import EngineArgs
    from vlm_sdk.model_loader import load_tokenizer
    from vlm_sdk.models.gemma3 import reference
    from vlm_sdk.models.registry import load
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", family="gemma3", mm_tokens_per_image=tokens_per_image)
    info, family = read_checkpoint(ckpt), load("gemma3")
    settings = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32} if crops else {}
    proc = family.make_processor(load_tokenizer(ckpt), family.image_processor_cls.from_preprocessor_config(
        info.preprocessor, info.hf_config), info.hf_config, EngineArgs.from_kwargs(mm_processor_kwargs=settings))
    conv = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image", "image": image(300, 120, 1)},
                                         {"type": "text", "text": "with"}, {"type": "image", "image": image(90, 80, 2)}]}]
    prompt = proc(conv)
    hf = reference.hf_model(str(ckpt))
    ref = reference.hf_prompt(AutoTokenizer.from_pretrained(str(ckpt)), reference.hf_image_processor(str(ckpt)),
                              hf.config, conv, **settings)
    assert prompt.token_ids == ref["input_ids"][0].tolist() and len(prompt.token_ids) > 12
    expected = hf(**ref).logits[0]
    ours = load_ours(ckpt)
    got = prefill_logits(ours, torch.tensor(prompt.token_ids), prompt.images, proc.image_token_id)
    assert_reduction_close(got, expected, TERMS)
    causal = hf(input_ids=ref["input_ids"], pixel_values=ref["pixel_values"]).logits[0]  # no spans
    assert (causal - expected).abs().max() > 100 * reduction_atol(expected, TERMS), "the spans changed nothing"


def test_published_layout_loads_the_same_weights(tmp_path, ours):
    published = make_tiny_checkpoint(tmp_path / "published", family="gemma3", layout="published")
    raw = json.loads((published / "config.json").read_text())
    assert "rope_scaling" in raw["text_config"] and "layer_types" not in raw["text_config"]
    names = load_file(published / "model.safetensors")
    assert any(n.startswith("vision_tower.vision_model.") for n in names)
    assert any(n.startswith("language_model.model.") for n in names)
    theirs = load_ours(published)
    assert theirs.decoder.cfg == ours.decoder.cfg
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), name


def test_loading_is_strict(tmp_path, gemma3_ckpt):
    bad = tmp_path / "bad"
    shutil.copytree(gemma3_ckpt, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors.pop("language_model.model.layers.1.post_feedforward_layernorm.weight")
    tensors["vision_tower.head.probe"] = torch.zeros(1, 1, 32)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="vision_tower.head.probe"):
        load_ours(bad)
    tensors.pop("vision_tower.head.probe")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="post_feedforward_layernorm"):
        load_ours(bad)


@pytest.mark.parametrize("field, value, message", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping 50.0 is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=true"),
    ("hidden_activation", "silu", "hidden_activation 'silu' is not supported"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "rope type 'yarn'"),
])
def test_config_fields_the_decoder_does_not_implement_are_refused(gemma3_ckpt, field, value, message):
    text = read_checkpoint(gemma3_ckpt).hf_config.text_config.to_dict()
    text[field] = value
    with pytest.raises(CheckpointError, match=message):
        GemmaDecoderConfig.from_hf(text, tie_word_embeddings=True)


def test_the_published_flat_fields_read_as_transformers_reads_them(gemma3_ckpt):
    from transformers import Gemma3TextConfig
    flat = {"hidden_size": 64, "num_hidden_layers": 12, "sliding_window": 1024, "sliding_window_pattern": 6,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "query_pre_attn_scalar": 168}
    theirs = Gemma3TextConfig(**flat)
    for config in (flat, theirs):
        cfg = GemmaDecoderConfig.from_hf(config, tie_word_embeddings=True)
        assert cfg.layer_types == tuple(theirs.layer_types) and cfg.layer_types[5] == cfg.layer_types[11] == "full_attention"
        assert (cfg.rope["full_attention"].theta, cfg.rope["full_attention"].linear_factor) == (1e6, 8.0)
        assert (cfg.rope["sliding_attention"].theta, cfg.rope["sliding_attention"].linear_factor) == (1e4, 1.0)
        assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.head_dim, cfg.vocab_size) == (1024, 168, 256, 262208)


@torch.no_grad()
def test_final_logit_softcapping_where_the_config_sets_it(tmp_path, ours):
    capped = load_ours(make_tiny_checkpoint(tmp_path / "capped", family="gemma3", final_logit_softcapping=3.0))
    assert capped.decoder.cfg.final_logit_softcapping == 3.0
    ids = torch.tensor([1002, 1004, 5, 77, 300])
    raw = prefill_logits(ours, ids)
    got = prefill_logits(capped, ids)
    torch.testing.assert_close(got, 3.0 * torch.tanh(raw / 3.0))
    assert got.abs().max() < 3.0 < raw.abs().max()


def test_the_embedding_factor_is_rounded_to_the_dtype_as_transformers_rounds_it():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding
    from vlm_sdk.models.common.gemma_decoder import GemmaDecoder
    for hidden, dtype in ((3072, torch.bfloat16), (2560, torch.bfloat16), (48, torch.float32)):
        theirs = Gemma3TextScaledWordEmbedding(8, hidden, 0, embed_scale=hidden ** 0.5).to(dtype)
        cfg = GemmaDecoderConfig.from_hf({"hidden_size": hidden, "num_hidden_layers": 1, "vocab_size": 8,
                                          "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8,
                                          "intermediate_size": 8}, tie_word_embeddings=True)
        with torch.device("meta"):
            ours = GemmaDecoder(cfg, dtype=dtype, device="meta")
        assert ours.normalizer.dtype == dtype
        assert float(torch.tensor(hidden ** 0.5, dtype=dtype)) == float(theirs.embed_scale.to(dtype))
    assert float(torch.tensor(3072 ** 0.5, dtype=torch.bfloat16)) == 55.5  # transformers' note: not 55.4256
