"""top_p_cut_ (Triton, under TRITON_INTERPRET=1 on the CPU) against its torch reference and the full
sort's nucleus; the sampler's device path (`filtered_probs(device_cut=True)`) against the full-sort
reference, with no host sync on its way."""
from __future__ import annotations

import os

import pytest
import torch

from vlm_sdk.kernels.top_p_cut import top_p_cut_, top_p_cut_ref

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=CUDA_MARKS, id="cuda")]


def need_triton(device: str) -> None:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")


def sorted_nucleus_size(row: torch.Tensor, p: float) -> int:
    s, _ = row.sort(descending=True)
    return int(((s.cumsum(0) - s) < p).sum())  # the crossing token stays


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [300, 5000])  # one block, and several (4096 per block)
def test_kernel_equals_reference_and_the_sorted_nucleus(device, vocab):
    need_triton(device)
    torch.manual_seed(vocab)
    scales = torch.tensor([0.05, 0.5, 1.0, 3.0, 8.0, 1.0], device=device)
    probs = (torch.randn(6, vocab, device=device) * scales[:, None]).softmax(dim=-1)  # [6, vocab]
    short = torch.tensor([True, True, True, True, False, True], device=device)
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.7, 0.9, 0.999], device=device)
    got = top_p_cut_(probs.clone(), short, top_p)
    want = top_p_cut_ref(probs.clone(), short, top_p)
    assert torch.equal(got > 0, want > 0)
    assert torch.equal(got[got > 0], probs[got > 0])  # kept values untouched (renormalising is the caller's)
    assert not got[4].any()  # not short: zeroed for the caller's scatter
    for r in (0, 1, 2, 3, 5):
        assert int((got[r] > 0).sum()) == sorted_nucleus_size(probs[r], float(top_p[r]))


def test_ties_at_the_threshold_are_all_kept():
    need_triton("cpu")
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]])
    out = top_p_cut_(probs.clone(), torch.tensor([True]), torch.tensor([0.5]))
    assert torch.equal(out[0], torch.tensor([0.4, 0.2, 0.2, 0.0, 0.0]))  # the crossing token (0.2) and its tie


def test_arguments_are_checked():
    probs = torch.rand(2, 8)
    with pytest.raises(ValueError, match="short must be"):
        top_p_cut_(probs, torch.tensor([1, 0]), torch.rand(2))
    with pytest.raises(ValueError, match="probs must be"):
        top_p_cut_(probs.double(), torch.tensor([True, False]), torch.rand(2))
    with pytest.raises(ValueError, match="top_p must be"):
        top_p_cut_(probs, torch.tensor([True, False]), torch.rand(3))


def _mixed_params():
    from vlm_sdk import SamplingParams
    return [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.8),
            SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=30, top_p=0.5),
            SamplingParams(temperature=2.0, top_p=0.97), SamplingParams(temperature=1.0, top_k=199),
            SamplingParams(temperature=1.0, top_p=1e-6), SamplingParams(temperature=0.5, top_p=0.9)]


@pytest.mark.parametrize("candidates", [4, 16, 1024])
@pytest.mark.parametrize("scale", [0.3, 3.0])  # flat rows send top-p past small candidate sets
def test_device_cut_matches_the_full_sort_reference(candidates, scale):
    from vlm_sdk.sample.top_k_top_p import filtered_probs, filtered_probs_reference
    need_triton("cpu")
    torch.manual_seed(int(scale * 10) + candidates)
    params = _mixed_params()
    logits = torch.randn(len(params), 200) * scale  # [rows, vocab]
    before = logits.clone()
    new = filtered_probs(logits, params, candidates, device_cut=True)
    ref = filtered_probs_reference(logits, params)
    assert torch.equal(new > 0, ref > 0)  # the same tokens kept
    torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(logits, before)
    # a subset of rows filtered (the greedy-free rows gathered and written back)
    sub = [params[i] for i in (2, 1, 2, 4)]
    torch.testing.assert_close(filtered_probs(logits[:4], sub, candidates, device_cut=True),
                               filtered_probs_reference(logits[:4], sub), atol=1e-6, rtol=1e-5)


def test_device_cut_makes_no_host_sync(monkeypatch):
    """Every way a tensor reaches the host raises while `filtered_probs` runs, but inside the kernel's
    launch (the interpreter itself reads the tensors through numpy; on a GPU the launch is queued)."""
    import vlm_sdk.kernels.top_p_cut as cut
    from vlm_sdk.sample.top_k_top_p import filtered_probs
    need_triton("cpu")
    traps = ("__bool__", "item", "tolist", "nonzero", "cpu", "numpy", "__int__", "__float__")
    real = {name: getattr(torch.Tensor, name) for name in traps}

    def trapped(name):
        def fail(*a, **k):
            raise AssertionError(f"host sync: Tensor.{name}")
        return fail

    def trap(on: bool) -> None:
        for name in traps:
            setattr(torch.Tensor, name, trapped(name) if on else real[name])
    real_cut, launches = cut.top_p_cut_, []

    def untrapped_cut(*args):
        trap(False)
        try:
            launches.append(1)
            return real_cut(*args)
        finally:
            trap(True)
    monkeypatch.setattr(cut, "top_p_cut_", untrapped_cut)
    from vlm_sdk import SamplingParams
    logits = torch.randn(3, 500) * 0.2  # flat: the top-p rows reach past 8 candidates
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.8, top_p=0.5)]
    trap(True)
    try:
        probs = filtered_probs(logits, params, candidates=8, device_cut=True)
    finally:
        trap(False)
    assert launches == [1]
    assert int((probs[1] > 0).sum()) == 3 and int((probs[0] > 0).sum()) > 8
