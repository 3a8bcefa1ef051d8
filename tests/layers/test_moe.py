"""The sparse MoE layer (vlm_sdk/layers/moe.py) against transformers' `Qwen3VLMoeTextSparseMoeBlock` on the
same weights (loaded through the layer's own per-expert slots), in both storage orders (the CPU layout's
transposed experts), the router against transformers' router,
`norm_topk_prob` false (not renormalised: transformers' Qwen3-VL-MoE router always renormalises, so
the formula is the oracle there), and tensor parallelism composed by hand: the ranks' partial outputs
sum to the one-rank output; a width that does not split is refused naming it."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (Qwen3VLMoeTextSparseMoeBlock,
                                                                    Qwen3VLMoeTextTopKRouter)

from tolerance import assert_reduction_close
from vlm_sdk.layers.moe import MoeConfig, SparseMoeBlock, route
from vlm_sdk.layers.ops import TorchOps
from vlm_sdk.layers.parallel_state import TPGroup
from vlm_sdk.weight_loading import load_checked

H, I, E, K = 32, 24, 6, 2


def hf_block(seed: int = 0) -> Qwen3VLMoeTextSparseMoeBlock:
    cfg = Qwen3VLMoeTextConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
    block = Qwen3VLMoeTextSparseMoeBlock(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return block


def per_expert_weights(block: Qwen3VLMoeTextSparseMoeBlock, prefix: str = "mlp.") -> dict[str, torch.Tensor]:
    """transformers' fused experts as the published per-expert tensors."""
    out = {f"{prefix}gate.weight": block.gate.weight.detach()}
    for e in range(E):
        gate, up = block.experts.gate_up_proj[e].detach().chunk(2, dim=0)  # [I, H] x 2
        out.update({f"{prefix}experts.{e}.gate_proj.weight": gate, f"{prefix}experts.{e}.up_proj.weight": up,
                    f"{prefix}experts.{e}.down_proj.weight": block.experts.down_proj[e].detach()})
    return out


def ours(block, tp: TPGroup = TPGroup(), norm_topk_prob: bool = True) -> SparseMoeBlock:
    moe = SparseMoeBlock(H, MoeConfig(E, K, I, norm_topk_prob=norm_topk_prob), TorchOps(), tp=tp)
    load_checked(moe, per_expert_weights(block).items(), moe.slots("mlp.", ""))
    return moe


def tokens(n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def test_router_equals_transformers():
    block = hf_block()
    assert isinstance(block.gate, Qwen3VLMoeTextTopKRouter)
    with torch.no_grad():
        x = tokens()
        _, want_w, want_ids = block.gate(x)
        w, ids = route(torch.nn.functional.linear(x, block.gate.weight), K, renormalize=True)
    assert torch.equal(ids, want_ids) and w.dtype == torch.float32
    torch.testing.assert_close(w, want_w, atol=1e-6, rtol=0)
    loads = torch.bincount(ids.flatten(), minlength=E)
    assert loads.max() > loads.min()  # uneven: a real routing


def test_block_equals_transformers():
    block = hf_block()
    x = tokens()
    with torch.no_grad():
        want = block(x[None])[0]
        got = ours(block)(x)
    assert_reduction_close(got, want, H + I + K)  # gate_up over H, down over I, the K choices summed


def test_the_cpu_layout_stores_each_expert_transposed_with_the_same_outputs():
    """`use_cpu_layout` (models/cpu_layout.py calls it after loading): the same logical experts, each
    stored [in, out], and the block's output unchanged up to the products' reduction order."""
    block = hf_block()
    x = tokens()
    moe = ours(block)
    with torch.no_grad():
        before, (w13, w2) = moe(x), (t.clone() for t in moe.experts())
        moe.use_cpu_layout()
        after = moe(x)
    got13, got2 = moe.experts()
    assert torch.equal(got13, w13) and torch.equal(got2, w2)
    assert got13.transpose(1, 2).is_contiguous() and got2.transpose(1, 2).is_contiguous()
    assert_reduction_close(after, before, H + I + K)


def test_norm_topk_prob_false_keeps_the_softmax_weights():
    block = hf_block()
    x = tokens(8)
    with torch.no_grad():
        probs = torch.softmax(torch.nn.functional.linear(x, block.gate.weight).double(), dim=-1)
        top, ids = probs.topk(K, dim=-1)
        experts = per_expert_weights(block)
        want = torch.zeros(8, H, dtype=torch.float64)
        for t in range(8):
            for j in range(K):
                e = int(ids[t, j])
                g, u, d = (experts[f"mlp.experts.{e}.{n}_proj.weight"].double() for n in ("gate", "up", "down"))
                want[t] += top[t, j] * (torch.nn.functional.silu(g @ x[t].double()) * (u @ x[t].double())) @ d.T
        got = ours(block, norm_topk_prob=False)(x)
        renormalised = ours(block)(x)
    assert_reduction_close(got.double(), want, H + I + K)
    assert (got - renormalised).abs().max() > 1e-2  # the two differ: the flag is honoured


def test_two_ranks_sum_to_one_rank():
    block = hf_block()
    x = tokens()
    with torch.no_grad():
        whole = ours(block)(x)
        parts = [ours(block, TPGroup(r, 2)) for r in range(2)]
        assert parts[0].w13.shape == (E * I, H) and parts[0].w2.shape == (E * H, I // 2)  # I/2 per expert
        summed = sum(p(x) for p in parts)  # no process group: each rank's partial sum, added here
    assert_reduction_close(summed, whole, H + I + K)


def test_a_width_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match=r"moe_intermediate_size .*\(24\) is not divisible by the tensor-parallel "
                                         r"size 5"):
        SparseMoeBlock(H, MoeConfig(E, K, I), TorchOps(), device="meta", tp=TPGroup(0, 5))
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(7\) must be from 1 to num_experts \(6\)"):
        MoeConfig(E, 7, I)
