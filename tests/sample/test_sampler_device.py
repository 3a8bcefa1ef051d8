"""Sampling on the logits' device (issue 19, point 4): seeded draws from device generators keyed by
(seed, draw index), top-k / top-p among candidates against the full-sort reference, batched penalties."""
import os

import pytest
import torch

from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.sample.sampler import Sampler, draw_seed
from vlm_sdk.sample.top_k_top_p import filtered_probs, filtered_probs_reference

CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]


def cuda(test):
    for mark in CUDA_MARKS:
        test = mark(test)
    return test


def _history(num_output: int) -> tuple[list[int], int, tuple[int, ...]]:
    return [5, 6, 7] + [1] * num_output, 3, ()


# the draw: torch generators, or the Triton race kernel (on the CPU in the interpreter)
RACES = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs a GPU or the interpreter"))]


def _tokens(sampler, logits, params, num_output):
    return sampler(logits, params, [_history(num_output)] * len(params))


def test_draw_seeds_are_distinct_across_seeds_samples_and_indices():
    """n samples use seeds s + i: no (seed, index) pair may reuse another's stream."""
    pairs = {((s + i) % 2 ** 64, t) for s in (0, 1, 2 ** 63, 2 ** 64 - 1, -5) for i in range(4) for t in range(64)}
    assert len({draw_seed(s, t) for s, t in pairs}) == len(pairs)
    assert draw_seed(7, 3) == draw_seed(7, 3) and 0 <= draw_seed(-(2 ** 63), 0) < 2 ** 64


def _seeded_run(device, at, companions, race="torch", steps=6):
    """Tokens of a seeded top-k/top-p row over `steps` successive draws, at row `at` among `companions`."""
    torch.manual_seed(0)
    mine = torch.randn(1, 300, device=device)  # [1, vocab]
    others = torch.randn(len(companions), 300, device=device) * 3  # [len(companions), vocab]
    batch = torch.cat([others[:at], mine, others[at:]])  # [rows, vocab]
    params = companions[:at] + [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234)] + companions[at:]
    sampler = Sampler(99, race_kernel=race == "triton")
    return [_tokens(sampler, batch, params, t)[at] for t in range(steps)]


@pytest.mark.parametrize("race", RACES)
@pytest.mark.parametrize("device", DEVICES)
def test_seeded_tokens_do_not_depend_on_batch_companions_nor_position(device, race):
    alone = _seeded_run(device, 0, [], race)
    plain = SamplingParams(temperature=1.0)
    greedy = SamplingParams(temperature=0.0)
    other_seed = SamplingParams(temperature=0.5, top_k=3, seed=1)
    for companions, at in (([plain, greedy], 0), ([plain, other_seed, greedy, plain], 2), ([other_seed], 1)):
        assert _seeded_run(device, at, companions, race) == alone
    assert len(set(alone)) > 1  # successive draws differ


@pytest.mark.parametrize("race", RACES)
@pytest.mark.parametrize("device", DEVICES)
def test_a_resumed_request_draws_on_as_if_never_preempted(device, race):
    """After a preemption the runner rebuilds the request with its output so far; a fresh sampler
    (nothing saved, nothing replayed) draws its next token exactly as the uninterrupted one."""
    torch.manual_seed(3)
    logits = torch.randn(1, 500, device=device)  # [1, vocab]
    p = [SamplingParams(temperature=1.0, seed=42)]
    steady = Sampler(0, race_kernel=race == "triton")
    run = [_tokens(steady, logits, p, t)[0] for t in range(8)]
    resumed = [_tokens(Sampler(5, race_kernel=race == "triton"), logits, p, t)[0] for t in range(4, 8)]
    assert resumed == run[4:]


@cuda
def test_seeded_draws_use_generators_on_the_logits_device():
    """No vocabulary of draws on the host: every generator the sampler made lives on the GPU."""
    logits = torch.randn(4, 151936, device="cuda")  # [rows, vocab]
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(3)] + [SamplingParams(temperature=1.0)]
    sampler = Sampler(0)
    sampler(logits, params, [_history(2)] * 4)
    assert {g.device.type for g in list(sampler.seeded.values()) + list(sampler.generators.values())} == {"cuda"}


def _mixed_params():
    return [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.3, top_p=0.8),
            SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=30, top_p=0.5),
            SamplingParams(temperature=2.0, top_p=0.97), SamplingParams(temperature=1.0, top_k=199),
            SamplingParams(temperature=1.0, top_p=1e-6)]


@pytest.mark.parametrize("candidates", [4, 16, 1024])
@pytest.mark.parametrize("scale", [0.3, 3.0])  # flat rows send top-p past small candidate sets
def test_filtered_probs_match_the_full_sort_reference(candidates, scale):
    torch.manual_seed(int(scale * 10) + candidates)
    params = _mixed_params()
    logits = torch.randn(len(params), 200) * scale  # [rows, vocab]
    before = logits.clone()
    new = filtered_probs(logits, params, candidates)
    ref = filtered_probs_reference(logits, params)
    assert torch.equal(new > 0, ref > 0)  # the same tokens kept
    torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(logits, before)


def test_rows_without_filters_keep_the_whole_tempered_distribution():
    torch.manual_seed(1)
    logits = torch.randn(3, 64)  # [rows, vocab]
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=1.0, top_k=2), SamplingParams()]
    probs = filtered_probs(logits, params, candidates=8)
    torch.testing.assert_close(probs[0], (logits[0] / 0.5).softmax(-1))
    assert int((probs[1] > 0).sum()) == 2
    torch.testing.assert_close(probs[2], logits[2].softmax(-1))


def test_top_p_looks_past_the_candidates_only_when_it_must(monkeypatch):
    """A peaked row's nucleus lies inside 4 candidates; a flat one's does not: only the flat row takes
    the full sort."""
    import vlm_sdk.sample.top_k_top_p as tkp
    calls = []
    real = tkp._keep
    monkeypatch.setattr(tkp, "_keep", lambda vals, k, p: calls.append(tuple(vals.shape)) or real(vals, k, p))
    peaked = torch.full((1, 100), -10.0)
    peaked[0, :3] = torch.tensor([5.0, 4.0, 3.0])
    flat = torch.zeros(1, 100)
    p = [SamplingParams(temperature=1.0, top_p=0.9)] * 2
    probs = tkp.filtered_probs(torch.cat([peaked, flat]), p, candidates=4)
    assert calls == [(2, 4), (1, 100)]  # both rows among 4 candidates, then the flat one fully sorted
    assert int((probs[0] > 0).sum()) <= 3 and int((probs[1] > 0).sum()) == 90


# 6000 rows: the race kernel's distribution is checked on a GPU only (the interpreter takes a minute;
# tests/kernels/test_exponential_race.py checks its tokens equal its reference's on the CPU)
@pytest.mark.parametrize("device,race", [("cpu", "torch"), pytest.param("cuda", "torch", marks=CUDA_MARKS),
                                         pytest.param("cuda", "triton", marks=CUDA_MARKS)])
def test_sampled_frequencies_follow_the_reference_distribution(device, race):
    torch.manual_seed(5)
    row = torch.randn(1, 40, device=device) * 2  # [1, vocab]
    p = SamplingParams(temperature=0.8, top_p=0.85, top_k=12)
    n = 6000
    sampler = Sampler(1, candidates=8, race_kernel=race == "triton")
    tokens = torch.tensor(sampler(row.expand(n, -1).contiguous(), [p] * n))
    freq = torch.bincount(tokens, minlength=40).float() / n
    ref = filtered_probs_reference(row.cpu(), [p])[0]
    assert torch.allclose(freq, ref, atol=0.03) and set(tokens.tolist()) <= set(ref.nonzero()[:, 0].tolist())


def test_batched_penalties_match_the_per_row_reference():
    """Rows with different edits (and rows with none) in one batch: the batched writes equal the
    per-row loop, including a token both penalised and biased, and min_tokens over a bias."""
    from vlm_sdk.sample.penalties import apply_penalties, apply_penalties_reference
    torch.manual_seed(2)
    vocab = 60
    logits = torch.randn(5, vocab) * 3  # [rows, vocab]
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7,
                             logit_bias={4: 3.0, 9: -2.0}),
              SamplingParams(),
              SamplingParams(frequency_penalty=-1.0, min_tokens=5, logit_bias={7: 50.0}),
              SamplingParams(repetition_penalty=0.8),
              SamplingParams(presence_penalty=-0.4, logit_bias={1: 1.0})]
    histories = [([1, 2, 3, 4, 4, 9, 4], 3, ()), ([5, 5, 6], 1, (7,)), ([0, 7, 8, 8], 2, (7, 8, 99)),
                 ([10, 11, 12, 10, vocab + 3], 5, ()), ([], 0, ())]
    ours, ref = logits.clone(), logits.clone()
    apply_penalties(ours, params, histories)
    apply_penalties_reference(ref, params, histories)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-6)
    assert torch.equal(ours[1], logits[1]) and ours[2, 7] == ours[2, 8] == float("-inf")
    assert not torch.equal(ours[4], logits[4])  # a bias with no history still applies


def test_tallied_penalties_match_the_reference_step_after_step():
    """Rows carrying a PenaltyTally (as the worker's requests do) over several steps, each adding a
    token, beside an untallied row: every step equals the per-row reference, and a step's host work
    is the new token only (the tally's device ids are not rebuilt when nothing new was seen)."""
    from vlm_sdk.sample.penalties import PenaltyTally, apply_penalties, apply_penalties_reference
    torch.manual_seed(3)
    vocab = 80
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.7, logit_bias={4: 2.0}),
              SamplingParams(repetition_penalty=0.7),
              SamplingParams(frequency_penalty=-0.6, min_tokens=9)]
    prompts = [[1, 2, 3, 2, 50], [7, 7, 8], [9, 10, 11, 12]]
    tallies = [PenaltyTally(), PenaltyTally(), None]
    token_ids = [list(p) for p in prompts]
    for step, new in enumerate([[2, 7, 30], [60, 7, 30], [60, 8, 31], [1, 9, 31]]):
        for ids, t in zip(token_ids, new):
            ids.append(t)
        histories = [(ids, len(prompt), (31,), tally) if tally is not None else (ids, len(prompt), (31,))
                     for ids, prompt, tally in zip(token_ids, prompts, tallies)]
        logits = torch.randn(3, vocab) * 3  # [rows, vocab]
        ours, ref = logits.clone(), logits.clone()
        before = tallies[1].seen
        apply_penalties(ours, params, histories)
        apply_penalties_reference(ref, params, [h[:3] for h in histories])
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-6)
        assert tallies[0].counted == len(token_ids[0])
        if step == 1:  # row 1's new token (7) was seen before: its ids stay the same tensor
            assert tallies[1].seen is before
    assert sorted(tallies[0].seen.tolist()) == sorted(set(token_ids[0]))
    assert tallies[0].output == {2: 1, 60: 2, 1: 1}


def test_sampler_bench_runs_small_and_reports_every_scenario(capsys):
    """`vlm-sdk bench --sampler` at a toy size: one row per (logits shape, scenario), both paths timed,
    and the path before issue 19 still samples inside each row's kept tokens."""
    import json

    from vlm_sdk.bench.sampler import SamplerBenchConfig, bench_logits, sample_before_issue_19, scenarios
    from vlm_sdk.cli import main
    from vlm_sdk.sample.penalties import apply_penalties_reference
    assert main(["bench", "--sampler", "--sampler-rows", "3", "--sampler-vocab", "3000", "--sampler-repeats", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = SamplerBenchConfig(rows=3, vocab=3000)
    assert (out["rows"], out["vocab"]) == (3, 3000)
    assert [(r["shape"], r["scenario"]) for r in out["results"]] == [
        (shape, name) for shape in ("peaked", "flat") for name, _, _ in scenarios(cfg)]
    assert all(r["before_ms"] > 0 and r["now_ms"] > 0 for r in out["results"])
    logits = bench_logits("peaked", 3, 3000)
    for _, params, hist in scenarios(cfg):
        histories = hist or [([1, 2], 1, ())] * 3
        tokens = sample_before_issue_19(Sampler(0), logits, params, histories)
        edited = logits.clone()
        apply_penalties_reference(edited, params, histories)
        kept = filtered_probs_reference(edited, params)
        assert all(kept[i, t] > 0 for i, t in enumerate(tokens))


def test_the_host_sync_detector_sees_every_kind_of_sync():
    """tests/host_sync.py on the meta device: each way CUDA code makes the host wait is reported, the
    non-blocking upload the sampler uses is not (a detector that cannot fail would prove nothing)."""
    from host_sync import host_syncs
    up = lambda d: torch.tensor([0, 1]).to(d, non_blocking=True)  # noqa: E731
    syncs = {
        "blocking upload": lambda d: torch.tensor([1, 2]).to(d),
        "torch.tensor on the device": lambda d: torch.tensor([1, 2], device=d),
        "item": lambda d: torch.zeros(3, device=d).sum().item(),
        "bool": lambda d: bool(torch.zeros(3, device=d).sum() > 0),
        "copy down": lambda d: torch.zeros(3, device=d).cpu(),
        "nonzero": lambda d: torch.zeros(3, device=d).nonzero(),
        "python scalar written by index": lambda d: torch.zeros(3, 5, device=d).__setitem__((up(d), up(d)), -1.0),
    }
    for name, fn in syncs.items():
        assert host_syncs(fn), name
    assert host_syncs(up) == []
    assert host_syncs(lambda d: torch.zeros(3, 5, device=d).masked_fill_(torch.ones(3, 5, dtype=torch.bool,
                                                                                    device=d), -1.0)) == []


@pytest.mark.parametrize("edit", ["repetition", "presence_frequency", "logit_bias", "min_tokens", "all"])
def test_every_penalty_path_queues_without_a_host_sync(edit):
    """apply_penalties on a device (meta, tests/host_sync.py) neither reads a value back nor uploads
    with a blocking copy, for each kind of edit alone and all at once. The min_tokens ban once wrote
    `logits[rows, ids] = -inf`: torch copies that scalar from the host, a sync (the first H100 run)."""
    from host_sync import host_syncs

    from vlm_sdk.sample.penalties import apply_penalties
    kinds = {"repetition": dict(repetition_penalty=1.2), "presence_frequency": dict(presence_penalty=0.3,
                                                                                 frequency_penalty=0.2),
             "logit_bias": dict(logit_bias={3: 1.0}), "min_tokens": dict(min_tokens=4)}
    settings = {k: v for d in kinds.values() for k, v in d.items()} if edit == "all" else kinds[edit]
    params = [SamplingParams(temperature=0.8, **settings) for _ in range(8)]
    histories = [([1, 2, 3, 4, 4], 2, (5, 6))] * 8
    assert host_syncs(lambda d: apply_penalties(torch.zeros(8, 1000, device=d), params, histories)) == []


@cuda
def test_sampling_before_the_tokens_never_syncs_the_host():
    """Penalties, top-k (+ top-p within it), seeded and shared draws and the race queue behind the
    forward without one host sync (the tokens' copy at the end is the sampler's only one; a top-p-only
    row adds the check of whether its nucleus fits the candidates)."""
    from vlm_sdk.sample.penalties import apply_penalties
    logits = torch.randn(8, 151936, device="cuda")  # [rows, vocab]
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i if i % 2 else None,
                             repetition_penalty=1.2, logit_bias={3: 1.0}, min_tokens=4) for i in range(8)]
    histories = [([1, 2, 3, 4], 2, (5,))] * 8
    sampler = Sampler(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        edited = logits.clone()
        apply_penalties(edited, params, histories)
        probs = filtered_probs(edited, params)
        q = sampler._exponentials(probs.shape, [p.seed for p in params], [2] * 8, logits.device)
        torch.div(probs, q, out=q).argmax(dim=-1)
        from vlm_sdk.kernels.exponential_race import exponential_race  # the CUDA path's draw
        exponential_race(probs, sampler._race_keys([p.seed for p in params], [2] * 8, logits.device))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_measured_peak_of_the_worst_case_and_of_a_plain_draw():
    """The process's peak resident memory during one call (Linux; see bench/sampler.py) at 8 rows of
    Qwen's vocabulary: the worst case (penalties, logprobs, seeds, flat top-p rows sorted in full) stays
    near the ~40 bytes per row and vocabulary entry that sampler.py's accounting gives (48: resident
    memory is a noisy meter, 33.9-40.4 measured); a peaked top-p draw holds ~2 [V] float32 per row
    (the full sort held ~10)."""
    from vlm_sdk.bench.sampler import _peak_bytes, bench_logits
    rows, vocab = 8, 151936
    hist = [([1, 2, 3, 4, 5], 2, (7,))] * rows
    worst = [SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5, logprobs=5, seed=i) for i in range(rows)]
    flat, peaked = bench_logits("flat", rows, vocab), bench_logits("peaked", rows, vocab)
    sampler = Sampler(0)
    sampler.sample(flat, worst, hist)  # warm-up: first-call allocations are not the sampler's
    if _peak_bytes(lambda: None) is None:
        pytest.skip("no /proc/self/clear_refs here")
    # the least of three: other threads of a long test process (tokenizers, llguidance, torch) may add
    # resident pages while one call runs; they only ever add
    measured = min(_peak_bytes(lambda: sampler.sample(flat, worst, hist)) for _ in range(3))
    assert 20 * rows * vocab < measured <= 48 * rows * vocab
    plain = [SamplingParams(temperature=0.8, top_p=0.9)] * rows
    sampler.sample(peaked, plain)
    plain_peak = min(_peak_bytes(lambda: sampler.sample(peaked, plain)) for _ in range(3))
    # ~8 bytes per entry alone; resident pages of other threads add to it (CI read 12.7), a full sort
    # adds ~32 more: the bound is half the worst case measured in this run and half of what a sort holds
    assert plain_peak < min(measured / 2, 20 * rows * vocab)
