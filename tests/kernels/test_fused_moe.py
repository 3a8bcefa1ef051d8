"""fused_moe (Triton) against fused_moe_ref, the reference against a float64 per-token formula, and the
align step's layout: uneven expert loads, an expert no token chose, top-k 1, 2 and 8, a partial column
tile (I = 40, H = 48 over 16-wide tiles); on the CPU under the interpreter in float32 and float16 (the
interpreter's stand-in for bf16), on a GPU (-m cuda) in bf16, fp16 and fp32."""
from __future__ import annotations

import os

import pytest
import torch

from tolerance import assert_reduction_close
from vlm_sdk.kernels.fused_moe import fused_moe, moe_align
from vlm_sdk.kernels.fused_moe_torch import fused_moe_ref

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.float16, id="cpu-fp16")] + [
    pytest.param("cuda", dt, marks=CUDA_MARKS, id=f"cuda-{str(dt)[6:]}")
    for dt in (torch.bfloat16, torch.float16, torch.float32)]
H, I = 48, 40
# name -> (tokens, experts, top_k): top-k 1, 2 and 8 (8 of 10 experts), one step past the 32-token tile switch
ROUTINGS = {"top1": (9, 6, 1), "top2": (37, 8, 2), "top8": (5, 10, 8)}


def need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def routing(tokens: int, experts: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, K] float32, ids [N, K]): distinct experts per token, drawn unevenly (expert e with
    weight e + 1) and never expert 2, so loads differ and one expert has no rows."""
    g = torch.Generator().manual_seed(seed)
    odds = torch.arange(1, experts + 1, dtype=torch.float64)
    odds[2] = 0
    ids = torch.stack([torch.multinomial(odds, top_k, generator=g) for _ in range(tokens)])  # [N, K]
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return weights / weights.sum(dim=1, keepdim=True), ids


def operands(tokens, experts, top_k, dtype, device, seed: int = 0, inter: int = I):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(experts, 2 * inter, H, generator=g) * 0.3
    w2 = torch.randn(experts, H, inter, generator=g) * 0.3
    weights, ids = routing(tokens, experts, top_k, seed)
    return [t.to(device, dtype) for t in (x, w13, w2)] + [weights.to(device), ids.to(device)]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_fused_moe_matches_ref(device, dtype, name):
    need_triton(device)
    tokens, experts, top_k = ROUTINGS[name]
    x, w13, w2, weights, ids = operands(tokens, experts, top_k, dtype, device)
    loads = torch.bincount(ids.flatten().cpu(), minlength=experts)
    assert loads[2] == 0 and loads.max() > loads[loads > 0].min()  # an empty expert, uneven loads
    got = fused_moe(x, w13, w2, weights, ids)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    assert got.shape == (tokens, H) and got.dtype == dtype
    # both accumulate in float32; the reference rounds gate and up to the dtype before SiLU-and-mul
    assert_reduction_close(got.float(), want.float(), H + I + top_k, storage=dtype)


@pytest.mark.parametrize("config", [(64, 32, 64, 4, 1), (16, 64, 16, 4, 1)])
def test_the_gpu_tiles_match_ref_too(config, monkeypatch):
    """The interpreter with the GPU's tile shapes (64-row blocks; a wide column tile over I = 40): the
    block padding and the partial tiles of each, not only the interpreter's own 16-row tiles."""
    need_triton("cpu")
    from vlm_sdk.kernels import fused_moe as module
    monkeypatch.setattr(module, "moe_launch_config", lambda x: config)
    x, w13, w2, weights, ids = operands(*ROUTINGS["top2"], torch.float32, "cpu")
    assert_reduction_close(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids),
                           H + I + 2, storage=torch.float32)


# I = 37: down's rows (37 x 4 bytes apart) break grouped_mm's 16-byte stride rule, and so do gate_up's
# [in, out] rows (74 apart): one product per expert for those
@pytest.mark.parametrize("inter,transposed,grouped", [(I, False, 2), (I, True, 2), (37, False, 1), (37, True, 0)],
                         ids=["out-in", "in-out", "out-in-37", "in-out-37"])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_ref_matches_the_formula(name, inter, transposed, grouped, monkeypatch):
    """The reference's two ways on the CPU: one grouped product per weight (`grouped` of the two), or,
    with strides grouped_mm refuses, one product per expert with rows; with the weights stored as the
    checkpoint's [out, in] or as the CPU layout's [in, out] (vlm_sdk/layers/moe.py `use_cpu_layout`)."""
    calls = []
    real = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    tokens, experts, top_k = ROUTINGS[name]
    x, w13, w2, weights, ids = operands(tokens, experts, top_k, torch.float32, "cpu", seed=3, inter=inter)
    if transposed:
        w13, w2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w13, w2))
    want = formula(x, w13, w2, weights, ids)
    assert_reduction_close(fused_moe_ref(x, w13, w2, weights, ids).double(), want, H + inter + top_k,
                           storage=torch.float32)
    assert len(calls) == grouped


def formula(x, w13, w2, weights, ids) -> torch.Tensor:
    """[N, H] float64: per token, its routed experts' weighted sum; a pair of id -1 is skipped."""
    inter = w2.shape[2]
    want = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gate_up = w13[e].double() @ x[t].double()  # [2I]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            want[t] += weights[t, j].double() * (w2[e].double() @ act)
    return want


@pytest.mark.parametrize("device,dtype", CASES)
def test_pairs_of_another_ranks_experts_add_nothing(device, dtype):
    """Expert parallelism: pairs whose expert another rank holds come as id -1 (a token with all its
    pairs there included); both ops skip them, the rest as the formula."""
    tokens, experts, top_k = ROUTINGS["top2"]
    x, w13, w2, weights, ids = operands(tokens, experts, top_k, dtype, device, seed=4)
    ids = torch.where(ids >= experts // 2, -1, ids)  # the lower half of the experts are this rank's
    ids[0] = -1
    assert (ids >= 0).any() and (ids < 0).any()
    want = formula(*(t.cpu().float() for t in (x, w13, w2)), weights.cpu(), ids.cpu())
    assert want[0].abs().max() == 0
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    assert ref[0].abs().max() == 0
    if dtype == torch.float32:  # the reference's own check, as test_ref_matches_the_formula's
        assert_reduction_close(ref.cpu().double(), want, H + I + top_k, storage=dtype)
    if device != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        got = fused_moe(x, w13, w2, weights, ids)
        assert_reduction_close(got.cpu().double(), ref.cpu().double(), H + I + top_k, storage=dtype)
        assert got[0].abs().max() == 0


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_sorts_and_pads_every_pair_once(block_m):
    _, ids = routing(11, 7, 3, seed=5)
    pairs, blocks = moe_align(ids, 7, block_m)
    p = ids.numel()
    assert pairs.shape[0] == -(-(p + 7 * (block_m - 1)) // block_m) * block_m and pairs.dtype == torch.int32
    real = pairs[pairs < p]
    assert sorted(real.tolist()) == list(range(p))  # every pair once
    flat = ids.flatten()
    for b, expert in enumerate(blocks.tolist()):
        rows = pairs[b * block_m:(b + 1) * block_m]
        rows = rows[rows < p]
        if expert < 0:
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows.long()] == expert).all()
            assert torch.equal(rows, rows.sort().values)  # stable: pairs of one expert in order
    used = [e for e in blocks.tolist() if e >= 0]
    assert used == sorted(used)  # runs in expert order
    assert set(used) == set(flat.tolist())  # a block for every chosen expert, none for an unchosen one
    assert 2 not in used  # `routing` never picks expert 2


def test_no_tokens_and_bad_inputs():
    x, w13, w2, weights, ids = operands(4, 6, 2, torch.float32, "cpu")
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, H)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13[:, :, :8], w2, weights, ids)
    with pytest.raises(ValueError, match=r"both be \[4, K\]"):
        fused_moe(x, w13, w2, weights[:2], ids)
    with pytest.raises(ValueError, match="float32"):
        fused_moe(x, w13, w2, weights.half(), ids)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused_moe(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)


def test_a_step_launches_two_products_and_reads_nothing_back():
    """On "meta" tensors (no data: any read of device values on the host would raise) a 30B-A3B-sized
    step records exactly two launches, the gated product then the weighted one: nothing stops a CUDA
    graph from capturing it, and no per-expert launch loop."""
    from aot_compile import META, QWEN3_30B_A3B, record
    experts, top_k, hidden, inter = QWEN3_30B_A3B
    bf16 = torch.bfloat16
    for tokens in (1, 64):
        launches = record(lambda: fused_moe(
            torch.empty(tokens, hidden, dtype=bf16, device=META),
            torch.empty(experts, 2 * inter, hidden, dtype=bf16, device=META),
            torch.empty(experts, hidden, inter, dtype=bf16, device=META),
            torch.empty(tokens, top_k, device=META), torch.empty(tokens, top_k, dtype=torch.int64, device=META)))
        assert [(kw["GATED"], kw["WEIGHTED"]) for _, _, kw in launches] == [(True, False), (False, True)]
        assert {kw["BLOCK_M"] for _, _, kw in launches} == {16 if tokens <= 32 else 64}


# block-wise FP8 experts: 20 x 32 blocks over I = 40, H = 48 (partial blocks along H and along down's I;
# the interpreter's 16 x 32 tiles and the GPU's 64 x 64 ones straddle them)
FP8_BLOCK = (20, 32)


def fp8_operands(tokens, experts, top_k, dtype, seed: int = 0):
    """The float operands with w13 and w2 quantized per expert by the reference quantizer, and the same
    weights dequantized per expert by kernels/dequant_torch.py (the 2-D formula, not the op's)."""
    from vlm_sdk.kernels.dequant_torch import dequantize_fp8_block
    from vlm_sdk.kernels.fused_moe_torch import ExpertScales
    from vlm_sdk.testing.quantizer import quantize_fp8_block
    x, w13, w2, weights, ids = operands(tokens, experts, top_k, torch.float32, "cpu", seed)
    q13 = [quantize_fp8_block(w, FP8_BLOCK) for w in w13]
    q2 = [quantize_fp8_block(w, FP8_BLOCK) for w in w2]
    stack = lambda qs, key: torch.stack([q[key] for q in qs])  # noqa: E731
    float13 = torch.stack([dequantize_fp8_block(q["weight"], q["weight_scale_inv"], FP8_BLOCK) for q in q13])
    float2 = torch.stack([dequantize_fp8_block(q["weight"], q["weight_scale_inv"], FP8_BLOCK) for q in q2])
    scales = ExpertScales(stack(q13, "weight_scale_inv"), stack(q2, "weight_scale_inv"), FP8_BLOCK)
    return x.to(dtype), stack(q13, "weight"), stack(q2, "weight"), weights, ids, scales, float13, float2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("config", [None, (64, 64, 64, 4, 1)])
def test_fp8_experts_match_ref(name, dtype, config, monkeypatch):
    """The kernel dequantizing each FP8 tile by its blocks' scales equals the reference (which
    dequantizes whole experts first), with the interpreter's tiles and the GPU's bf16/fp16 tiles."""
    need_triton("cpu")
    if config is not None:
        from vlm_sdk.kernels import fused_moe as module
        monkeypatch.setattr(module, "moe_launch_config", lambda x: config)
    x, w13, w2, weights, ids, scales, _, _ = fp8_operands(*ROUTINGS[name], dtype)
    assert w13.dtype == w2.dtype == torch.float8_e4m3fn
    got = fused_moe(x, w13, w2, weights, ids, scales)
    want = fused_moe_ref(x, w13, w2, weights, ids, scales)
    assert got.dtype == dtype
    assert_reduction_close(got.float(), want.float(), H + I + ROUTINGS[name][2], storage=dtype)


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_fp8_ref_equals_the_float_op_on_the_dequantized_weights(name):
    """Exactly: the reference dequantizes to the float weights kernels/dequant_torch.py gives, then runs
    the float path."""
    x, w13, w2, weights, ids, scales, float13, float2 = fp8_operands(*ROUTINGS[name], torch.float32, seed=2)
    assert torch.equal(fused_moe_ref(x, w13, w2, weights, ids, scales),
                       fused_moe_ref(x, float13, float2, weights, ids))


def test_fp8_bad_scales_are_refused():
    from vlm_sdk.kernels.fused_moe_torch import ExpertScales
    x, w13, w2, weights, ids, scales, float13, float2 = fp8_operands(4, 6, 2, torch.float32)
    with pytest.raises(ValueError, match=r"float8_e4m3fn \(they have block scales\)"):
        fused_moe_ref(x, float13, float2, weights, ids, scales)
    with pytest.raises(ValueError, match=r"do not fit the block \[20, 32\]: need \[6, 4, 2\] and \[6, 3, 2\]"):
        fused_moe_ref(x, w13, w2, weights, ids, ExpertScales(scales.w13[:, :2], scales.w2, FP8_BLOCK))
    with pytest.raises(ValueError, match="intermediate size 40 is not a multiple of the FP8 block's 16 rows"):
        fused_moe_ref(x, w13, w2, weights, ids, ExpertScales(scales.w13, scales.w2, (16, 32)))
