"""`vlm-sdk bench --cpu-gemm`: the shapes come from the checkpoint (an MoE's experts are not dense MLP
products), every path is timed at every row count, and each path computes the same product."""
import torch
import torch.nn.functional as F

from tolerance import assert_reduction_close
from vlm_sdk.bench import cpu_gemm


def test_shapes_follow_the_text_config(tiny_checkpoints):
    dense = cpu_gemm.checkpoint_shapes(str(tiny_checkpoints("qwen2_5_vl")))
    assert set(dense) == {"lm_head", "qkv", "o_proj", "gate_up", "down"}
    moe = cpu_gemm.checkpoint_shapes(str(tiny_checkpoints("qwen3_5_moe")))
    assert set(moe) == {"lm_head", "qkv", "o_proj"}
    n, k = dense["gate_up"]
    assert dense["down"] == (k, n // 2)


def test_every_path_is_timed_and_gives_the_product():
    rows = cpu_gemm.run({"head": (96, 32)}, repeats=3, rows=(1, 5))
    assert [r["rows"] for r in rows] == [1, 5]
    for r in rows:
        assert r["F.linear row-major"] > 0 and r["F.linear column-major"] > 0
    weight = torch.randn(96, 32)
    x = torch.randn(5, 32)
    for path in cpu_gemm._paths(weight).values():
        assert_reduction_close(path(x), F.linear(x, weight), 32)
