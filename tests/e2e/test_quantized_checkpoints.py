"""Quantized checkpoints through the engine, on the CPU: tiny checkpoints of every family written by the
reference quantizer (vlm_sdk/testing/quantizer.py) in each published layout, against transformers on the
same weights dequantized to float (the quantizer's twin directory): same greedy tokens on an image and a
text conversation batched together, and each token's logprob within the bound of the arithmetic
(tests/tolerance.py); transformers also reads the symmetric W4A16 checkpoint itself. Two ranks (gloo) give
the tokens of one; a missing scale tensor, a config that does not match the tensors and a tensor-parallel
size that cuts a group are refused before serving."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import SAMPLE_IMAGE
from tolerance import forward_terms, reduction_atol
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import CheckpointError, InvalidRequestError
from vlm_sdk.testing.families import fixtures
from vlm_sdk.testing.quantizer import quantize_checkpoint

FORMATS = {"awq": ("awq", dict(group_size=16)),
           "gptq_asym_desc_act": ("gptq", dict(group_size=16, sym=False, desc_act=True)),
           "gptq_sym_v2": ("gptq", dict(group_size=16, v2=True)),
           "fp8_block": ("fp8", dict(block=(32, 32))),  # 48-wide Qwen3-VL inputs: a partial last block
           "fp8_block16": ("fp8", dict(block=(16, 16))),  # splits over two ranks (a KV head is 16 rows)
           "ct_fp8": ("compressed-tensors", {}),
           "ct_w4a16": ("w4a16", dict(group_size=16)),
           "ct_w4a16_asym_actorder": ("w4a16", dict(group_size=16, sym=False, desc_act=True)),
           "ct_w4a16_channel": ("w4a16", dict(group_size=-1, sym=False))}
CASES = [("qwen2_5_vl", "awq"), ("qwen3_vl", "awq"), ("internvl", "awq"),
         ("qwen2_5_vl", "gptq_asym_desc_act"), ("qwen3_vl", "gptq_sym_v2"), ("internvl", "gptq_asym_desc_act"),
         ("qwen2_5_vl", "fp8_block"), ("qwen3_vl", "fp8_block"), ("internvl", "ct_fp8"), ("qwen3_vl", "ct_fp8"),
         ("qwen2_5_vl", "ct_w4a16"), ("qwen3_vl", "ct_w4a16_asym_actorder"), ("internvl", "ct_w4a16_channel"),
         ("gemma3", "fp8_block16"), ("gemma3", "ct_fp8"), ("gemma3", "ct_w4a16")]
CONVS = [[{"role": "user", "content": [{"type": "image", "image": str(SAMPLE_IMAGE)},
                                       {"type": "text", "text": "What is in this image?"}]}],
         [{"role": "user", "content": "Say something."}]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory):
    """`get(family, fmt)`: (quantized checkpoint, its dequantized twin), built once per module."""
    built = {}

    def get(family: str, fmt: str) -> tuple[Path, Path]:
        if (family, fmt) not in built:
            root = tmp_path_factory.mktemp(f"{family}_{fmt}")
            method, options = FORMATS[fmt]
            built[family, fmt] = (quantize_checkpoint(tiny_checkpoints(family), root / "q", method, root / "d",
                                                      **options), root / "d")
        return built[family, fmt]
    return get


@torch.inference_mode()
def _hf_greedy_logprobs(model, inputs, pad, steps):
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=steps, do_sample=False, pad_token_id=pad, output_logits=True,
                           return_dict_in_generate=True, eos_token_id=None)
    out = model.generate(**inputs, generation_config=cfg)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs = torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(out.logits, tokens)])
    return tokens, logprobs


@pytest.mark.parametrize("family, fmt", CASES)
def test_greedy_tokens_and_logprobs_equal_transformers_on_the_dequantized_weights(quantized, family, fmt):
    from transformers import AutoTokenizer
    path, twin = quantized(family, fmt)
    ours = LLM(str(path), show_progress=False).chat(CONVS, GREEDY)
    ref = fixtures(family).reference
    model, tokenizer = ref.hf_model(str(twin)), AutoTokenizer.from_pretrained(str(twin))
    image_processor = ref.hf_image_processor(str(twin))
    text = model.config.get_text_config()
    seen = set()
    for conv, out in zip(CONVS, ours):
        inputs = ref.hf_prompt(tokenizer, image_processor, model.config, conv)
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        tokens, logprobs = _hf_greedy_logprobs(model, inputs, pad, 12)
        # transformers stops at the checkpoint's eos (generation_config.json) where we ignore it
        assert len(tokens) == 12 or tokens[-1] in model.generation_config.eos_token_id
        assert out.token_ids[:len(tokens)] == tokens, f"{out.token_ids} {tokens}"
        seen.update(tokens)
        # the decoder's chain and the softmax over the vocab; the image prompt's chain also runs through
        # the vision tower, whose error reaches the logits scaled by the decoder: bounded by 4x the text's
        terms = forward_terms(layers=text.num_hidden_layers, hidden=text.hidden_size,
                              intermediate=text.intermediate_size, tokens=len(out.prompt_token_ids) + 12,
                              head_dim=getattr(text, "head_dim", None) or 16) + text.vocab_size
        atol = reduction_atol(logprobs, terms) * (4 if conv is CONVS[0] else 1)
        mine = torch.tensor([lp.logprob for lp in out.logprobs[:len(tokens)]])
        assert (mine - logprobs).abs().max() <= atol, (mine - logprobs).abs().max()
    assert len(seen) > 3  # varied tokens: a real comparison


@pytest.mark.parametrize("family, fmt", [("qwen2_5_vl", "awq"), ("qwen3_vl", "gptq_asym_desc_act"),
                                         ("internvl", "fp8_block16"), ("qwen2_5_vl", "ct_w4a16_asym_actorder")])
def test_two_ranks_give_the_tokens_of_one(quantized, family, fmt):
    path, _ = quantized(family, fmt)
    one = LLM(str(path), show_progress=False)
    with LLM(str(path), show_progress=False, tensor_parallel_size=2) as two:
        assert [o.token_ids for o in two.chat(CONVS, GREEDY)] == [o.token_ids for o in one.chat(CONVS, GREEDY)]
        ranks = two.memory_report.ranks
    whole = one.memory_report
    total = whole.weights_language_model_bytes + whole.weights_vision_bytes + whole.weights_projector_bytes
    # each rank holds its slice of the packed tensors (the embedding and vision tower are split too)
    assert all(r.weights_bytes < 0.75 * total for r in ranks)


@torch.inference_mode()
def test_transformers_reads_the_w4a16_checkpoint_itself_as_its_dequantized_twin(quantized):
    """transformers with the compressed-tensors package loads the symmetric W4A16 checkpoint itself
    (decompressing it) and computes exactly the twin's logits: the layout, the names and the ignore list are
    what the format's own reader takes. (Asymmetric ones it cannot load on the CPU here: compressed-tensors
    0.20 sizes weight_zero_point [out, groups] on the meta device where its compressor writes [out/8, groups],
    as vLLM reads it.)"""
    path, twin = quantized("qwen2_5_vl", "ct_w4a16")
    ref = fixtures("qwen2_5_vl").reference
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    theirs, float_twin = ref.hf_model(str(path)), ref.hf_model(str(twin))
    assert torch.equal(theirs(input_ids=ids).logits, float_twin(input_ids=ids).logits)


def _copy(src: Path, dst: Path, drop: str | None = None, config_change: dict | None = None,
          replace: dict | None = None) -> Path:
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k != drop}
    tensors.update(replace or {})
    save_file(tensors, str(dst / "model.safetensors"))
    if config_change:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"].update(config_change)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("fmt, tensor", [("awq", "scales [4, 32]"), ("ct_w4a16", "weight_scale [32, 4]")])
def test_a_missing_scale_tensor_is_named(quantized, tmp_path, fmt, tensor):
    path, _ = quantized("qwen2_5_vl", fmt)
    broken = _copy(path, tmp_path / "b", drop=f"model.layers.1.self_attn.k_proj.{tensor.split()[0]}")
    with pytest.raises(CheckpointError) as e:
        LLM(str(broken), show_progress=False)
    assert "missing from the checkpoint" in str(e.value)
    assert f"model.layers.1.self_attn.k_proj.{tensor}" in str(e.value)


def test_a_w4a16_weight_shape_that_does_not_match_the_config_is_named(quantized, tmp_path):
    """compressed-tensors records each Linear's unpacked shape (weight_shape): one that contradicts the
    Linear config.json makes is refused naming the tensor and both shapes."""
    path, _ = quantized("qwen2_5_vl", "ct_w4a16")
    name = "model.layers.0.mlp.down_proj.weight_shape"
    broken = _copy(path, tmp_path / "b", replace={name: torch.tensor([64, 64])})
    with pytest.raises(CheckpointError, match=rf"{name} says the weight is \[64, 64\], but config.json makes this "
                                              rf"Linear \[64, 128\]"):
        LLM(str(broken), show_progress=False)


def test_a_config_that_does_not_match_the_packed_shapes_is_named(quantized, tmp_path):
    path, _ = quantized("qwen2_5_vl", "awq")
    broken = _copy(path, tmp_path / "b", config_change={"group_size": 32})
    with pytest.raises(CheckpointError, match=r"down_proj\.qzeros .* has shape \[8, 8\] but .* expects \[4, 8\]"):
        LLM(str(broken), show_progress=False)


def test_an_unknown_quant_method_is_named(quantized, tmp_path):
    path, _ = quantized("qwen2_5_vl", "awq")
    broken = _copy(path, tmp_path / "b", config_change={"quant_method": "hqq"})
    with pytest.raises(CheckpointError, match="quant_method 'hqq' is not supported; supported: awq, gptq, fp8, "
                                              "compressed-tensors"):
        LLM(str(broken), show_progress=False)


def test_a_tensor_parallel_size_that_cuts_a_group_is_refused_with_the_sizes_that_work(quantized, tmp_path):
    _, twin = quantized("qwen2_5_vl", "awq")
    src = quantize_checkpoint(twin, tmp_path / "g64", "awq", group_size=64)  # o_proj: 64 inputs, 32 per rank
    with pytest.raises(InvalidRequestError) as e:
        LLM(str(src), show_progress=False, tensor_parallel_size=2)
    assert "cuts an index of awq's qzeros, which holds 64 features" in str(e.value)
    assert "Sizes that work: 1" in str(e.value)
