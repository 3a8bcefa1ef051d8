"""Speculative decoding (n-gram) on models with state layers (Qwen3.5 dense and MoE: Gated DeltaNet): greedy
tokens equal decoding without it (images, a batch of speculating and plain requests, preemption in the middle of
speculation with the prefix cache's state checkpoints on), every block and state slot returned, and the rollback
checked directly: after a verification that rejected a draft, the request's live state (every state layer's conv
and recurrent state) is the state of a run of only its accepted tokens.

A random tiny checkpoint rarely repeats itself, so n-gram drafts would all be rejected. `_echo_checkpoint` ties
the LM head to the embeddings and scales each layer's residual branches down: the greedy output then often
repeats its last token, and drafts are sometimes accepted, sometimes rejected part way (the tests count both)."""
import shutil

import pytest
import torch

from helpers import conversations
from tolerance import forward_terms, reduction_atol
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.multimodal.prompts import TokensPrompt
from vlm_sdk.testing.families import fixtures
from vlm_sdk.testing.hooks import local_worker

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
# the residual branches' scale that gives about half the drafts accepted on each family's tiny checkpoint
BRANCH_SCALE = {"qwen3_5": 0.12, "qwen3_5_moe": 0.16}


def _echo_checkpoint(src, dst, scale: float):
    """A copy of checkpoint `src` whose LM head is its token embedding and whose decoder layers' branch outputs
    (the mixers' out_proj / o_proj, the MLPs' down_proj) are scaled by `scale`: a token's own embedding
    dominates the last hidden state, so the greedy next token is often the token itself."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights["lm_head.weight"] = weights["model.language_model.embed_tokens.weight"].clone()
    for name in weights:
        if name.startswith("model.language_model.layers.") and name.endswith(
                ("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * scale
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module", params=sorted(BRANCH_SCALE))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(family, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"spec_{family}")
    tiny = fixtures(family).make_tiny_checkpoint(root / "tiny", init_std=0.1)
    return _echo_checkpoint(tiny, root / "echo", BRANCH_SCALE[family])


@pytest.fixture(scope="module")
def plain(ckpt):
    return LLM(str(ckpt), show_progress=False)


@pytest.fixture(scope="module")
def spec(ckpt):
    return LLM(str(ckpt), show_progress=False, speculative_config=NGRAM)


def _tokens(llm, convs, params):
    return [o.token_ids for o in llm.chat(convs, params)]


def _all_free(llm):
    s = llm.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == s["num_waiting"] == 0
    assert [g["slots_used"] for g in s["cache_groups"] if g["kind"] == "state"] == [0]
    assert local_worker(llm.engine).runner.requests == {}


def _counts(llm, before):
    s = llm.stats()
    return s["spec_draft_tokens"] - before["spec_draft_tokens"], s["spec_accepted_tokens"] - before["spec_accepted_tokens"]


def test_greedy_tokens_equal_with_images_and_plain_requests_in_the_batch(plain, spec):
    convs = list(conversations().values())
    params = [GREEDY] * len(convs) + [SamplingParams(max_tokens=1, temperature=0.0)]  # one with no room for drafts
    convs = convs + convs[:1]
    before = spec.stats()
    assert _tokens(spec, convs, params) == _tokens(plain, convs, params)
    drafts, accepted = _counts(spec, before)
    assert 0 < accepted < drafts  # drafts both accepted and rejected
    _all_free(spec)


def test_preemption_in_the_middle_of_speculation_with_state_checkpoints(ckpt, plain):
    """Too few blocks for three sequences: the newest is preempted while the others verify drafts, and resumes
    from its prompt's state checkpoint (prefix caching on); a second run starts from the cached prompts."""
    convs = [conversations()["text"], conversations()["one_image"], conversations()["text"]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = _tokens(plain, convs, params)
    need = sorted(-(-(len(o.prompt_token_ids) + 40) // 16) for o in plain.chat(convs, SamplingParams(max_tokens=1)))
    blocks = need[-1] + need[-2] + 1  # the two longest whole and a bit: the third preempts
    cramped = LLM(str(ckpt), show_progress=False, speculative_config=NGRAM, num_blocks=blocks, allow_unfit_images=True)
    assert _tokens(cramped, convs, params) == want
    assert _tokens(cramped, convs, params) == want
    s = cramped.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hit_tokens"] > 0
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    _all_free(cramped)


def test_a_rejected_drafts_state_is_rolled_back_to_the_accepted_tokens(family, ckpt, spec):
    """Step by step: after each verification that rejected a draft (the engine moved the request's live slot),
    every state layer's conv and recurrent state in that slot equals the state of a run of only the request's
    computed tokens (a fresh engine's prefill of them, without speculation or the prefix cache)."""
    ref = LLM(str(ckpt), show_progress=False, enable_prefix_caching=False)
    engine, runner = spec.engine, local_worker(spec.engine).runner
    layers = engine.cache.layout.state_layers
    text = conversations()["text"]
    prompt = spec.chat(text, SamplingParams(max_tokens=1))[0].prompt_token_ids
    engine.add_request(engine.inputs.build_prompt(TokensPrompt(tuple(prompt))), GREEDY)
    checked = partial = 0
    while engine.has_unfinished():
        outs = engine.step()
        moved = engine.scheduler.moved_slots
        if not moved or checked >= 4:
            continue
        (seq, slot), = moved.items()
        partial += len(outs[0].new_token_ids) > 1  # an accepted draft before the rejected one
        convs = [runner.caches[i][0][slot].clone() for i in layers]
        recs = [runner.caches[i][1][slot].clone() for i in layers]
        want_conv, want_rec = _prefill_state(ref, seq.token_ids[:seq.num_computed_tokens], layers)
        terms = _terms(ckpt, seq.num_computed_tokens)
        for i, (c, w) in enumerate(zip(convs, want_conv)):
            torch.testing.assert_close(c, w, atol=reduction_atol(w, terms), rtol=0, msg=lambda m: f"conv {i}: {m}")
        for i, (r, w) in enumerate(zip(recs, want_rec)):
            torch.testing.assert_close(r, w, atol=reduction_atol(w, terms), rtol=0, msg=lambda m: f"state {i}: {m}")
            assert float(w.std()) > 0.01
        checked += 1
    assert checked and partial, (checked, partial)
    _all_free(spec)


def _prefill_state(llm, token_ids, layers):
    """Every state layer's (conv, recurrent) state after `llm` computes `token_ids` as one prompt."""
    engine, runner = llm.engine, local_worker(llm.engine).runner
    engine.add_request(engine.inputs.build_prompt(TokensPrompt(tuple(token_ids))),
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()  # the whole prompt, then its first token sampled
    seq, = engine.scheduler.running
    assert seq.num_computed_tokens == len(token_ids)
    convs = [runner.caches[i][0][seq.state_slot].clone() for i in layers]
    recs = [runner.caches[i][1][seq.state_slot].clone() for i in layers]
    while engine.has_unfinished():
        engine.step()
    return convs, recs


def _terms(ckpt, tokens: int) -> int:
    """The longest chain of additions to a state layer's state after `tokens` tokens: the decoder up to it."""
    from transformers import AutoConfig
    text = AutoConfig.from_pretrained(str(ckpt)).get_text_config()
    intermediate = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    return forward_terms(layers=text.num_hidden_layers, hidden=text.hidden_size, intermediate=intermediate,
                         tokens=tokens, head_dim=text.head_dim)
