"""Quantized linear layers (vlm_sdk/layers/quantized_linear.py) on tensors in each published layout
(written by vlm_sdk/testing/quantizer.py): each rank of two loads only its slice of the packed weights,
scales and zeros, and the ranks' results combined by hand equal one rank's, which equals a float layer
holding the dequantized weight; a split that would cut a group, an int32 word or an FP8 block is refused
naming it; config.json's quantization_config fields we do not read are refused by name (W4A16's too)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.layers.quantization import quant_scheme
from vlm_sdk.layers.quantized_linear import (QuantColumnParallelLinear, QuantMergedColumnParallelLinear,
                                             QuantQKVParallelLinear, QuantRowParallelLinear)
from vlm_sdk.testing.quantizer import dequantize, quantization_config, quantize_tensors
from vlm_sdk.weight_loading import load_checked

HIDDEN, HEAD, HEADS, KV, INTER = 64, 16, 4, 2, 96
FORMATS = {"awq": dict(group_size=16), "gptq_sym": dict(group_size=16),
           "gptq_asym_desc_act": dict(group_size=16, sym=False, desc_act=True),
           "gptq_v2": dict(group_size=16, sym=False, v2=True), "fp8": dict(block=(16, 16)),
           "compressed-tensors": {}, "w4a16": dict(group_size=16),
           "w4a16_asym_actorder": dict(group_size=16, sym=False, desc_act=True),
           "w4a16_asym_channel": dict(group_size=-1, sym=False)}


def _method(fmt: str) -> str:
    return fmt.split("_")[0]


def _checkpoint(fmt: str) -> tuple[dict, dict, dict]:
    """(quantized tensors by checkpoint name, dequantized float weights, quantization_config)."""
    method = _method(fmt)
    config = quantization_config(method, **FORMATS[fmt])
    g = torch.Generator().manual_seed(0)
    shapes = {"q": (HEADS * HEAD, HIDDEN), "k": (KV * HEAD, HIDDEN), "v": (KV * HEAD, HIDDEN),
              "gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    tensors, floats = {}, {}
    for i, (name, shape) in enumerate(shapes.items()):
        packed = quantize_tensors(method, torch.randn(*shape, generator=g), config, seed=i)
        tensors.update({f"{name}.{k}": v for k, v in packed.items()})
        floats[name] = dequantize(method, packed, config)
    tensors["q.bias"], tensors["k.bias"], tensors["v.bias"] = (torch.randn(n, generator=g) for n in (64, 32, 32))
    return tensors, floats, config


class Block(torch.nn.Module):
    def __init__(self, scheme, tp: TPGroup):
        super().__init__()
        self.qkv = QuantQKVParallelLinear(HIDDEN, HEAD, HEADS, KV, True, tp=tp, scheme=scheme)
        self.gate_up = QuantMergedColumnParallelLinear(HIDDEN, [INTER, INTER], False, tp=tp, scheme=scheme)
        self.down = QuantRowParallelLinear(INTER, HIDDEN, False, tp=tp, scheme=scheme)

    def slots(self):
        return {**self.qkv.slots("qkv.", ["q.weight", "k.weight", "v.weight"], ["q.bias", "k.bias", "v.bias"]),
                **self.gate_up.slots("gate_up.", ["gate.weight", "up.weight"]),
                **self.down.slots("down.", "down.weight")}

    def forward(self, x):  # [N, HIDDEN] -> (qkv [N, local], this rank's partial of down(silu(gate) * up))
        gate, up = self.gate_up(x).chunk(2, dim=1)
        return self.qkv(x), self.down(F.silu(gate) * up)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_two_ranks_load_their_slices_and_compose_to_one_rank_and_to_the_float_weights(fmt):
    tensors, floats, config = _checkpoint(fmt)
    scheme = quant_scheme({"quantization_config": config})
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))

    def load(tp):
        block = Block(scheme, tp)
        load_checked(block, tensors.items(), block.slots())
        block.qkv.check_loaded()
        block.down.check_loaded()
        return block

    qkv, down = load(TPGroup())(x)
    w = torch.cat([floats["q"], floats["k"], floats["v"]])
    bias = torch.cat([tensors["q.bias"], tensors["k.bias"], tensors["v.bias"]])
    assert torch.equal(qkv, F.linear(x, w, bias))  # the same weight: the same product
    gate, up = F.linear(x, floats["gate"]), F.linear(x, floats["up"])
    assert torch.equal(down, F.linear(F.silu(gate) * up, floats["down"]))

    halves = [load(tp)(x) for tp in (TPGroup(0, 2), TPGroup(1, 2))]
    q, k, v = qkv.split([64, 32, 32], dim=1)
    for r, (part, _) in enumerate(halves):  # each rank: its 2 q heads, its KV head
        assert torch.equal(part, torch.cat([q[:, 32 * r:32 * (r + 1)], k[:, 16 * r:16 * (r + 1)],
                                            v[:, 16 * r:16 * (r + 1)]], dim=1))
    summed = halves[0][1] + halves[1][1]  # the all-reduce, by hand: two partial sums of INTER/2 terms each
    assert (summed - down).abs().max() <= 1e-5 * (down.abs().max() + 1)


def test_a_rank_reads_only_its_slice_of_each_packed_tensor():
    tensors, _, config = _checkpoint("gptq_asym_desc_act")
    block = Block(quant_scheme({"quantization_config": config}), TPGroup(1, 2))
    slots = block.slots()
    # row-parallel down: its half of the packed input rows and of g_idx; desc_act keeps every group's scales
    assert slots["down.qweight"].shard.dim == 0 and slots["down.qweight"].loaded_shape == (INTER // 16, HIDDEN)
    assert slots["down.g_idx"].loaded_shape == (INTER // 2,)
    assert slots["down.scales"].shard is None and block.down.scales.shape == (INTER // 16, HIDDEN)
    # column-parallel k: its KV head's 16 output columns, 2 int32 words of zeros
    assert slots["k.qzeros"].loaded_shape == (HIDDEN // 16, 2) and slots["k.qzeros"].shard.start == 2


@pytest.mark.parametrize("fmt, size, needle", [
    ("awq", 4, "input features: this rank's slice [24, 48) of 96 cuts an index of awq's qzeros, which holds 16"),
    ("fp8", 4, "output features: this rank's slice [24, 48) of 96 cuts an index of fp8's weight_scale_inv, which "
               "holds 16"),
    ("w4a16", 4, "input features: this rank's slice [24, 48) of 96 cuts an index of compressed-tensors's "
                 "weight_scale, which holds 16"),
])
def test_a_split_that_cuts_a_group_is_refused_naming_it(fmt, size, needle):
    scheme = quant_scheme({"quantization_config": quantization_config(_method(fmt), **FORMATS[fmt])})
    with pytest.raises(ValueError) as e:
        Block(scheme, TPGroup(1, size))
    assert needle in str(e.value)


@pytest.mark.parametrize("change, needle", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported; supported: awq, gptq, fp8"),
    ({"bits": 3}, "(awq) bits=3 is not supported; supported: 4"),
    ({"group_size": 0}, "(awq) group_size=0 is not supported"),
    ({"version": "gemv"}, "(awq) version='gemv' is not supported; supported: 'gemm'"),
    ({"zero_point": False}, "(awq) zero_point=False is not supported"),
])
def test_awq_config_fields_we_cannot_read_are_refused_by_name(change, needle):
    with pytest.raises(CheckpointError) as e:
        quant_scheme({"quantization_config": {**quantization_config("awq"), **change}})
    assert needle in str(e.value)


@pytest.mark.parametrize("method, change, needle", [
    ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format='marlin' is not supported"),
    ("gptq", {"lm_head": True}, "lm_head=True is not supported"),
    ("gptq", {"bits": 8}, "(gptq) bits=8 is not supported; supported: 4"),
    ("fp8", {"fmt": "e5m2"}, "fmt='e5m2' is not supported"),
    ("fp8", {"weight_block_size": None}, "has no 'weight_block_size'"),
    ("fp8", {"activation_scheme": "static"}, "activation_scheme='static' is not supported"),
])
def test_gptq_and_fp8_config_fields_we_cannot_read_are_refused_by_name(method, change, needle):
    config = {k: v for k, v in {**quantization_config(method), **change}.items() if v is not None}
    with pytest.raises(CheckpointError) as e:
        quant_scheme({"quantization_config": config})
    assert needle in str(e.value)


@pytest.mark.parametrize("weights, group, needle", [
    ({"num_bits": 8}, {}, "weights.num_bits=8 is not supported; supported: 4 (pack-quantized W4A16)"),
    ({"type": "float"}, {}, "weights.type='float' is not supported; supported: 'int'"),
    ({"strategy": "tensor"}, {}, "weights.strategy='tensor' is not supported; supported: 'group' or 'channel'"),
    ({"group_size": 0}, {}, "weights.group_size=0 is not supported"),
    ({"actorder": "random"}, {}, "weights.actorder='random' is not supported"),
    ({}, {"input_activations": {"num_bits": 8, "type": "int", "dynamic": True}},
     "input_activations='{...}' is not supported; supported: none (pack-quantized W4A16 is weight-only)"),
    ({}, {"format": "marlin-24"}, "format='marlin-24' is not supported; supported: 'float-quantized' with 8-bit "
                                  "float weights (FP8) or 'pack-quantized' with 4-bit int weights (W4A16)"),
])
def test_compressed_tensors_w4a16_fields_we_cannot_read_are_refused_by_name(weights, group, needle):
    config = quantization_config("w4a16")
    config["config_groups"]["group_0"]["weights"].update(weights)
    config["config_groups"]["group_0"].update(group)
    with pytest.raises(CheckpointError) as e:
        quant_scheme({"quantization_config": config})
    assert needle in str(e.value)


def test_compressed_tensors_w4a16_config_names_its_layout():
    base = quantization_config("w4a16", group_size=128)
    assert quant_scheme({"quantization_config": base}).description == \
        "W4A16 int4 (compressed-tensors pack-quantized), group 128, sym"
    asym = quantization_config("w4a16", group_size=-1, sym=False)
    scheme = quant_scheme({"quantization_config": asym})
    assert scheme.description == "W4A16 int4 (compressed-tensors pack-quantized), per channel, asym"
    suffixes = [t.suffix for t in scheme.tensors()]
    assert suffixes == ["weight_packed", "weight_scale", "weight_shape", "weight_zero_point"]
    # actorder "weight" (alias "static") stores the columns in order: no weight_g_idx to read
    base["config_groups"]["group_0"]["weights"]["actorder"] = "static"
    assert not quant_scheme({"quantization_config": base}).actorder
    assert scheme.skips("model.visual.blocks.0.attn.qkv") and scheme.skips("lm_head")
    # the scales in the model's dtype (as vLLM holds them); the packed words and shapes as published
    layer = QuantColumnParallelLinear(64, 32, False, torch.bfloat16, "meta", scheme=scheme)
    assert (layer.weight_scale.dtype, layer.weight_packed.dtype, layer.weight_shape.dtype) == \
        (torch.bfloat16, torch.int32, torch.int64)
    assert (layer.weight_scale.shape, layer.weight_zero_point.shape, layer.weight_shape.shape) == ((32, 1), (4, 1), (2,))


def test_g_idx_outside_the_groups_is_a_checkpoint_error_naming_the_tensor():
    tensors, _, config = _checkpoint("gptq_asym_desc_act")
    tensors["down.g_idx"] = tensors["down.g_idx"] + 3
    block = Block(quant_scheme({"quantization_config": config}), TPGroup())
    load_checked(block, tensors.items(), block.slots())
    with pytest.raises(CheckpointError, match=r"down.g_idx holds groups 3..8, outside the 6 groups"):
        block.down.check_loaded()
