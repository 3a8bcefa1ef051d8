"""The quantized layers' GPU path (`QuantScheme.kernel_matmul`: kernels/int4_gemm.py, kernels/fp8_block_gemm.py)
against their CPU path (the dequantized weight, F.linear), run here under the Triton interpreter by
forcing `use_kernels`: every format's fused q | k | v (with its bias), gate | up and row-parallel down,
on one rank and on each rank of two (their slices of the packed tensors, GPTQ's g_idx made local to the
rank's scales); block FP8 whose fused parts end in partial blocks (one launch per part); a GPTQ
checkpoint whose g_idx contradicts desc_act false refused at load (the kernel reads groups as k // G);
and on CUDA (-m cuda), the layers picking their kernel by themselves in bfloat16."""
from __future__ import annotations

import os

import pytest
import torch

from test_quantized_linear import FORMATS, HIDDEN, Block, _checkpoint
from tolerance import assert_reduction_close
from vlm_sdk.errors import CheckpointError
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.layers.quantization import quant_scheme
from vlm_sdk.testing.quantizer import quantization_config, quantize_tensors
from vlm_sdk.weight_loading import load_checked

INTERPRETER = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the kernels on the CPU need TRITON_INTERPRET=1 (tests/conftest.py sets it)")
# W8A8 needs CUDA sm_90 (its own test); W4A16 per channel is the group -1 launch test_int4_gemm.py covers
KERNEL_FORMATS = [f for f in FORMATS if f not in ("compressed-tensors", "w4a16_asym_channel")]


def _load(tensors, config, tp: TPGroup) -> Block:
    block = Block(quant_scheme({"quantization_config": config}), tp)
    load_checked(block, tensors.items(), block.slots())
    for layer in (block.qkv, block.gate_up, block.down):
        layer.check_loaded()
    return block


def _run(block: Block, x: torch.Tensor, kernels: bool):
    for layer in (block.qkv, block.gate_up, block.down):
        layer.use_kernels = kernels
    return block(x)


@INTERPRETER
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("tp", [TPGroup(), TPGroup(0, 2), TPGroup(1, 2)], ids=["tp1", "rank0of2", "rank1of2"])
@pytest.mark.parametrize("rows", [3, 24], ids=["decode", "prefill"])
def test_kernels_equal_the_dequantized_product(fmt, tp, rows):
    tensors, _, config = _checkpoint(fmt)
    block = _load(tensors, config, tp)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(dtype)
        block.qkv.bias.data = block.qkv.bias.data.to(dtype)  # the activations' dtype, as a model's layers
        want = _run(block, x, kernels=False)
        got = _run(block, x, kernels=True)
        assert block.qkv.scheme.kernel_matmul(x, block.qkv, None) is not None  # the kernel ran, not a fallback
        for g, w, k in zip(got, want, (HIDDEN, block.down.in_features)):
            assert g.dtype == dtype
            # each product's K terms summed in another order, one rounding to the dtype; down's input is
            # gate_up's output: its error rides along (two chained reductions)
            assert_reduction_close(g.float(), w.float(), HIDDEN + k, storage=dtype, roundings=2, msg=f"{fmt} {dtype}")


@INTERPRETER
def test_fp8_fused_parts_ending_in_partial_blocks():
    """Blocks of 48 output rows over q (64 rows) and k, v (32 each): each part's scales start a new row
    of blocks, so the fused layer launches once per part."""
    method, block = "fp8", (48, 16)
    config = quantization_config(method, block=block)
    g = torch.Generator().manual_seed(4)
    tensors = {}
    for i, (name, rows) in enumerate((("q", 64), ("k", 32), ("v", 32), ("gate", 96), ("up", 96), ("down", 64))):
        cols = 96 if name == "down" else HIDDEN
        tensors.update({f"{name}.{k}": v for k, v in quantize_tensors(method, torch.randn(rows, cols, generator=g),
                                                                          config, seed=i).items()})
    tensors.update({f"{p}.bias": torch.randn(n, generator=g) for p, n in (("q", 64), ("k", 32), ("v", 32))})
    b = _load(tensors, config, TPGroup())
    x = torch.randn(5, HIDDEN, generator=g)
    want, got = _run(b, x, False), _run(b, x, True)
    for gv, wv in zip(got, want):
        assert_reduction_close(gv, wv, 2 * 96, storage=torch.float32, roundings=2)


def test_gptq_g_idx_that_contradicts_desc_act_false_is_refused():
    tensors, _, config = _checkpoint("gptq_sym")
    assert not config["desc_act"]
    perm = torch.randperm(tensors["down.g_idx"].shape[0], generator=torch.Generator().manual_seed(0))
    tensors["down.g_idx"] = tensors["down.g_idx"][perm]
    block = Block(quant_scheme({"quantization_config": config}), TPGroup())
    load_checked(block, tensors.items(), block.slots())
    with pytest.raises(CheckpointError, match=r"down.g_idx orders the input rows .* set desc_act true"):
        block.down.check_loaded()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 40], ids=["decode", "prefill"])
def test_cuda_layers_pick_their_kernel_by_themselves(fmt, rows):
    """On CUDA in bfloat16, with `use_kernels` left unset, each format's layers run their kernel (compressed-
    tensors' W8A8 only on sm_90: elsewhere the dequantized path) and equal the dequantized product."""
    tensors, _, config = _checkpoint(fmt)
    block = _load(tensors, config, TPGroup()).to("cuda")
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to("cuda", torch.bfloat16)
    block.qkv.bias.data = block.qkv.bias.data.to(torch.bfloat16)
    got = _run(block, x, kernels=None)
    want = _run(block, x, kernels=False)
    w8a8 = fmt == "compressed-tensors"
    runs_kernel = block.qkv.scheme.kernel_matmul(x, block.qkv, None) is not None
    assert runs_kernel == (not w8a8 or torch.cuda.get_device_capability()[0] == 9)
    for g, w, k in zip(got, want, (HIDDEN, block.down.in_features)):
        assert g.dtype == torch.bfloat16
        if w8a8 and runs_kernel:  # activations rounded to e4m3 per token: ~2**-4 of each value
            assert (g.float() - w.float()).abs().max() < 0.1 * w.float().abs().max()
        else:
            assert_reduction_close(g.float(), w.float(), HIDDEN + k, storage=torch.bfloat16, roundings=2, msg=fmt)
