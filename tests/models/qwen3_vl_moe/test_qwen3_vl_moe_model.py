"""Qwen3VLMoeForCausalLM on the paged KV cache against transformers' Qwen3VLMoeForConditionalGeneration
(float32, the tiny checkpoint: 12 experts, 3 per token, layer 1 dense): prefill logits for text, one image,
two images and an image at the start; decode logits and greedy tokens equal to `generate`; chunked
prefill splitting an image; `decoder_sparse_step` and `mlp_only_layers` honoured; the three expert
layouts load the same weights; loading stays strict."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3VLMoeForConditionalGeneration

from qwen3_vl_steps import (Seq, blocks_for, check_chunked_prefill, check_decode_matches_generate, new_cache,
                            prompt, run_step)
from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.errors import CheckpointError
from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.qwen3_vl_moe.model import Qwen3VLMoeForCausalLM
from vlm_sdk.testing import make_tiny_checkpoint

# the tiny model's longest chain (tests/tolerance.py): Qwen3-VL's tower and mergers; 3 layers of width 48
# whose longest MLP is the dense layer's 128 (an expert's chain is 48 + 32 + the 3 routed terms)
TERMS = forward_terms(layers=3, hidden=48, intermediate=128, tokens=160, head_dim=16, patch=1536, vision_layers=3,
                      vision_hidden=32, vision_intermediate=64, vision_tokens=256, merger=256)
LM = "model.language_model.layers."


def close(actual, expected):
    assert_reduction_close(actual, expected, TERMS)


def build(ckpt, ops=None) -> Qwen3VLMoeForCausalLM:
    model = Qwen3VLMoeForCausalLM(read_checkpoint(ckpt).hf_config, ops=ops)
    model.load_weights(iter_safetensors(ckpt, show_progress=False), source=ckpt)
    return model


def hf_model(ckpt):
    return Qwen3VLMoeForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints("qwen3_vl_moe")


@pytest.fixture(scope="module")
def models(ckpt):
    """transformers' model (the oracle) and ours on the same checkpoint directory."""
    return hf_model(ckpt), build(ckpt)


def prefill_logits(model, seq: Seq) -> torch.Tensor:
    n = len(seq.ids)
    (logits,) = run_step(model, new_cache(model), [(seq.chunk(0, n), blocks_for(n), n)])
    return logits


@pytest.mark.parametrize("name", ["text", "one_image", "two_images", "image_at_start"])
def test_prefill_matches_transformers(models, name):
    hf, ours = models
    seq = Seq(ours, *prompt(hf.config, name))
    logits = prefill_logits(ours, seq)
    with torch.no_grad():
        ref = hf(**seq.hf_kwargs()).logits[0]
    assert logits.shape == (len(seq.ids), ours.vocab_size)
    close(logits, ref)


@pytest.mark.parametrize("name", ["text", "two_images"])
def test_decode_matches_transformers_generate(models, name):
    hf, ours = models
    check_decode_matches_generate(hf, ours, name, close)


@pytest.mark.parametrize("split", [10, 29])  # inside the first image
def test_chunked_prefill_splitting_an_image_equals_one_prefill(models, split):
    hf, ours = models
    check_chunked_prefill(hf, ours, split, close)


def test_experts_are_where_the_config_says_and_parameters_match(models):
    hf, ours = models
    moe = ours.decoder_config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.mlp_only_layers) == (12, 3, 32, (1,))
    assert [layer.moe is not None for layer in ours.decoder.layers] == [True, False, True]
    assert ours.decoder.lm_head is not None  # the top-level tie_word_embeddings (false) rules, as transformers'
    ours_n = sum(p.numel() for g in ours.parameter_groups().values() for p in g)
    assert ours_n == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("step,only,sparse", [(2, (), [False, True, False]), (1, (0, 2), [False, True, False]),
                                              (1, (), [True, True, True])])
def test_decoder_sparse_step_and_mlp_only_layers(tmp_path, step, only, sparse):
    ckpt = make_tiny_checkpoint(tmp_path, family="qwen3_vl_moe", decoder_sparse_step=step, mlp_only_layers=only)
    hf, ours = hf_model(ckpt), build(ckpt)
    assert [layer.moe is not None for layer in ours.decoder.layers] == sparse
    assert [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.language_model.layers] == sparse
    seq = Seq(ours, *prompt(hf.config, "one_image"))
    with torch.no_grad():
        close(prefill_logits(ours, seq), hf(**seq.hf_kwargs()).logits[0])


@pytest.mark.parametrize("layout", ["transposed", "per_expert"])
def test_every_expert_layout_loads_the_same_weights(models, tmp_path, layout):
    """The published BF16 layout (transposed fused tensors, the published config.json, several files) and
    one tensor per expert: the same seed gives parameters equal to transformers 5's fused layout's."""
    _, ours = models
    other_ckpt = make_tiny_checkpoint(tmp_path, family="qwen3_vl_moe", experts=layout, max_shard_size="200KB",
                                      config_layout="flat" if layout == "transposed" else "nested")
    assert len(list(other_ckpt.glob("*.safetensors"))) > 1
    other = build(other_ckpt)
    assert other.decoder_config == ours.decoder_config
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), other.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_lazy_loading_reads_the_same_weights(models, ckpt):
    _, ours = models
    lazy = Qwen3VLMoeForCausalLM(read_checkpoint(ckpt).hf_config)
    lazy.load_weights(iter_safetensors(ckpt, show_progress=False, lazy=True), source=ckpt)
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), lazy.named_parameters()):
        assert torch.equal(p1, p2), n1


def test_loading_is_strict(models, ckpt, tmp_path):
    hf, _ = models
    fused = dict(iter_safetensors(ckpt, show_progress=False))
    per_expert = dict(iter_safetensors(make_tiny_checkpoint(tmp_path, family="qwen3_vl_moe", experts="per_expert"),
                                       show_progress=False))
    fresh = lambda: Qwen3VLMoeForCausalLM(hf.config)  # noqa: E731
    name = f"{LM}2.mlp.experts.5.up_proj.weight"
    with pytest.raises(CheckpointError, match=r"missing.*" + name.replace(".", r"\.")):
        fresh().load_weights({k: v for k, v in per_expert.items() if k != name}.items())
    name = f"{LM}0.mlp.experts.gate_up_proj"
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*\[12, 64, 40\].*\[12, 64, 48\].*\[12, 48, 64\]"):
        fresh().load_weights(dict(fused, **{name: torch.zeros(12, 64, 40)}).items())
    both = dict(fused, **{k: v for k, v in per_expert.items() if k.startswith(f"{LM}0.mlp.experts.3.")})
    with pytest.raises(CheckpointError, match=rf"{LM}0\.mlp\.experts\.3\.\w+_proj\.weight appears twice"):
        fresh().load_weights(both.items())
    dense_layer = dict(fused, **{f"{LM}1.mlp.experts.down_proj": torch.zeros(12, 48, 32)})  # layer 1 is mlp_only
    with pytest.raises(CheckpointError, match=rf"unexpected tensor {LM}1\.mlp\.experts\.down_proj"):
        fresh().load_weights(dense_layer.items())
    name = f"{LM}0.mlp.gate.weight"
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*\[11, 48\].*\[12, 48\]"):
        fresh().load_weights(dict(fused, **{name: torch.zeros(11, 48)}).items())


def test_configs_without_experts_or_with_bad_ones_are_refused(models):
    hf, _ = models
    dense = copy.deepcopy(hf.config)
    dense.text_config.num_experts = 0
    with pytest.raises(CheckpointError, match="declares no experts"):
        Qwen3VLMoeForCausalLM(dense, device="meta")
    too_many = copy.deepcopy(hf.config)
    too_many.text_config.num_experts_per_tok = 13
    with pytest.raises(CheckpointError, match=r"num_experts_per_tok \(13\) must be from 1 to num_experts \(12\)"):
        Qwen3VLMoeForCausalLM(too_many, device="meta")
    awq = copy.deepcopy(hf.config)  # quantized experts: block-wise FP8 only
    awq.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True,
                               "version": "gemm"}
    with pytest.raises(CheckpointError, match=r"quantization_config \(AWQ.*\) on a mixture-of-experts LLM: "
                                              r"quantized experts are read in block-wise FP8 only"):
        Qwen3VLMoeForCausalLM(awq, device="meta")
    fp8 = copy.deepcopy(hf.config)  # the published FP8 repos' 128 x 128 blocks do not fit experts of 32
    fp8.quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128]}
    with pytest.raises(CheckpointError, match=r"moe_intermediate_size \(32\) is not a multiple of the FP8 "
                                              r"weight_block_size \[128, 128\]"):
        Qwen3VLMoeForCausalLM(fp8, device="meta")
