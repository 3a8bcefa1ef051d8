"""apply_token_bitmask_ (Triton) against apply_token_bitmask_ref, and the reference against a bit-by-bit loop."""
from __future__ import annotations

import os

import pytest
import torch

from vlm_sdk.kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_ref

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CASES = [pytest.param("cpu", dt, id=f"cpu-{str(dt)[6:]}") for dt in (torch.float32, torch.float16)] + [
    pytest.param("cuda", dt, marks=CUDA_MARKS, id=f"cuda-{str(dt)[6:]}")
    for dt in (torch.bfloat16, torch.float16, torch.float32)]


def need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def _bitmask(n: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31 - 1, (n, words), generator=g, dtype=torch.int64).to(torch.int32)


def test_reference_matches_the_bit_layout():
    vocab = 70  # three words, the last one partial
    bitmask = _bitmask(2, 3, 0)
    bitmask[1, 2] = 0  # row 1 forbids tokens 64..69
    logits = torch.zeros(4, vocab)
    apply_token_bitmask_ref(logits, torch.tensor([3, 0]), bitmask)
    for i, row in enumerate((3, 0)):
        for t in range(vocab):
            allowed = (int(bitmask[i, t // 32]) >> (t % 32)) & 1
            assert (logits[row, t] == 0) == bool(allowed), (row, t)
    assert torch.equal(logits[1:3], torch.zeros(2, vocab))  # rows without a bitmask untouched


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("vocab,words", [(70, 3), (2500, 79), (2500, 60)])  # 2 blocks; a bitmask short of the vocab
def test_kernel_matches_reference(device, dtype, vocab, words):
    need_triton(device)
    g = torch.Generator().manual_seed(vocab + words)
    logits = torch.randn(5, vocab, generator=g).to(device, dtype)
    rows = torch.tensor([4, 1, 2], device=device)
    bitmask = _bitmask(3, words, vocab).to(device)
    ours, ref = logits.clone(), logits.clone()
    assert apply_token_bitmask_(ours, rows, bitmask) is ours
    apply_token_bitmask_ref(ref, rows, bitmask)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[0, 3]], logits[[0, 3]]) and (ours[rows] == float("-inf")).any()
    if words * 32 < vocab:
        assert (ours[rows][:, words * 32:] == float("-inf")).all()


def test_bad_inputs_are_refused():
    logits = torch.zeros(2, 40)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(logits, torch.tensor([0]), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask_(logits, torch.tensor([0, 1]), torch.zeros(1, 2, dtype=torch.int32))
