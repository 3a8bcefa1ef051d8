"""varlen_attention (Triton) against its torch reference, and the reference against a naive formula.

q, k, v are strided views of one packed qkv tensor, as the vision tower produces them, and `out` is NaN-poisoned
so an unwritten element fails."""
import math
import os

import pytest
import torch

from tolerance import assert_reduction_close, attention_terms
from vlm_sdk.kernels.varlen_attention import head_split, varlen_attention, varlen_attention_ref

devices = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                              pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device")])]

# fp16 on the CPU: the interpreter's stand-in for bf16 (its bf16 tl.dot is wrong: numpy has no bf16)
CPU_DTYPES = [torch.float32, torch.float16]
SEGMENTS = {
    # a single token, lengths off and on the 32-key tile, a window-sized one
    "mixed": [1, 37, 64, 5, 16],
    "one_long": [150],
    "single_token": [1],
}
# (num_heads, num_kv_heads, head_dim); Qwen2.5-VL's vision tower is head_dim 80, no GQA; 72 and 40 have a
# partly masked tail (64 + 16, 32 + 16)
CONFIGS = [(4, 4, 64), (4, 4, 80), (2, 2, 128), (4, 2, 80), (2, 1, 72), (2, 2, 40)]


def _skip_without_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def _make_batch(lengths, num_heads, num_kv_heads, head_dim, dtype, device, seed):
    """q, k, v as views of a packed [N, H + 2Hkv, D] projection, and cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), num_heads + 2 * num_kv_heads, head_dim, generator=g).to(device=device,
                                                                                           dtype=dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)  # strided, last dim contiguous
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return q, k, v, cu_seqlens


def _naive(q, k, v, cu_seqlens, scale):
    """Query by query in float64: softmax over the keys of its own segment, times their values."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        for i in range(start, end):
            for h in range(q.shape[1]):
                keys, values = k[start:end, h // group].double(), v[start:end, h // group].double()  # [L, D]
                out[i, h] = torch.softmax(keys @ q[i, h].double() * scale, 0) @ values
    return out


@pytest.mark.parametrize("segments", list(SEGMENTS))
def test_reference_matches_naive_formula(segments):
    lengths = SEGMENTS[segments]
    q, k, v, cu = _make_batch(lengths, 2, 1, 16, torch.float32, "cpu", seed=1)
    out = varlen_attention_ref(q, k, v, cu, max(lengths), 0.3)
    assert_reduction_close(out.double(), _naive(q, k, v, cu, 0.3), attention_terms(16, max(lengths)), torch.float32,
                           roundings=2)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "h{}_kv{}_d{}".format(*c))
@pytest.mark.parametrize("segments", list(SEGMENTS))
@pytest.mark.parametrize("device", devices)
def test_kernel_matches_reference(device, segments, config):
    _skip_without_triton(device)
    num_heads, num_kv_heads, head_dim = config
    lengths = SEGMENTS[segments]
    dtypes = CPU_DTYPES if device == "cpu" else [torch.bfloat16, torch.float16, torch.float32]
    for dtype in dtypes:
        q, k, v, cu = _make_batch(lengths, num_heads, num_kv_heads, head_dim, dtype, device,
                                  seed=10 * list(SEGMENTS).index(segments) + CONFIGS.index(config))
        scale = 1 / math.sqrt(head_dim)
        out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
        assert varlen_attention(q, k, v, cu, max(lengths), scale, out=out) is out
        ref = varlen_attention_ref(q, k, v, cu, max(lengths), scale)
        assert not out.isnan().any()
        assert_reduction_close(out.float(), ref.float(), attention_terms(head_dim, max(lengths)), dtype, roundings=2)


@pytest.mark.parametrize("device", devices)
def test_unbind_views_and_allocated_out(device):
    """The vision tower's layout: qkv [N, 3, H, D] unbound on dim 1; without out= a contiguous output is
    allocated; a padded max_seqlen only adds empty programs."""
    _skip_without_triton(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(5)
    lengths = [9, 40, 1]
    qkv = torch.randn(sum(lengths), 3, 4, 80, generator=g).to(device=device, dtype=dtype)
    q, k, v = qkv.unbind(1)  # [N, H, D] each, row stride 3 * H * D
    cu = torch.tensor([0, 9, 49, 50], dtype=torch.int32, device=device)
    out = varlen_attention(q, k, v, cu, 64, 80 ** -0.5)
    assert out.is_contiguous() and out.shape == q.shape
    ref = varlen_attention_ref(q, k, v, cu, 64, 80 ** -0.5)
    assert_reduction_close(out.float(), ref.float(), attention_terms(80, max(lengths)), dtype, roundings=2)


def test_rejects_bad_inputs():
    q, k, v, cu = _make_batch([3, 2], 4, 2, 64, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="multiple"):
        varlen_attention(q[:, :3], k, v, cu, 3, 0.1)
    with pytest.raises(ValueError, match="do not match"):
        varlen_attention(q, k[:4], v[:4], cu, 3, 0.1)
    with pytest.raises(ValueError, match="out"):
        varlen_attention(q, k, v, cu, 3, 0.1, out=torch.empty(5, 4, 32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention(q, k, v, cu.float(), 3, 0.1)


@pytest.mark.parametrize("head_dim,split", [(80, (64, 16)), (64, (64, 0)), (128, (128, 0)), (96, (64, 32)),
                                            (72, (64, 16)), (40, (32, 16)), (100, (128, 0)), (16, (16, 0)),
                                            (8, (16, 0))])
def test_head_split_covers_the_head_with_least_padding(head_dim, split):
    """80 runs as 64 + 16 columns (no padding; one 128 block would be 1.6x the dot math); a split that
    saves nothing (100 -> 64 + 64) keeps one block."""
    assert head_split(head_dim) == split
    lo, tail = split
    assert lo + tail >= head_dim and lo & (lo - 1) == 0 and (tail == 0 or tail >= 16)
