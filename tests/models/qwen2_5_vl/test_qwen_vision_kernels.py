"""The Qwen2.5-VL vision tower on the Triton kernel set (the interpreter on the CPU): equal to
transformers' visual within 1e-4 in float32, close to the torch kernel set in float16; and both sets run
the tower through the set's kernels, one rotary, one silu_and_mul and two fused add+RMSNorms per block
and a single plain RMSNorm (the first norm1): nothing is left as separate residual adds."""
from __future__ import annotations

import os

import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from tolerance import assert_reduction_close, forward_terms
from vlm_sdk.layers.ops import make_ops
from vlm_sdk.model_loader import iter_safetensors, read_checkpoint
from vlm_sdk.models.qwen2_5_vl.vision import Qwen2_5_VisionTransformer
from vlm_sdk.weight_loading import load_checked

GRIDS = [(1, 8, 12), (1, 4, 4)]  # several windows of 16 / 8 units, and one small window
# the tiny Qwen2.5-VL tower's chain (tests/tolerance.py): 1,176-input patches, 2 blocks of width 32 over at
# most 128 patches, a merger of inputs 128 + 128
TERMS = forward_terms(layers=0, hidden=0, intermediate=0, tokens=0, patch=1176, vision_layers=2, vision_hidden=32,
                      vision_intermediate=64, vision_tokens=128, merger=256)


def close(actual, expected):
    assert_reduction_close(actual, expected, TERMS)


def need_triton() -> None:
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1 (tests/conftest.py sets it)")


def tower(ckpt, backend: str, dtype=torch.float32, device: str = "cpu") -> Qwen2_5_VisionTransformer:
    vc = read_checkpoint(ckpt).hf_config.vision_config
    t = Qwen2_5_VisionTransformer(vc, dtype=dtype, device=device, ops=make_ops(backend, torch.device(device)))
    weights = ((k, v.to(dtype)) for k, v in iter_safetensors(ckpt, show_progress=False) if k.startswith("visual."))
    load_checked(t, weights, t.checkpoint_map("visual."))
    return t.eval()


def pixels(seed: int = 0) -> torch.Tensor:  # [patches, 3 * 2 * 14 * 14]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in GRIDS), 3 * 2 * 14 * 14, generator=g)


def count_calls(ops, names=("rms_norm", "add_rms_norm", "silu_and_mul", "rotary")) -> dict[str, int]:
    """Wrap the set's ops on this instance (every block holds the same set) and count their calls."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        def wrapped(*args, _name=name, _f=getattr(ops, name), **kw):
            counts[_name] += 1
            return _f(*args, **kw)
        setattr(ops, name, wrapped)
    return counts


def test_triton_kernel_set_tower_matches_transformers(tiny_ckpt):
    need_triton()
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    ours = tower(tiny_ckpt, "triton")
    counts = count_calls(ours.ops)
    pv = pixels()
    with torch.no_grad():
        ref = hf.model.visual(pv, grid_thw=torch.tensor(GRIDS)).pooler_output
        got = ours(pv, GRIDS)
    close(got, ref)
    depth = len(ours.blocks)
    assert counts == {"rms_norm": 1, "add_rms_norm": 2 * depth, "silu_and_mul": depth, "rotary": depth}


def test_float16_triton_set_close_to_torch_set(tiny_ckpt):
    """float16 stands in for bfloat16 under the interpreter (numpy has no bfloat16)."""
    need_triton()
    pv = pixels(1)
    with torch.no_grad():
        ref32 = tower(tiny_ckpt, "torch")(pv, GRIDS)
        ref = tower(tiny_ckpt, "torch", torch.float16)(pv.half(), GRIDS)
        got = tower(tiny_ckpt, "triton", torch.float16)(pv.half(), GRIDS)
    assert got.dtype == torch.float16
    # the two float16 paths round differently (float32 inside the kernels): each within float16's reach
    # of the float32 result, and of each other
    scale = ref32.abs().max().item()
    for out in (ref, got):
        assert (out.float() - ref32).abs().max().item() <= 3e-3 * scale
    assert (got.float() - ref.float()).abs().max().item() <= 3e-3 * scale


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bfloat16_tower_compiled_kernels_close_to_float32(tiny_ckpt):
    """On a GPU: the compiled kernels in bfloat16 (the dtype served) within bfloat16's reach of the
    float32 torch result, as the torch set's bfloat16 is."""
    pv = pixels(2)
    with torch.no_grad():
        ref32 = tower(tiny_ckpt, "torch")(pv, GRIDS)
        got = tower(tiny_ckpt, "triton", torch.bfloat16, "cuda")(pv.cuda().bfloat16(), GRIDS).float().cpu()
        ref = tower(tiny_ckpt, "torch", torch.bfloat16, "cuda")(pv.cuda().bfloat16(), GRIDS).float().cpu()
    scale = ref32.abs().max().item()
    assert (ref - ref32).abs().max().item() <= 3e-2 * scale
    assert (got - ref32).abs().max().item() <= 3e-2 * scale
