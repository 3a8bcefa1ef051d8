"""Qwen3VLForCausalLM on the paged KV cache against transformers' Qwen3VLForConditionalGeneration (float32):
prefill logits within 1e-4 for text only, one image, two images of different sizes and an image at the
start, on both kernel sets; decode logits and greedy tokens equal to `generate`; chunked prefill that
splits an image (its DeepStack rows split with it) equal to one prefill; batched prefill and decode."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from qwen3_vl_steps import (Seq, blocks_for, check_chunked_prefill, check_decode_matches_generate, decode_item,
                            hf_generate, new_cache, prompt, run_step)
from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.ops import make_ops
from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.base import StepImages
from vlm_sdk.models.qwen3_vl.model import Qwen3VLForCausalLM
from vlm_sdk.testing import make_tiny_checkpoint

# the tiny Qwen3-VL's chain (tests/tolerance.py): 1,536-input patches, 3 blocks of width 32 over at most
# 256 patches, mergers of inputs 128 + 128, 3 layers of width 48 (MLP 128) over at most 160 tokens, the head
TERMS = forward_terms(layers=3, hidden=48, intermediate=128, tokens=160, head_dim=16, patch=1536, vision_layers=3,
                      vision_hidden=32, vision_intermediate=64, vision_tokens=256, merger=256)


def close(actual, expected):
    assert_reduction_close(actual, expected, TERMS)


def build(ckpt, ops=None) -> Qwen3VLForCausalLM:
    model = Qwen3VLForCausalLM(read_checkpoint(ckpt).hf_config, ops=ops)
    model.load_weights(iter_safetensors(ckpt, show_progress=False), source=ckpt)
    return model


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints("qwen3_vl")


@pytest.fixture(scope="module")
def models(ckpt):
    """transformers' model (the oracle) and ours on the same checkpoint directory."""
    return Qwen3VLForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval(), build(ckpt)


@pytest.mark.parametrize("name", ["text", "one_image", "two_images", "image_at_start"])
def test_prefill_matches_transformers(models, name):
    hf, ours = models
    seq = Seq(ours, *prompt(hf.config, name))
    n = len(seq.ids)
    (logits,) = run_step(ours, new_cache(ours), [(seq.chunk(0, n), blocks_for(n), n)])
    with torch.no_grad():
        ref = hf(**seq.hf_kwargs()).logits[0]
    assert logits.dtype == torch.float32 and logits.shape == (n, ours.vocab_size)
    close(logits, ref)


def test_deepstack_features_are_used(models):
    """The same prompt without the DeepStack columns gives other logits after the image: the levels
    reach the decoder (and the test above compares something DeepStack changes)."""
    hf, ours = models
    seq = Seq(ours, *prompt(hf.config, "one_image"))
    n = len(seq.ids)
    embeds, positions, images = seq.chunk(0, n)
    (full,) = run_step(ours, new_cache(ours), [((embeds, positions, images), blocks_for(n), n)])
    zeroed = images.embeds.clone()
    zeroed[:, ours.hidden_size:] = 0
    (plain,) = run_step(ours, new_cache(ours), [((seq.embeds.clone(), positions, StepImages(images.rows, zeroed)),
                                                 blocks_for(n), n)])
    assert (full[-1] - plain[-1]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="DeepStack levels"):
        run_step(ours, new_cache(ours), [((embeds, positions, StepImages(images.rows, zeroed[:, :ours.hidden_size])),
                                          blocks_for(n), n)])


@pytest.mark.parametrize("split", [10, 20, 29])  # inside the first image: 2, 12 and 21 of its 24 rows
def test_chunked_prefill_splitting_an_image_equals_one_prefill(models, split):
    hf, ours = models
    check_chunked_prefill(hf, ours, split, close)


@pytest.mark.parametrize("name", ["text", "two_images"])
def test_decode_matches_transformers_generate(models, name):
    hf, ours = models
    check_decode_matches_generate(hf, ours, name, close)


def test_batched_prefill_then_batched_decode(models):
    hf, ours = models
    a = Seq(ours, *prompt(hf.config, "one_image"), seed=1)
    b = Seq(ours, *prompt(hf.config, "image_at_start"), seed=2)
    blocks_a, blocks_b = [3, 0, 6], [1, 4]  # 32 + 1 and 29 + 1 tokens
    na, nb = len(a.ids), len(b.ids)
    tok_a, ref_a = hf_generate(hf, a, steps=2)
    tok_b, ref_b = hf_generate(hf, b, steps=2)
    kv = new_cache(ours)
    la, lb = run_step(ours, kv, [(a.chunk(0, na), blocks_a, na), (b.chunk(0, nb), blocks_b, nb)])
    with torch.no_grad():
        close(la, hf(**a.hf_kwargs()).logits[0])
        close(lb, hf(**b.hf_kwargs()).logits[0])
    da, db = run_step(ours, kv, [decode_item(ours, a, tok_a[0], na, blocks_a),
                                 decode_item(ours, b, tok_b[0], nb, blocks_b)])
    close(da[0], ref_a[1])
    close(db[0], ref_b[1])


@pytest.mark.parametrize("name", ["text", "two_images"])
def test_triton_kernel_set_prefill_matches_transformers(models, ckpt, name):
    """The Triton kernel set (q/k norm fused into the in-kernel rotary, interleaved M-RoPE, varlen vision
    attention); on the CPU through the interpreter."""
    import os
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    hf, _ = models
    ours = build(ckpt, ops=make_ops("triton", torch.device("cpu")))
    seq = Seq(ours, *prompt(hf.config, name))
    n = len(seq.ids)
    (logits,) = run_step(ours, new_cache(ours), [(seq.chunk(0, n), blocks_for(n), n)])
    with torch.no_grad():
        close(logits, hf(**seq.hf_kwargs()).logits[0])


def test_model_attributes_and_parameter_groups(models):
    hf, ours = models
    text = hf.config.text_config
    assert (ours.num_layers, ours.num_kv_heads, ours.head_dim, ours.hidden_size, ours.vocab_size) == (
        text.num_hidden_layers, text.num_key_value_heads, text.head_dim, text.hidden_size, text.vocab_size)
    assert ours.head_dim != ours.hidden_size // text.num_attention_heads  # Qwen3's own head_dim is used
    assert ours.decoder_config.qk_norm and ours.decoder_config.mrope_interleaved
    assert ours.deepstack_levels == 2 and not any(p.requires_grad for p in ours.parameters())
    groups = ours.parameter_groups()
    projector = sum(p.numel() for p in groups["projector"])
    assert projector == sum(p.numel() for n, p in hf.model.visual.named_parameters() if "merger" in n)
    total = sum(p.numel() for g in groups.values() for p in g)
    assert total == sum(p.numel() for p in hf.parameters())


def test_load_weights_errors(models, ckpt):
    hf, _ = models
    weights = dict(iter_safetensors(ckpt, show_progress=False))
    fresh = lambda: Qwen3VLForCausalLM(hf.config)  # noqa: E731
    name = "model.language_model.layers.1.self_attn.q_norm.weight"
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        fresh().load_weights({k: v for k, v in weights.items() if k != name}.items())
    name = "model.visual.deepstack_merger_list.1.norm.weight"
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*\[4\].*\[128\]"):
        fresh().load_weights(dict(weights, **{name: torch.zeros(4)}).items())
    qwen2_text = copy.deepcopy(hf.config)
    qwen2_text.text_config.model_type = "qwen2"  # a Qwen2 LLM has no q/k norm to load
    with pytest.raises(CheckpointError, match="not a Qwen3 LLM"):
        Qwen3VLForCausalLM(qwen2_text, device="meta")


def test_published_layout_and_sharded_files_load_the_same(models, tmp_path_factory):
    """The published config.json (text_config.rope_scaling + rope_theta), several safetensors files and
    the flat preprocessor config, same seed: same decoder config, same weights."""
    _, ours = models
    flat = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl_flat"), family="qwen3_vl", config_layout="flat",
                                preprocessor_layout="flat", max_shard_size="200KB")
    assert len(list(flat.glob("*.safetensors"))) > 1
    other = build(flat)
    assert other.decoder_config == ours.decoder_config
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), other.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_tied_lm_head(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl_tied"), family="qwen3_vl", tie_word_embeddings=True)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ours = build(ckpt)
    assert ours.decoder.lm_head is None
    seq = Seq(ours, *prompt(hf.config, "one_image"))
    n = len(seq.ids)
    (logits,) = run_step(ours, new_cache(ours), [(seq.chunk(0, n), blocks_for(n), n)])
    with torch.no_grad():
        close(logits, hf(**seq.hf_kwargs()).logits[0])


def test_a_tower_without_deepstack_levels(tmp_path_factory):
    """deepstack_visual_indexes [] (the config allows it): image rows are hidden wide, nothing is added."""
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_vl_no_deepstack"), family="qwen3_vl",
                                deepstack_visual_indexes=())
    hf = Qwen3VLForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ours = build(ckpt)
    seq = Seq(ours, *prompt(hf.config, "two_images"))
    assert ours.deepstack_levels == 0 and seq.image_embeds.shape[1] == ours.hidden_size
    n = len(seq.ids)
    (logits,) = run_step(ours, new_cache(ours), [(seq.chunk(0, n), blocks_for(n), n)])
    with torch.no_grad():
        close(logits, hf(**seq.hf_kwargs()).logits[0])
