"""Speculative decoding (n-gram) through the engine and worker: greedy tokens equal decoding without it
(images, video, a batch mixing speculating and plain requests, chunked prefill, prefix caching, preemption in the
middle of speculation, structured outputs, logprobs, n > 1), seeded sampling reproducible, every block
returned, and the models it cannot verify (state layers without draft states) refused by name.

The tiny Qwen2.5-VL checkpoint is drawn with weights of std 0.1 (the family default is 0.2): its greedy
output then repeats itself now and then, so n-gram drafts are sometimes accepted and sometimes rejected,
and both paths run (the tests check both counts)."""
import pytest

from helpers import conversations
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import InvalidRequestError
from vlm_sdk.testing.families import fixtures
from vlm_sdk.testing.hooks import local_worker

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return fixtures("qwen2_5_vl").make_tiny_checkpoint(tmp_path_factory.mktemp("spec_qwen"), init_std=0.1)


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
    assert local_worker(llm.engine).runner.requests == {}  # every rank let go of every request


def test_greedy_tokens_equal_with_images_and_plain_requests_in_the_batch(plain, spec):
    convs = list(conversations().values())
    # plain requests beside the speculating ones: one prefilling while others verify (it arrives later: the
    # extra conversations are long), one with no room for a draft (max_tokens 1)
    params = [GREEDY] * len(convs) + [SamplingParams(max_tokens=1, temperature=0.0)]
    convs = convs + convs[:1]
    before = spec.stats()
    assert _tokens(spec, convs, params) == _tokens(plain, convs, params)
    s = spec.stats()
    drafts, accepted = s["spec_draft_tokens"] - before["spec_draft_tokens"], \
        s["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < drafts  # drafts both accepted and rejected
    assert s["spec_mean_accepted_length"] > 1.0 and 0 < s["spec_acceptance_rate"] < 1
    assert s["spec_method"] == "ngram" and s["spec_draft_seconds"] > 0
    _all_free(spec)


def test_logits_edits_apply_at_every_verified_position(plain, spec):
    """Penalties, logit_bias and min_tokens edit row j of a verification as if its first j drafts were tokens:
    the same greedy tokens as decoding one at a time, with drafts verified."""
    convs = [conversations()["text"], conversations()["one_image"]]
    rep = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    freq = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, presence_penalty=0.5,
                          frequency_penalty=0.4)
    eos = spec.engine.eos_token_ids
    banned = plain.chat(convs[0], GREEDY)[0].token_ids[4]  # a token greedy decoding takes, biased away
    bias = SamplingParams(max_tokens=32, temperature=0.0, logit_bias={banned: -100.0, min(eos): 5.0},
                          min_tokens=20)
    before = spec.stats()
    for params in (rep, freq, bias):
        assert _tokens(spec, convs, params) == _tokens(plain, convs, params)
    out = _tokens(spec, convs, bias)
    assert all(banned not in t and len(t) >= 20 for t in out)  # the bias and min_tokens held
    after = spec.stats()
    assert after["spec_verify_steps"] > before["spec_verify_steps"]
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    _all_free(spec)


def test_chunked_prefill_and_prefix_hits_change_no_token(ckpt, plain):
    # the short text prompt is verifying drafts while the image prompt's prefill goes on in chunks of the
    # same steps (13 tokens a step, drafts included)
    convs = [conversations()["text"], conversations()["one_image"]]
    want = _tokens(plain, convs, GREEDY)
    chunked = LLM(str(ckpt), show_progress=False, speculative_config=NGRAM, max_num_batched_tokens=13)
    assert _tokens(chunked, convs, GREEDY) == want
    assert _tokens(chunked, convs, GREEDY) == want  # the second run starts on the cached prompt blocks
    s = chunked.stats()
    assert s["prefix_cache_hit_tokens"] > 0 and s["spec_accepted_tokens"] > 0
    _all_free(chunked)


def test_preemption_in_the_middle_of_speculation_changes_no_token(ckpt, plain):
    convs = [conversations()["text"], conversations()["multi_turn"], conversations()["text"]]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 3
    want = _tokens(plain, convs, params)
    prompt = max(len(o.prompt_token_ids) for o in plain.chat(convs, params))
    blocks = 2 * (-(-(prompt + 40) // 16)) + 1  # two full sequences and a bit: the third preempts
    cramped = LLM(str(ckpt), show_progress=False, speculative_config=NGRAM, num_blocks=blocks,
                  enable_prefix_caching=False)
    assert _tokens(cramped, convs, params) == want
    s = cramped.stats()
    assert s["num_preemptions"] > 0 and s["spec_verify_steps"] > 0
    _all_free(cramped)


def test_structured_output_advances_over_accepted_tokens_only(plain, spec):
    conv = conversations()["text"]
    regex = "((ab|cd) ){10}end"  # repeats: drafts come up, some the grammar cuts (a draft of the prompt's text)
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"regex": regex})
    want = plain.chat(conv, params)[0]
    before = spec.stats()
    got = spec.chat(conv, params)[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    import re
    assert got.finish_reason == "stop" and re.fullmatch(regex, got.text)
    after = spec.stats()
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    _all_free(spec)


def test_logprobs_and_n_samples(plain, spec):
    conv = conversations()["one_image"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2, n=2)
    want, got = plain.chat(conv, params), spec.chat(conv, params)
    assert len(got) == 1 and len(got[0].outputs) == 2
    for w, g in zip(want[0].outputs, got[0].outputs):
        assert g.token_ids == w.token_ids
        for a, b in zip(w.logprobs, g.logprobs):
            # the verification step computes the same logits in a batch of another shape: float32 rounding
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def test_seeded_sampling_is_reproducible_with_speculation(spec):
    conv = conversations()["text"]
    seeded = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
    alone = _tokens(spec, [conv], seeded)[0]
    batch = _tokens(spec, [conversations()["one_image"], conv], [GREEDY, seeded])[1]
    assert alone == batch == _tokens(spec, [conv], seeded)[0]
    assert alone != _tokens(spec, [conv], SamplingParams(max_tokens=30, temperature=0.8, seed=8,
                                                         ignore_eos=True))[0]
    _all_free(spec)


def test_a_model_whose_state_layers_keep_no_draft_states_is_refused_by_name(tmp_path):
    from vlm_sdk.testing.mixed_cache import make_mixed_checkpoint
    ckpt = make_mixed_checkpoint(tmp_path / "mixed")
    with pytest.raises(InvalidRequestError, match="has state layers") as e:
        LLM(str(ckpt), show_progress=False, model_family="vlm_sdk.testing.mixed_cache", block_size=4,
            allow_unfit_images=True, speculative_config=NGRAM)
    assert e.value.param == "speculative_config"


def test_every_family_gives_the_same_greedy_tokens(family_ckpt):
    """n-gram drafts need nothing of the model: every family's tiny checkpoint (its own image conversation),
    families with state layers included (their rollback: tests/e2e/test_speculative_state_layers.py)."""
    name, path = family_ckpt
    plain = LLM(str(path), show_progress=False)
    conv = [conversations()["one_image"]]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)  # long enough to repeat a token
    spec = LLM(str(path), show_progress=False, speculative_config=NGRAM)
    assert _tokens(spec, conv, params) == _tokens(plain, conv, params), name
    assert spec.stats()["spec_verify_steps"] > 0
    _all_free(spec)


def test_a_stop_string_inside_a_verified_run_cuts_where_plain_decoding_does(plain, spec):
    from vlm_sdk.multimodal.prompts import TokensPrompt
    conv = conversations()["text"]
    full = plain.chat(conv, GREEDY)[0]
    # the engine's outputs step by step: a step yielding 3+ tokens (drafts accepted) holds the stop below
    engine = spec.engine
    engine.add_request(engine.inputs.build_prompt(TokensPrompt(tuple(full.prompt_token_ids))), GREEDY)
    chunks = []
    while engine.has_unfinished():
        chunks += [o.new_token_ids for o in engine.step() if o.new_token_ids]
    assert [t for c in chunks for t in c] == full.token_ids
    starts = [sum(len(c) for c in chunks[:i]) for i in range(len(chunks))]
    decode = spec.tokenizer.decode
    found = 0
    for start, c in zip(starts, chunks):
        if len(c) < 3:
            continue
        j = start + 1  # a token in the middle of the run
        upto, before = decode(full.token_ids[:j + 1]), decode(full.token_ids[:j])
        # accepted drafts repeat earlier text: the stop is the shortest tail ending at token j seen nowhere before
        tails = [upto[len(decode(full.token_ids[:j + 1 - n])):] for n in range(1, min(j, 12) + 1)]
        piece = next((t for t in tails if t.strip() and t not in before and "\ufffd" not in t), None)
        if piece is None:
            continue
        params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True, stop=[piece])
        want, got = plain.chat(conv, params)[0], spec.chat(conv, params)[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
        assert len(got.token_ids) == j + 1 and got.metrics.generated_tokens == j + 1  # the run's rest dropped
        found += 1
    assert found  # the output has a run of accepted drafts with a stop to find in it
    _all_free(spec)


def test_the_worker_tables_follow_every_rollback(spec):
    """After each step, every request the worker holds has the engine's blocks, in its state and in its
    block-table row (the engine's rollbacks reach the worker as truncated_blocks), and the pool's free count
    is the total less what the running sequences hold."""
    import numpy as np
    from vlm_sdk.multimodal.prompts import TokensPrompt
    engine, runner = spec.engine, local_worker(spec.engine).runner
    text = spec.chat(conversations()["text"], SamplingParams(max_tokens=1))[0].prompt_token_ids
    prompts = [text, text[:-3] + text[-9:]]  # text only (a token prompt carries no image); two lengths
    for ids in prompts:
        engine.add_request(engine.inputs.build_prompt(TokensPrompt(tuple(ids))), GREEDY)
    before = engine.stats()["spec_verify_steps"]
    shrunk = 0
    while engine.has_unfinished():
        engine.step()
        shrunk += len(engine.scheduler.truncated)  # rollbacks that freed blocks, for the next step to send
        used = {b for s in engine.scheduler.running for b in s.block_ids[0]}  # prefix hits share blocks
        assert engine.cache.num_used_blocks == len(used)
        for seq in engine.scheduler.running:
            state = runner.requests.get(seq.request_id)
            if state is None or not seq.in_worker:
                continue
            # the worker learns a rollback with the next step: compare what it was last sent
            assert state.block_ids[0][:seq.num_blocks_sent] == seq.block_ids[0][:seq.num_blocks_sent]
            assert runner.tables.num_blocks[state.row] == len(state.block_ids[0])
            assert list(runner.tables.rows(np.array([state.row]))[0]) == state.block_ids[0]
    assert engine.stats()["spec_verify_steps"] > before and shrunk > 0  # rollbacks freed blocks
    assert runner.requests == {} and engine.stats()["kv_blocks_used"] == 0


def test_a_video_prompt_gives_the_same_greedy_tokens(plain, spec, tmp_path):
    from vlm_sdk.testing.videos import write_video
    clip = tmp_path / "clip.mp4"
    write_video(clip, frames=16, fps=8, width=96, height=64)
    conv = [{"role": "user", "content": [{"type": "video", "video": str(clip), "fps": 2.0},
                                         {"type": "text", "text": "What happens?"}]}]
    before = spec.stats()["spec_verify_steps"]
    assert _tokens(spec, [conv], GREEDY) == _tokens(plain, [conv], GREEDY)
    assert spec.stats()["spec_verify_steps"] > before
    _all_free(spec)
