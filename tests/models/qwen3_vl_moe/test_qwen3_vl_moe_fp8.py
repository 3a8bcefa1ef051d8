"""Block-wise FP8 Qwen3-VL-MoE (the Qwen3-VL-*-FP8 layout: per-expert `experts.E.{gate,up,down}_proj.weight`
float8_e4m3fn with a `weight_scale_inv` each, router and vision tower float) through the engine, its
experts in the kernel set's fused_moe. The tiny per-expert checkpoint is quantized by the reference
quantizer (vlm_sdk/testing/quantizer.py, 32 x 32 blocks: partial along hidden 48); the oracle is
transformers on the dequantized twin (its experts fused back into transformers 5's tensors, the layout
transformers reads): the same greedy tokens for an image and a text conversation. The experts are held
in FP8; two ranks (16 x 16 blocks) give one rank's tokens, each expert split or (expert parallel) whole; a block the ranks would cut is refused
naming the sizes that work."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import SAMPLE_IMAGE
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.testing import make_tiny_checkpoint
from vlm_sdk.testing.families import fixtures
from vlm_sdk.testing.hooks import local_worker
from vlm_sdk.testing.quantizer import quantize_checkpoint

CONVS = [[{"role": "user", "content": [{"type": "image", "image": str(SAMPLE_IMAGE)},
                                       {"type": "text", "text": "What is in this image?"}]}],
         [{"role": "user", "content": "Say something."}]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """`get(block)`: (the FP8 checkpoint, transformers' copy of its dequantized weights), once per block."""
    built = {}

    def get(block: tuple[int, int]) -> tuple[Path, Path]:
        if block not in built:
            root = tmp_path_factory.mktemp(f"fp8_{block[0]}x{block[1]}")
            float_ckpt = make_tiny_checkpoint(root / "float", family="qwen3_vl_moe", experts="per_expert")
            path = quantize_checkpoint(float_ckpt, root / "q", "fp8", root / "d", block=block)
            built[block] = (path, _fused_twin(root / "d"))
        return built[block]
    return get


def _fused_twin(twin: Path) -> Path:
    """The dequantized twin's per-expert tensors stacked into transformers 5's fused ones, in place."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(twin / "model.safetensors")
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for name in [n for n in tensors if ".mlp.experts." in n]:
        prefix, rest = name.split(".mlp.experts.")
        experts.setdefault(prefix, {})[rest] = tensors.pop(name)
    for prefix, parts in experts.items():
        count = len(parts) // 3
        tensors[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[f"{e}.gate_proj.weight"], parts[f"{e}.up_proj.weight"]]) for e in range(count)])
        tensors[f"{prefix}.mlp.experts.down_proj"] = torch.stack([parts[f"{e}.down_proj.weight"] for e in range(count)])
    save_file(tensors, str(twin / "model.safetensors"), metadata={"format": "pt"})
    return twin


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(fp8):
    from transformers import AutoTokenizer
    path, twin = fp8((32, 32))
    assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    llm = LLM(str(path), show_progress=False)
    moe = local_worker(llm.engine).model.decoder.layers[0].moe  # a sparse layer
    assert moe.w13.dtype == moe.w2.dtype == torch.float8_e4m3fn and moe.gate.weight.dtype == torch.float32
    assert tuple(moe.w13_scale_inv.shape) == (12 * 2 * 32 // 32, 2)  # E x (gate, up) block rows, ceil(48 / 32)
    ours = llm.chat(CONVS, GREEDY)
    ref = fixtures("qwen3_vl_moe").reference
    model, tokenizer = ref.hf_model(str(twin)), AutoTokenizer.from_pretrained(str(twin))
    image_processor = ref.hf_image_processor(str(twin))
    seen = set()
    for conv, out in zip(CONVS, ours):
        inputs = ref.hf_prompt(tokenizer, image_processor, model.config, conv)
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        with torch.inference_mode():
            seq = model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=tokenizer.pad_token_id or 0)
        tokens = seq[0, inputs["input_ids"].shape[1]:].tolist()
        assert out.token_ids == tokens
        seen.update(tokens)
    assert len(seen) > 3  # varied tokens: a real comparison


def test_two_ranks_give_the_tokens_of_one(fp8):
    path, _ = fp8((16, 16))  # experts of 32: 16 per rank, one block
    one = [o.token_ids for o in LLM(str(path), show_progress=False).chat(CONVS, GREEDY)]
    with LLM(str(path), show_progress=False, tensor_parallel_size=2) as two:
        assert [o.token_ids for o in two.chat(CONVS, GREEDY)] == one
    # expert parallel: 6 whole FP8 experts per rank, their block scales with them
    with LLM(str(path), show_progress=False, tensor_parallel_size=2, enable_expert_parallel=True) as two:
        assert [o.token_ids for o in two.chat(CONVS, GREEDY)] == one


def test_a_rank_cutting_a_block_is_refused_naming_the_sizes(fp8):
    """Experts of 32 in 32 x 32 blocks: two ranks of 16 would cut every block (the engine refuses the size
    before any rank starts, naming the layer's reason: here the attention's q | k | v blocks are cut
    first, so the experts' own refusal is checked on the layer); another format's experts are refused."""
    from vlm_sdk.layers.moe import MoeConfig, SparseMoeBlock
    from vlm_sdk.layers.ops import TorchOps
    from vlm_sdk.layers.parallel_state import TPGroup
    from vlm_sdk.layers.quantization.awq import AWQScheme
    from vlm_sdk.layers.quantization.fp8 import FP8BlockScheme
    moe = MoeConfig(12, 3, 32)
    with pytest.raises(ValueError, match=r"moe_intermediate_size per rank \(16 at tensor_parallel_size 2\) is not "
                                         r"a multiple of the FP8 weight_block_size \[32, 32\]"):
        SparseMoeBlock(48, moe, TorchOps(), device="meta", tp=TPGroup(0, 2), quant=FP8BlockScheme((32, 32)))
    with pytest.raises(ValueError, match=r"AWQ.* experts are not supported: quantized experts are read in "
                                         r"block-wise FP8 only"):
        SparseMoeBlock(48, moe, TorchOps(), device="meta", quant=AWQScheme(16))
    SparseMoeBlock(48, moe, TorchOps(), device="meta", tp=TPGroup(0, 2), quant=FP8BlockScheme((16, 16)))
    # expert parallel: each rank's 6 experts are whole, 32 wide: whole blocks
    SparseMoeBlock(48, moe, TorchOps(), device="meta", tp=TPGroup(0, 2), ep=TPGroup(0, 2),
                   quant=FP8BlockScheme((32, 32)))
    path, _ = fp8((32, 32))
    with pytest.raises(InvalidRequestError, match=r"tensor_parallel_size=2 does not split this model: .*"
                                                  r"Sizes that work: 1$"):
        LLM(str(path), show_progress=False, tensor_parallel_size=2)
