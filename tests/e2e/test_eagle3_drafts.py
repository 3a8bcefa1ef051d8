"""EAGLE-3 drafts through the engine and the worker, on tiny Qwen2.5-VL and Qwen3-VL targets with a tiny draft
head written in the published layout (vlm_sdk/testing/eagle3.py): greedy tokens equal decoding without
speculation (images, a batch mixing speculating and plain requests, chunked prefill, preemption mid-speculation,
a structured output), every block back in the pool (the draft's KV page is in them), and the target's aux hidden
states equal transformers' hidden states at those layers, image positions included.

The targets keep half their attention (`make_token_local(attention_scale=0.5)`) and the draft reads the aux
states a little (`hidden_weight=0.3`): its drafts are then right about a quarter of the time, so both the
accepted and the rejected paths run (the tests check both counts)."""
import pytest
import torch

from helpers import conversations
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.errors import CheckpointError, InvalidRequestError
from vlm_sdk.testing.eagle3 import make_token_local, write_eagle3_draft
from vlm_sdk.testing.families import fixtures
from vlm_sdk.testing.hooks import local_worker

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _eagle(path, k=3):
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def pair(request, tmp_path_factory):
    """(target dir, draft dir, plain LLM, speculating LLM) of one family."""
    root = tmp_path_factory.mktemp(f"eagle_{request.param}")
    target = fixtures(request.param).make_tiny_checkpoint(root / "target", init_std=0.1)
    make_token_local(target, attention_scale=0.5)
    draft = write_eagle3_draft(target, root / "draft", aux_layer_ids=[0, 1, 1], hidden_weight=0.3)
    return target, draft, LLM(str(target), show_progress=False), \
        LLM(str(target), show_progress=False, speculative_config=_eagle(draft))


def _tokens(llm, convs, params):
    return [o.token_ids for o in llm.chat(convs, params)]


def _all_free(llm):
    s = llm.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == s["num_waiting"] == 0
    assert local_worker(llm.engine).runner.requests == {}


def test_greedy_tokens_equal_with_images_and_plain_requests_in_the_batch(pair):
    _, _, plain, spec = pair
    convs = list(conversations().values())
    params = [GREEDY] * len(convs) + [SamplingParams(max_tokens=1, temperature=0.0)]  # one with no room for drafts
    convs = convs + convs[:1]
    before = spec.stats()
    assert _tokens(spec, convs, params) == _tokens(plain, convs, params)
    s = spec.stats()
    drafts, accepted = s["spec_draft_tokens"] - before["spec_draft_tokens"], \
        s["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < drafts  # drafts both accepted and rejected
    assert s["spec_method"] == "eagle3" and s["spec_draft_seconds"] > 0 and s["spec_mean_accepted_length"] > 1
    _all_free(spec)


def test_the_draft_page_is_in_every_block(pair):
    _, draft, plain, spec = pair
    c = local_worker(spec.engine).draft.cfg
    kv = local_worker(spec.engine).runner.drafter.kv
    page = 2 * spec.engine.cache_config.block_size * c.num_kv_heads * c.head_dim * kv[0].element_size()  # K and V
    assert spec.stats()["kv_bytes_per_block"] == plain.stats()["kv_bytes_per_block"] + page
    assert kv[0].shape[0] == spec.engine.cache_config.num_blocks  # one draft page per block of the pool


def test_chunked_prefill_and_preemption_mid_speculation_change_no_token(pair):
    target, draft, plain, _ = pair
    convs = [conversations()["one_image"], conversations()["multi_turn"], conversations()["text"]]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 3
    want = _tokens(plain, convs, params)
    prompt = max(len(o.prompt_token_ids) for o in plain.chat(convs, params))
    blocks = 2 * (-(-(prompt + 40) // 16)) + 1  # two full sequences and a bit: the third preempts
    cramped = LLM(str(target), show_progress=False, speculative_config=_eagle(draft), num_blocks=blocks,
                  max_num_batched_tokens=64, enable_prefix_caching=False)
    assert _tokens(cramped, convs, params) == want
    s = cramped.stats()
    assert s["num_preemptions"] > 0 and s["spec_accepted_tokens"] > 0
    _all_free(cramped)


def test_structured_output_advances_over_accepted_tokens_only(pair):
    _, _, plain, spec = pair
    conv = conversations()["one_image"]
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"regex": "((ab|cd) ){6}end"})
    want = plain.chat(conv, params)[0]
    got = spec.chat(conv, params)[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
    _all_free(spec)


def test_aux_hidden_states_are_transformers_hidden_states_at_the_default_layers(tmp_path):
    """A 6-layer target and a draft whose config names no layers: vLLM's default (2, 3, 3); after a prefill
    of an image prompt the captured states are transformers' `hidden_states[j]` (the input of layer j) at
    every position, the image's included."""
    fx = fixtures("qwen2_5_vl")
    target = fx.make_tiny_checkpoint(tmp_path / "target", num_layers=6)
    draft = write_eagle3_draft(target, tmp_path / "draft")
    llm = LLM(str(target), show_progress=False, speculative_config=_eagle(draft), enable_prefix_caching=False)
    conv = conversations()["one_image"]
    llm.chat(conv, SamplingParams(max_tokens=1, temperature=0.0))  # one step: the whole prompt
    model = local_worker(llm.engine).model
    ours = model.aux_hidden_states()  # [L, 3 * hidden]
    assert local_worker(llm.engine).draft.cfg.aux_layer_ids == (2, 3, 3)
    ref = fx.reference
    hf = ref.hf_model(str(target))
    from vlm_sdk.model_loader import load_tokenizer
    inputs = ref.hf_prompt(load_tokenizer(str(target)), ref.hf_image_processor(str(target)), hf.config, conv)
    with torch.no_grad():
        states = hf(**inputs, output_hidden_states=True).hidden_states
    want = torch.cat([states[j][0] for j in (2, 3, 3)], dim=-1)  # [L, 3 * hidden]
    assert ours.shape == want.shape
    images = inputs["mm_token_type_ids"][0].bool()
    assert images.any()
    torch.testing.assert_close(ours, want, atol=2e-4, rtol=2e-4)  # float32, two implementations' summation order


def test_a_bad_draft_is_refused_naming_what_is_wrong(pair, tmp_path):
    target, draft, _, _ = pair
    with pytest.raises(CheckpointError, match=r"\[0, 1, 7\] must be three layer indices in 0\.\.\d"):
        LLM(str(target), show_progress=False,
            speculative_config=_eagle(write_eagle3_draft(target, tmp_path / "far", aux_layer_ids=[0, 1, 7])))
    from safetensors.torch import load_file, save_file
    w = load_file(str(draft / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((draft / "config.json").read_text())
    save_file({k: v for k, v in w.items() if k != "midlayer.mlp.up_proj.weight"}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing .*midlayer\.mlp\.up_proj\.weight"):
        LLM(str(target), show_progress=False, speculative_config=_eagle(bad))
    save_file({**w, "midlayer.extra.weight": torch.zeros(2)}, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor midlayer\.extra\.weight"):
        LLM(str(target), show_progress=False, speculative_config=_eagle(bad))
    with pytest.raises(InvalidRequestError, match="needs 'model'") as e:
        LLM(str(target), show_progress=False, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    assert e.value.param == "speculative_config"
