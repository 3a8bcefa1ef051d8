"""The sampler's per-row edits and logprobs on random logits, against a direct computation."""
import pytest
import torch

from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.sampling_params import SamplingParams
from vlm_sdk.sample.sampler import Sampler

VOCAB = 50


def _direct(row: torch.Tensor, p: SamplingParams, token_ids: list[int], num_prompt: int) -> torch.Tensor:
    row = row.clone()
    for t in set(token_ids):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(token_ids[num_prompt:]):
        row[t] -= p.presence_penalty + p.frequency_penalty * token_ids[num_prompt:].count(t)
    for t, b in p.logit_bias:
        row[t] += b
    return row


def test_penalties_match_a_direct_computation_and_leave_other_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3  # [3, vocab]
    history = ([1, 2, 3, 4, 4, 9], 3, ())  # prompt 1 2 3; generated 4 4 9
    edited = SamplingParams(temperature=0.0, repetition_penalty=1.7, presence_penalty=0.7, frequency_penalty=1.1,
                            logit_bias={5: 2.0, 6: -1.0}, logprobs=VOCAB // 5)
    plain = SamplingParams(temperature=0.0, logprobs=3)
    before = logits.clone()
    tokens, lps = Sampler(0).sample(logits, [plain, edited, plain], [history] * 3)
    direct = _direct(logits[1], edited, *history[:2]).log_softmax(-1)  # [vocab]
    assert tokens[1] == direct.argmax().item()
    assert lps[1].logprob == pytest.approx(direct[tokens[1]].item(), abs=1e-5)
    assert [t for t, _ in lps[1].top_logprobs] == direct.topk(VOCAB // 5).indices.tolist()
    for i in (0, 2):  # untouched rows: the plain argmax and log-softmax
        assert tokens[i] == logits[i].argmax().item()
        assert lps[i].logprob == pytest.approx(logits[i].log_softmax(-1).max().item(), abs=1e-6)
    assert torch.equal(logits, before)  # the caller's logits were not edited in place


def test_min_tokens_masks_stop_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 10.0  # EOS, say, would win
    p = SamplingParams(temperature=0.0, min_tokens=2)
    assert Sampler(0)(logits, [p], [([1, 2, 3], 3, (7,))]) != [7]
    assert Sampler(0)(logits, [p], [([1, 2, 3, 8], 3, (7,))]) != [7]
    assert Sampler(0)(logits, [p], [([1, 2, 3, 8, 8], 3, (7,))]) == [7]


def test_sampled_logprobs_are_of_the_tempered_top_p_distribution_and_seeds_still_hold():
    SMALL = 20  # logprobs=20, OpenAI's most: the whole distribution
    torch.manual_seed(1)
    logits = torch.randn(4, SMALL)  # [4, vocab]
    p = SamplingParams(temperature=0.5, top_p=0.8, seed=3, logprobs=SMALL)
    other = SamplingParams(temperature=1.0, presence_penalty=1.0, logit_bias={0: 5})
    hist = ([0, 1], 1, ())
    alone = Sampler(0).sample(logits[:1], [p], [hist])
    batch = Sampler(5).sample(logits, [p, other, other, other], [hist] * 4)
    assert alone[0][0] == batch[0][0] and alone[1][0] == batch[1][0]  # same token and logprobs in a batch
    lp = alone[1][0]
    probs = dict(lp.top_logprobs)
    kept = [v for v in probs.values() if v > float("-inf")]
    assert sum(torch.tensor(kept).exp()) == pytest.approx(1.0, abs=1e-5) and len(kept) < SMALL  # top-p cut some
    scaled = (logits[0] / 0.5).softmax(-1)
    top = scaled.sort(descending=True)
    # the kept tokens are the nucleus, and their probabilities are renormalised tempered ones
    nucleus = top.indices[:len(kept)].tolist()
    assert sorted(t for t, v in probs.items() if v > float("-inf")) == sorted(nucleus)
    renorm = scaled[nucleus] / scaled[nucleus].sum()
    assert [probs[t] for t in nucleus] == pytest.approx(renorm.log().tolist(), abs=1e-5)
    assert probs[lp.token_id] == lp.logprob > float("-inf")


@pytest.mark.parametrize("field, value", [("logprobs", 21), ("logprobs", -1), ("presence_penalty", 2.5),
                                          ("frequency_penalty", float("nan")), ("repetition_penalty", 0),
                                          ("min_tokens", 1.5), ("logit_bias", {1: 101}), ("logit_bias", {-1: 1}),
                                          ("logit_bias", "x")])
def test_bad_values_are_typed_errors_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field and f"'{field}'" in str(e.value)
