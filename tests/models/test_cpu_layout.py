"""CPU weight layouts change speed only: every product equals F.linear on the original weight."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tolerance import assert_reduction_close
from vlm_sdk.layers.cpu_gemm import onednn_available, onednn_linear
from vlm_sdk.models.cpu_layout import OneDnnLMHead, PackedLMHead, column_major, use_cpu_weight_layout


def test_column_major_keeps_values_and_shape():
    lin = nn.Linear(48, 80)
    x = torch.randn(5, 48)
    before = lin(x)
    use_cpu_weight_layout(lin)
    assert lin.weight.shape == (80, 48) and lin.weight.t().is_contiguous()
    assert_reduction_close(lin(x), before, 48)  # another summation order of the same 48 products
    w = torch.randn(7, 3)
    assert torch.equal(column_major(w), w)


@pytest.mark.parametrize("rows", [1, 2, 3, 15, 16, 17, 40])
def test_packed_head_equals_linear_at_any_row_count(rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 64, generator=g)
    head = PackedLMHead.create(weight)
    if head is None:
        pytest.skip("this torch build has no MKL packed GEMM; the engine falls back to F.linear")
    x = torch.randn(rows, 64, generator=g)
    assert_reduction_close(head(x), F.linear(x, weight), 64)
    assert head(x).shape == (rows, 1000)


def test_packed_head_refuses_other_dtypes():
    assert PackedLMHead.create(torch.randn(100, 32).bfloat16()) is None


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_onednn_head_is_the_same_product_within_the_reduction_bound(rows):
    if not onednn_available():
        pytest.skip("this torch build has no oneDNN; the engine keeps MKL's packed head or F.linear")
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 64, generator=g)
    x = torch.randn(rows, 64, generator=g)
    assert OneDnnLMHead.applies(weight) and not OneDnnLMHead.applies(weight.bfloat16())
    assert_reduction_close(OneDnnLMHead(weight)(x), F.linear(x, weight), 64)
    with torch.enable_grad():  # a graph to record: F.linear, which has a backward
        w = weight.clone().requires_grad_()
        onednn_linear(x, w).sum().backward()
    assert torch.allclose(w.grad, x.sum(0).expand(1000, 64), atol=1e-5)  # 40 float32 terms a sum


def test_an_untied_float32_head_stays_row_major_for_onednn():
    from vlm_sdk.layers.embedding import ParallelLMHead
    head = ParallelLMHead(100, 16)
    nn.init.normal_(head.weight)
    lin = nn.Linear(16, 8)
    model = nn.ModuleList([head, lin])
    use_cpu_weight_layout(model)
    assert head.weight.is_contiguous() == onednn_available()
    assert lin.weight.t().is_contiguous()
