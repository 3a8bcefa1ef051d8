"""Logprobs and penalties on the tiny Qwen2.5-VL checkpoint, against a direct computation: transformers'
logits for the prompt plus the tokens the engine generated (teacher forcing), edited the way the
docs say (penalties, then temperature and top-k), then log-softmaxed."""
import math

import pytest
import torch

from vlm_sdk.testing.families import fixtures
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.models import registry

CONV = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, show_progress=False)


@pytest.fixture(scope="module")
def hf_logits(tiny_ckpt):
    """(prompt ids, generated ids) -> transformers' float32 logits [len(generated), vocab] that chose them."""
    ref = fixtures("qwen2_5_vl").reference
    model = ref.hf_model(str(tiny_ckpt)).float()

    @torch.inference_mode()
    def run(prompt: list[int], generated: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + generated])  # [1, prompt + generated]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()  # [len, vocab]
        return logits[len(prompt) - 1:len(prompt) - 1 + len(generated)]
    return run


def test_greedy_logprobs_are_the_log_softmax_and_the_chosen_token_is_the_best(llm, hf_logits):
    out = llm.chat(CONV, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5))[0]
    assert len(out.logprobs) == len(out.token_ids) == 10
    direct = hf_logits(out.prompt_token_ids, out.token_ids).log_softmax(-1)  # [10, vocab]
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_id == tok and len(lp.top_logprobs) == 5
        assert lp.top_logprobs[0] == (tok, lp.logprob)  # greedy: the chosen token is the best
        assert [v for _, v in lp.top_logprobs] == sorted((v for _, v in lp.top_logprobs), reverse=True)
        assert lp.logprob == pytest.approx(direct[j, tok].item(), abs=1e-3)
        for t, v in lp.top_logprobs:
            assert v == pytest.approx(direct[j, t].item(), abs=1e-3)


def test_sampled_logprobs_are_of_the_distribution_after_temperature_and_top_k(llm, hf_logits):
    params = SamplingParams(max_tokens=12, temperature=0.7, top_k=4, seed=5, ignore_eos=True, logprobs=4)
    out = llm.chat(CONV, params)[0]
    logits = hf_logits(out.prompt_token_ids, out.token_ids) / 0.7  # [12, vocab]
    kth = logits.topk(4, dim=-1).values[:, -1:]  # [12, 1]
    direct = logits.masked_fill(logits < kth, float("-inf")).log_softmax(-1)  # [12, vocab]
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.logprob == pytest.approx(direct[j, tok].item(), abs=1e-3)
        assert math.isfinite(lp.logprob)  # a drawn token is inside the top-k
        assert sum(math.exp(v) for _, v in lp.top_logprobs) == pytest.approx(1.0, abs=1e-4)
    # asking for logprobs changes no token of a seeded request
    plain = llm.chat(CONV, SamplingParams(max_tokens=12, temperature=0.7, top_k=4, seed=5, ignore_eos=True))[0]
    assert plain.token_ids == out.token_ids and plain.logprobs is None


def test_greedy_penalties_and_logit_bias_match_a_direct_computation(llm, hf_logits):
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.4, logit_bias={7: 1.5, 11: -3.0})
    plain = llm.chat(CONV, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    out, again = llm.chat([CONV, CONV], [params, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)])
    assert again.token_ids == plain.token_ids  # the row without penalties is untouched
    assert out.token_ids != plain.token_ids  # the penalties did something here
    logits = hf_logits(out.prompt_token_ids, out.token_ids)  # [16, vocab]
    prompt = out.prompt_token_ids
    for j, tok in enumerate(out.token_ids):
        row = logits[j].clone()
        seen = sorted(set(prompt + out.token_ids[:j]))
        row[seen] = torch.where(row[seen] > 0, row[seen] / 1.3, row[seen] * 1.3)
        counts = torch.bincount(torch.tensor(out.token_ids[:j], dtype=torch.long), minlength=row.shape[0])
        row -= 0.4 * counts + 0.5 * (counts > 0).float()
        row[7] += 1.5
        row[11] -= 3.0
        top2 = row.topk(2).values
        assert row.argmax().item() == tok or top2[0] - top2[1] < 1e-4


def test_logit_bias_forces_a_token_and_min_tokens_holds_back_eos(llm):
    forced = llm.chat(CONV, SamplingParams(max_tokens=5, temperature=1.0, seed=1, logit_bias={42: 100}))[0]
    assert forced.token_ids == [42] * 5
    eos = sorted(llm.engine.eos_token_ids)[0]
    stop_now = SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100})
    assert llm.chat(CONV, stop_now)[0].token_ids == [eos]
    held = llm.chat(CONV, SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100}, min_tokens=6))[0]
    assert len(held.token_ids) == 7 and held.token_ids[-1] == eos and eos not in held.token_ids[:6]
    assert held.finish_reason == "stop"


def test_preemption_changes_no_penalized_token_nor_logprob(tiny_ckpt, llm):
    """A resumed request rebuilds its history from the engine's tokens: the same penalties, draws, logprobs."""
    from helpers import conversations
    convs = list(conversations().values())
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=11, ignore_eos=True, logprobs=2,
                            presence_penalty=0.8, repetition_penalty=1.2, logit_bias={3: 2.0})
    free = llm.chat(convs, params)
    need = sum(-(-(len(o.prompt_token_ids) + 30) // 16) for o in free)
    blocks = max(-(-(len(o.prompt_token_ids) + 30) // 16) for o in free) + 1
    assert blocks < need
    tight = LLM(tiny_ckpt, num_blocks=blocks, allow_unfit_images=True, show_progress=False)
    outs = tight.chat(convs, params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in free]
    for a, b in zip(outs, free):
        assert [x.logprob for x in a.logprobs] == pytest.approx([x.logprob for x in b.logprobs], abs=1e-4)
