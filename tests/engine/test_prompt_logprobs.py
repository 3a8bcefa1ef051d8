"""`SamplingParams(prompt_logprobs=k)` (vLLM's field) against transformers on the same checkpoint: every
prompt token's logprob given the tokens before it, its rank and the k most likely tokens, computed over a
prompt split into several chunks, the second time with its blocks in the prefix cache (which such a request
does not use: every position must be computed), and for the first of n samples only."""
import pytest
import torch
from transformers import Qwen2_5_VLForConditionalGeneration

from tolerance import forward_terms, reduction_atol
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.multimodal.prompts import TokensPrompt

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 7, 8, 10, 11, 12, 13, 20, 21, 30, 31, 32, 33, 34, 35,
          36, 37, 38, 39, 40, 41, 42, 43, 44, 45]
K = 4


@pytest.fixture(scope="module")
def expected(tiny_ckpt):
    """transformers' log-softmax of its logits at every prompt position, [len - 1, vocab]: row i predicts token i+1."""
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([PROMPT])).logits[0, :-1].float()  # [len - 1, vocab]
    terms = forward_terms(layers=2, hidden=64, intermediate=128, tokens=len(PROMPT), head_dim=16) + logits.shape[1]
    return torch.log_softmax(logits, -1), terms


def _check(plp, expected):
    reference, terms = expected
    assert plp is not None and len(plp) == len(PROMPT)
    entries = plp.entries()
    assert entries[0] is None and len(entries) == len(PROMPT)
    atol = reduction_atol(reference, terms)
    own = torch.tensor([reference[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))])
    ours = torch.tensor([entries[i][PROMPT[i]][0] for i in range(1, len(PROMPT))])
    torch.testing.assert_close(ours, own, atol=atol, rtol=0)
    for i in range(1, len(PROMPT)):
        row, entry = reference[i - 1], entries[i]
        assert list(entry)[0] == PROMPT[i]  # the prompt token first, as vLLM lists it
        value, rank = entry[PROMPT[i]]
        near = int(((row - value).abs() <= atol).sum())  # ties within rounding may order either way
        assert abs(rank - int((row >= row[PROMPT[i]]).sum())) < near, (i, rank)
        top = torch.topk(row, K)
        ours_top = sorted(((v, t) for t, (v, r) in entry.items() if r <= K and (t != PROMPT[i] or rank <= K)),
                          reverse=True)[:K]
        torch.testing.assert_close(torch.tensor([v for v, _ in ours_top]), top.values, atol=atol, rtol=0)
        for v, t in ours_top:  # each listed token's value is its own
            assert abs(row[t].item() - v) <= atol
    assert own.std() > 0.1  # the values spread: a wrong row or shift would show


def test_prompt_logprobs_match_transformers(tiny_ckpt, expected):
    llm = LLM(tiny_ckpt, show_progress=False, max_num_batched_tokens=16, max_num_seqs=4)  # chunks of 16
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=K)
    first = llm.generate(TokensPrompt(token_ids=PROMPT), params)[0]
    _check(first.prompt_logprobs, expected)
    # again: the prompt's blocks are cached now, yet every position is computed
    again = llm.generate(TokensPrompt(token_ids=PROMPT), params)[0]
    assert again.num_cached_tokens == 0
    _check(again.prompt_logprobs, expected)
    # n samples: the first computes them, the others share its cached blocks
    many = llm.generate(TokensPrompt(token_ids=PROMPT), SamplingParams(max_tokens=2, temperature=1.0, seed=1, n=3,
                                                                       prompt_logprobs=0))[0]
    plp = many.outputs[0].prompt_logprobs
    assert plp.token_ids.shape == (len(PROMPT), 1)
    reference, terms = expected
    torch.testing.assert_close(torch.from_numpy(plp.logprobs[1:, 0]),
                               torch.tensor([reference[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]),
                               atol=reduction_atol(reference, terms), rtol=0)
    assert all(o.prompt_logprobs is None for o in many.outputs[1:])
    # without the field: nothing computed, nothing returned
    assert llm.generate(TokensPrompt(token_ids=PROMPT), SamplingParams(max_tokens=1))[0].prompt_logprobs is None
    assert llm.stats()["kv_blocks_used"] == 0
