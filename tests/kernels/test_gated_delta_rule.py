"""The gated delta rule over packed requests with states in slots (kernels/gated_delta_rule_torch.py and
the Triton kernels gated_delta_rule_chunk.py / gated_delta_rule_recurrent.py) against transformers'
Qwen3.5 fallbacks `torch_chunk_gated_delta_rule` (a prompt) and `torch_recurrent_gated_delta_rule` (a
decode step): outputs and final states, varlen packing with mixed has_initial_state, and any split of
a prompt into steps giving the whole prompt's outputs and state."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                          torch_recurrent_gated_delta_rule)

from tolerance import assert_reduction_close
from vlm_sdk.kernels import gated_delta_rule_torch as ref

HK, HV, DK, DV, SLOTS = 2, 4, 32, 16, 5
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
IMPLS = [pytest.param("torch", torch.float32, "cpu", id="torch-fp32"),
         pytest.param("triton", torch.float32, "cpu", id="triton-fp32"),
         pytest.param("triton", torch.float16, "cpu", id="triton-fp16"),
         pytest.param("triton", torch.bfloat16, "cuda", id="triton-cuda-bf16", marks=CUDA_MARKS)]


def _ops(impl: str, device: str):
    """(chunked prefill op, decode op) with the torch op's signature."""
    if impl == "torch":
        return ref.chunk_gated_delta_rule, ref.recurrent_gated_delta_rule
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    from vlm_sdk.kernels import gated_delta_rule_chunk, gated_delta_rule_recurrent

    def chunk(q, k, v, g, beta, state, query_lens, slots, has_init):
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
        return gated_delta_rule_chunk.chunk_gated_delta_rule(q, k, v, g, beta, state, starts, max(query_lens),
                                                             slots, has_init)
    return chunk, gated_delta_rule_recurrent.recurrent_gated_delta_rule


def _inputs(t: int, dtype, device, seed: int):
    """q, k, v, g, beta as the layer makes them (g = -exp(A_log) softplus(a + dt_bias) in float32, beta a
    sigmoid in the model dtype), and a state tensor of random slots."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(t, HV, DV, generator=gen)
    g = -torch.empty(HV).uniform_(0.5, 4, generator=gen) * F.softplus(torch.randn(t, HV, generator=gen) - 1)
    beta = torch.rand(t, HV, generator=gen)
    state = torch.randn(SLOTS, HV, DK, DV, generator=gen) * 0.5
    cast = [x.to(device, dtype) for x in (q, k, v)]
    return (*cast, g.to(device), beta.to(device, dtype), state.to(device))


def _hf(fn, q, k, v, g, beta, init):
    """transformers on one request, on our inputs as float32 (its fallbacks compute in float32)."""
    f = [x.float().cpu()[None] for x in (q, k, v, g, beta)]
    out, state = fn(*f, initial_state=None if init is None else init.cpu()[None], output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
    return out[0], state[0]


def _terms(tokens: int) -> int:
    """Additions along the longest chain: a state entry sums over the tokens (and a chunk's solve over
    64 rows), an output over Dk of it."""
    return DK + tokens + 2 * ref.CHUNK


@pytest.mark.parametrize("impl,dtype,device", IMPLS)
def test_packed_requests_equal_transformers_per_request(impl, dtype, device):
    chunk, _ = _ops(impl, device)
    lens, slots, has_init = [70, 1, 130, 64], [3, 0, 1, 4], [True, False, True, False]
    q, k, v, g, beta, state = _inputs(sum(lens), dtype, device, seed=1)
    state[[0, 4]] = float("nan")  # the slots of the requests without a state: never read
    before = state.clone()
    out = chunk(q, k, v, g, beta, state, lens, torch.tensor(slots, device=device), torch.tensor(has_init, device=device))
    start = 0
    for n, slot, init in zip(lens, slots, has_init):
        part = slice(start, start + n)
        want, want_state = _hf(torch_chunk_gated_delta_rule, q[part], k[part], v[part], g[part], beta[part],
                               before[slot] if init else None)
        assert_reduction_close(out[part].float().cpu(), want, _terms(n), storage=dtype, msg=f"request of {n}")
        assert_reduction_close(state[slot].cpu(), want_state, _terms(n), storage=dtype, msg=f"state of {n}")
        start += n
    untouched = [s for s in range(SLOTS) if s not in slots]
    assert torch.equal(state[untouched], before[untouched])
    assert float(out.float().std()) > 0.01  # q is normalised and scaled by Dk^-0.5: outputs are small


@pytest.mark.parametrize("impl,dtype,device", IMPLS)
def test_decode_step_equals_transformers_recurrent_rule(impl, dtype, device):
    _, recurrent = _ops(impl, device)
    slots, has_init = [2, 4, 0], [True, True, False]
    q, k, v, g, beta, state = _inputs(3, dtype, device, seed=2)
    state[0] = float("nan")  # the slot of the request without a state: never read
    before = state.clone()
    out = recurrent(q, k, v, g, beta, state, torch.tensor(slots, device=device), torch.tensor(has_init, device=device))
    for i, (slot, init) in enumerate(zip(slots, has_init)):
        row = slice(i, i + 1)
        want, want_state = _hf(torch_recurrent_gated_delta_rule, q[row], k[row], v[row], g[row], beta[row],
                               before[slot] if init else None)
        assert_reduction_close(out[row].float().cpu(), want, DK + 2, storage=dtype)
        assert_reduction_close(state[slot].cpu(), want_state, DK + 2, storage=dtype)


@pytest.mark.parametrize("impl,dtype,device", IMPLS)
def test_any_split_of_a_prompt_gives_the_whole_prompts_outputs_and_state(impl, dtype, device):
    """150 tokens whole, then as steps of 50, 1 (a decode row), 63 and 36 through one slot; chunk boundaries
    fall elsewhere, so only rounding differs."""
    chunk, recurrent = _ops(impl, device)
    q, k, v, g, beta, state = _inputs(150, dtype, device, seed=3)
    slot = torch.tensor([2], device=device)
    state[2] = float("nan")
    whole_state = state.clone()
    whole = chunk(q, k, v, g, beta, whole_state, [150], slot, torch.tensor([False], device=device))
    parts, start = [], 0
    for n in (50, 1, 63, 36):
        part, flag = slice(start, start + n), torch.tensor([start > 0], device=device)
        if n == 1:
            parts.append(recurrent(q[part], k[part], v[part], g[part], beta[part], state, slot, flag))
        else:
            parts.append(chunk(q[part], k[part], v[part], g[part], beta[part], state, [n], slot, flag))
        start += n
    assert_reduction_close(torch.cat(parts).float(), whole.float(), _terms(150), storage=dtype)
    assert_reduction_close(state[2], whole_state[2], _terms(150), storage=dtype)


def test_the_state_must_be_float32():
    q, k, v, g, beta, state = _inputs(2, torch.float32, "cpu", seed=4)
    with pytest.raises(ValueError, match="must be float32"):
        ref.recurrent_gated_delta_rule(q, k, v, g, beta, state.half(), torch.tensor([0, 1]),
                                       torch.ones(2, dtype=torch.bool))


def test_triton_ops_at_the_published_head_dims_equal_the_torch_ops():
    """Dk = Dv = 128 (every published Qwen3.5): the value dims in 4 program blocks, a whole key head in
    one; two packed requests, one continuing from its slot."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
    from vlm_sdk.kernels import gated_delta_rule_chunk, gated_delta_rule_recurrent
    gen = torch.Generator().manual_seed(5)
    t, hk, hv, d = 100, 1, 2, 128
    q, k = (torch.randn(t, hk, d, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, d, generator=gen)
    g, beta = -torch.rand(t, hv, generator=gen) * 2, torch.rand(t, hv, generator=gen)
    state = torch.randn(3, hv, d, d, generator=gen)
    slots, init = torch.tensor([2, 0]), torch.tensor([True, False])
    want_state, got_state = state.clone(), state.clone()
    want = ref.chunk_gated_delta_rule(q, k, v, g, beta, want_state, [60, 40], slots, init)
    got = gated_delta_rule_chunk.chunk_gated_delta_rule(q, k, v, g, beta, got_state, torch.tensor(
        [0, 60, 100], dtype=torch.int32), 60, slots, init)
    assert_reduction_close(got, want, d + 60 + 2 * ref.CHUNK)
    assert_reduction_close(got_state, want_state, d + 60 + 2 * ref.CHUNK)
    rows = slice(0, 2)
    want = ref.recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], want_state, slots, init)
    got = gated_delta_rule_recurrent.recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                                 got_state, slots, init)
    assert_reduction_close(got, want, d + 62 + 2 * ref.CHUNK)
