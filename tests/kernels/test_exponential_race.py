"""exponential_race (Triton) against exponential_race_ref: the same Philox uniforms and tokens; the
race draws from probs."""
from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from vlm_sdk.kernels.exponential_race import exponential_race, exponential_race_ref, uniforms_ref

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]
SEEDS = [0, 1, 2 ** 62 + 12345, -7, -(2 ** 63), 2 ** 63 - 1]


def need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


@triton.jit
def _rand_kernel(seeds_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + row * vocab + offs, tl.rand(tl.load(seeds_ptr + row), offs), mask=offs < vocab)


@pytest.mark.parametrize("device", DEVICES)
def test_reference_uniforms_are_tritons_philox_bit_for_bit(device):
    need_triton(device)
    seeds = torch.tensor(SEEDS, dtype=torch.int64, device=device)
    vocab = 1000
    out = torch.empty(len(SEEDS), vocab, device=device)
    _rand_kernel[(len(SEEDS), triton.cdiv(vocab, 256))](seeds, out, vocab, BLOCK=256)
    assert torch.equal(out, uniforms_ref(seeds, vocab))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 37, 5000])  # 5000: three blocks, the last partial
def test_kernel_tokens_equal_reference(device, vocab):
    need_triton(device)
    g = torch.Generator().manual_seed(vocab)
    probs = torch.rand(6, vocab, generator=g)
    probs[:, 1::3] = 0.0  # filtered tokens
    probs[0] = 0.0
    probs[0, vocab // 2] = 1.0  # a one-token row
    probs = (probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)).to(device)
    seeds = torch.tensor(SEEDS, dtype=torch.int64, device=device)
    tokens = exponential_race(probs, seeds)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, exponential_race_ref(probs, seeds))
    assert tokens[0] == vocab // 2 and all(probs[i, t] > 0 for i, t in enumerate(tokens.tolist()))


def test_reference_race_draws_from_probs():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])[None].repeat(4000, 1)  # [4000, 4]
    tokens = exponential_race_ref(probs, torch.arange(4000, dtype=torch.int64) * 7919 + 3)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs[0], atol=0.03) and freq[3] == 0


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32"):
        exponential_race(torch.zeros(2, 4, dtype=torch.float16), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="seeds"):
        exponential_race(torch.zeros(2, 4), torch.zeros(3, dtype=torch.int64))
