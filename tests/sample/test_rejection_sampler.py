"""The rejection sampler keeps the target distribution (sample/rejection_sampler.py): chi-square tests on a
vocabulary of 8 with fixed seeds and thousands of draws, for n-gram drafts (a point mass) and a draft
distribution q; greedy verification takes exactly the target's argmax tokens; seeded draws do not
depend on the batch."""
import torch

from vlm_sdk.sample.rejection_sampler import RejectionSampler
from vlm_sdk.sample.sampler import Sampler
from vlm_sdk.sampling_params import SamplingParams

VOCAB = 8
TRIALS = 4000
# chi-square critical values at p = 0.001 (df = VOCAB - 1 = 7, and 6 for a distribution with a zero cell):
# a correct sampler fails a test 1 time in 1,000 seeds; these seeds are fixed
CHI2_999 = {7: 24.32, 6: 22.46, 5: 20.52, 4: 18.47}


def _chi2(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    expected = probs.double() * len(tokens)
    cells = expected > 0
    assert counts[~cells].sum() == 0, "a token of probability 0 was drawn"
    stat = float((((counts - expected) ** 2)[cells] / expected[cells]).sum())
    return stat, int(cells.sum()) - 1


def _target() -> torch.Tensor:  # [3, VOCAB]: the target's logits after its last token and after 2 drafts
    g = torch.Generator().manual_seed(7)
    return torch.randn(3, VOCAB, generator=g) * 1.5


def _verify(drafts, params, q=None, trials=TRIALS):
    """`drafts`: every trial's (a list of ints), or one list per trial."""
    rows = _target()
    per_trial = drafts if isinstance(drafts[0], list) else [list(drafts)] * trials
    k = len(per_trial[0])
    logits = rows[:k + 1].repeat(trials, 1)  # [trials * (k + 1), VOCAB]: one request per trial
    rs = RejectionSampler(Sampler(seed=0))
    ps = [SamplingParams(temperature=1.0, seed=i, **params) for i in range(trials)]
    return rs.verify(logits, per_trial, ps, [0] * trials, None if q is None else [q] * trials)[0]


def _filtered(row, **params):
    from vlm_sdk.sample.top_k_top_p import filtered_probs
    return filtered_probs(row[None].float(), [SamplingParams(temperature=1.0, **params)])[0]


def test_ngram_drafts_keep_the_target_distribution_at_each_position():
    rows = _target()
    p0, p1 = rows.softmax(-1)[0], rows.softmax(-1)[1]
    d0 = int(p0.argsort()[-2])  # a likely but not the likeliest token: both outcomes are frequent
    outs = _verify([d0, int(p1.argmax())], {})
    stat, df = _chi2([o[0] for o in outs], p0)
    assert stat < CHI2_999[df], stat
    accepted = [o for o in outs if o[0] == d0]  # the first draft accepted (a rejection never draws d0)
    assert 0.5 * p0[d0] * TRIALS < len(accepted) < 1.5 * p0[d0] * TRIALS
    stat, df = _chi2([o[1] for o in accepted], p1)  # the next token, given the first: p1 again
    # fewer draws: the test's power is lower, its level the same
    assert stat < CHI2_999[df], stat
    assert all(1 <= len(o) <= 3 for o in outs)


def test_a_draft_distribution_q_is_corrected_to_the_target():
    rows = _target()
    p0 = rows.softmax(-1)[0]
    q = torch.full((1, VOCAB), 1.0 / VOCAB)  # a uniform draft: far from p0
    q[0, 0] = 0.3
    q /= q.sum()
    # the drafts are drawn from q (the guarantee is over d ~ q), with their own fixed generator
    drafted = torch.multinomial(q[0], TRIALS, replacement=True, generator=torch.Generator().manual_seed(11))
    outs = _verify([[d] for d in drafted.tolist()], {}, q=q)
    stat, df = _chi2([o[0] for o in outs], p0)
    assert stat < CHI2_999[df], stat


def test_top_k_and_top_p_are_the_distribution_verified_against():
    rows = _target()
    p0 = _filtered(rows[0], top_k=5, top_p=0.9)
    assert (p0 == 0).sum() >= 3
    d0 = int(p0.argsort()[-1])
    outs = _verify([d0], {"top_k": 5, "top_p": 0.9})
    stat, df = _chi2([o[0] for o in outs], p0)
    assert stat < CHI2_999[df], stat


def test_greedy_takes_the_target_argmax_tokens():
    rows = _target()
    top = rows.argmax(-1).tolist()  # [3]
    wrong = (top[1] + 1) % VOCAB
    rs = RejectionSampler(Sampler())
    greedy = SamplingParams(temperature=0.0)
    logits = torch.cat([rows, rows, rows[:1]])  # requests of 2, 2 and 0 drafts
    tokens, logprobs = rs.verify(logits, [[top[0], top[1]], [top[0], wrong], []], [greedy] * 3, [0, 0, 0])
    assert tokens == [[top[0], top[1], top[2]], [top[0], top[1]], [top[0]]]
    assert logprobs == [None, None, None]
    with_lp = SamplingParams(temperature=0.0, logprobs=2)
    tokens, logprobs = rs.verify(rows, [[top[0], top[1]]], [with_lp], [0])
    want = rows.log_softmax(-1)
    assert [lp.token_id for lp in logprobs[0]] == tokens[0]
    for j, lp in enumerate(logprobs[0]):
        assert abs(lp.logprob - float(want[j, tokens[0][j]])) < 1e-6 and lp.top_logprobs[0][0] == top[j]


def test_seeded_verification_does_not_depend_on_the_batch():
    rows = _target()
    rs = RejectionSampler(Sampler(seed=3))
    seeded = SamplingParams(temperature=1.0, seed=42)
    d = [int(rows[0].argsort()[-2]), 1]
    alone = [rs.verify(rows, [d], [seeded], [5])[0][0] for _ in range(3)]
    other = SamplingParams(temperature=1.0)
    batch = rs.verify(torch.cat([rows, rows]), [d, d], [other, seeded], [0, 5])[0][1]
    assert alone[0] == alone[1] == alone[2] == batch
    many = {tuple(rs.verify(rows, [d], [SamplingParams(temperature=1.0, seed=s)], [5])[0][0]) for s in range(40)}
    assert len(many) > 3  # the seed matters
