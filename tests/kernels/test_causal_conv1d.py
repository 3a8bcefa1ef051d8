"""Causal conv1d over packed requests with states in slots (kernels/causal_conv1d_torch.py, and the Triton
kernels of kernels/causal_conv1d.py) against transformers' Qwen3.5 fallbacks `causal_conv1d_fn` (a
prompt, after its cached columns) and `causal_conv1d_update` (a decode step)."""
from __future__ import annotations

import os

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update

from tolerance import assert_reduction_close
from vlm_sdk.kernels import causal_conv1d_torch as ref

C, K, SLOTS = 40, 4, 6
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
# the torch op, and the Triton one in fp32 and fp16 under the interpreter (numpy has no bf16)
IMPLS = [pytest.param("torch", torch.float32, "cpu", id="torch-fp32"),
         pytest.param("triton", torch.float32, "cpu", id="triton-fp32"),
         pytest.param("triton", torch.float16, "cpu", id="triton-fp16"),
         pytest.param("triton", torch.bfloat16, "cuda", id="triton-cuda-bf16", marks=CUDA_MARKS)]


def _ops(impl: str, device: str):
    if impl == "torch":
        return ref.causal_conv1d_varlen, ref.causal_conv1d_update
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    from vlm_sdk.kernels import causal_conv1d
    return causal_conv1d.causal_conv1d_varlen, causal_conv1d.causal_conv1d_update


def _inputs(lens: list[int], dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x_wide = torch.randn(sum(lens), C + 24, generator=g)  # x is a strided view, as the qkv part of in_proj
    weight = torch.randn(C, K, generator=g) * 0.5
    state = torch.randn(SLOTS, C, K - 1, generator=g)
    return (x_wide.to(device, dtype)[:, 8:8 + C], weight.to(device, dtype), state.to(device, dtype))


def _hf_prompt(x: torch.Tensor, weight: torch.Tensor, init: torch.Tensor | None):
    """transformers on one request: its K - 1 cached columns (zeros without) before its tokens, the conv
    over all, the last len outputs; the new state is the last K - 1 inputs."""
    cols = torch.zeros(C, K - 1, dtype=x.dtype) if init is None else init
    full = torch.cat((cols, x.t()), dim=1)[None]  # [1, C, K - 1 + len]
    out = causal_conv1d_fn(full, weight, None, activation="silu")[0, :, -x.shape[0]:].t()
    return out, full[0, :, -(K - 1):]


@pytest.mark.parametrize("impl,dtype,device", IMPLS)
def test_varlen_conv_equals_transformers_per_request(impl, dtype, device):
    varlen, _ = _ops(impl, device)
    # a short request with a state (len < K - 1: its new state keeps some old columns) and without
    lens, slots, has_init = [5, 1, 9, 2, 2], [2, 0, 5, 3, 1], [True, False, True, False, True]
    x, weight, state = _inputs(lens, dtype, device, seed=1)
    state[[0, 3]] = float("nan")  # the slots of the requests without a state: never read
    before = state.clone()
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    out = varlen(x, weight, None, state, starts, torch.tensor(slots, device=device),
                 torch.tensor(has_init, device=device))
    start = 0
    for n, slot, init in zip(lens, slots, has_init):
        # transformers in float32 on the same values: our op accumulates in float32 too
        want, want_state = _hf_prompt(x[start:start + n].float().cpu(), weight.float().cpu(),
                                      before[slot].float().cpu() if init else None)
        assert_reduction_close(out[start:start + n].float().cpu(), want, K, storage=dtype, roundings=1)
        torch.testing.assert_close(state[slot].float().cpu(), want_state, rtol=0, atol=0)  # inputs, moved
        start += n
    untouched = [s for s in range(SLOTS) if s not in slots]
    assert torch.equal(state[untouched], before[untouched])
    assert float(out.float().std()) > 0.1


@pytest.mark.parametrize("impl,dtype,device", IMPLS)
def test_decode_update_equals_transformers(impl, dtype, device):
    _, update = _ops(impl, device)
    slots, has_init = [4, 1, 2], [True, True, False]
    x, weight, state = _inputs([3], dtype, device, seed=2)
    state[2] = float("nan")  # the slot of the request without a state: never read
    before = state.clone()
    out = update(x, weight, None, state, torch.tensor(slots, device=device), torch.tensor(has_init, device=device))
    for i, (slot, init) in enumerate(zip(slots, has_init)):
        cols = before[slot].float().cpu() if init else torch.zeros(C, K - 1)
        hf_state = torch.cat((torch.zeros(C, 1), cols), dim=1)[None]  # transformers keeps K columns
        want = causal_conv1d_update(x[i:i + 1].float().cpu()[:, :, None], hf_state, weight.float().cpu(), None,
                                    "silu")[0, :, 0]
        assert_reduction_close(out[i].float().cpu(), want, K, storage=dtype, roundings=1)
        torch.testing.assert_close(state[slot].float().cpu(), hf_state[0, :, 1:], rtol=0, atol=0)


@pytest.mark.parametrize("impl,dtype,device", IMPLS)
def test_a_prompt_split_into_steps_equals_the_whole(impl, dtype, device):
    """Chunked prefill: 11 tokens as steps of 4, 1 and 6 (decode rows through the varlen op and the
    update op) continue through the slot and give the whole prompt's outputs and state."""
    varlen, update = _ops(impl, device)
    x, weight, state = _inputs([11], dtype, device, seed=3)
    state[4] = float("nan")
    whole_state = state.clone()
    slot = torch.tensor([4], device=device)
    whole = varlen(x, weight, None, whole_state, torch.tensor([0, 11], dtype=torch.int32, device=device), slot,
                   torch.tensor([False], device=device))
    parts = []
    for a, b, init in ((0, 4, False), (4, 5, True), (5, 11, True)):
        flag = torch.tensor([init], device=device)
        if b - a == 1:
            parts.append(update(x[a:b], weight, None, state, slot, flag))
        else:
            parts.append(varlen(x[a:b], weight, None, state, torch.tensor([0, b - a], dtype=torch.int32,
                                                                             device=device), slot, flag))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)  # the same K products, same order
    torch.testing.assert_close(state[4], whole_state[4], rtol=0, atol=0)


def test_bad_shapes_are_named():
    x, weight, state = _inputs([3], torch.float32, "cpu", seed=4)
    with pytest.raises(ValueError, match=r"conv_state \[6, 40, 4\]"):
        ref.causal_conv1d_update(x, weight, None, torch.zeros(SLOTS, C, K), torch.tensor([0, 1, 2]),
                                 torch.ones(3, dtype=torch.bool))
