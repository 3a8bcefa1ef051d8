"""Behaviour every model family shares, run on each registered family's tiny checkpoint
(`vlm_sdk.models.registry.family_names()`): chunked prefill changes no token (preemption: the prefix-cache
tests), seeded
sampling is reproducible alone and in a batch, stop strings and stop ids, metrics, a bad params entry;
and greedy tokens equal transformers' on the same checkpoint, through each family's reference hooks."""
import pytest

from helpers import SAMPLE_IMAGE, chunk_budget, conversations
from vlm_sdk.testing.families import fixtures
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.models import registry

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def llm(family_ckpt):
    return LLM(family_ckpt[1], show_progress=False)


# preemption and recompute: tests/e2e/test_prefix_caching.py::test_preempted_requests_find_their_blocks_and_change_no_token


def test_chunked_prefill_changes_no_token(family_ckpt, llm):
    convs = list(conversations().values())
    free = llm.chat(convs, GREEDY)
    chunked = LLM(family_ckpt[1], max_num_batched_tokens=chunk_budget(llm), show_progress=False)
    assert [o.token_ids for o in chunked.chat(convs, GREEDY)] == [o.token_ids for o in free]


def test_seeded_sampling_reproducible_alone_and_in_batch(llm):
    convs = conversations()
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.chat(convs["one_image"], seeded)[0].token_ids
    again = llm.chat(convs["one_image"], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=0.8), seeded, SamplingParams(max_tokens=7, temperature=1.0)]
    batch = llm.chat([convs["text"], convs["one_image"], convs["two_images"]], others)
    assert alone == again == batch[1].token_ids
    other_seed = llm.chat(convs["one_image"], SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9,
                                                             seed=99))[0].token_ids
    assert other_seed != alone


def test_stop_strings_and_stop_token_ids_end_the_output_where_they_say(llm):
    conv = conversations()["text"]
    full = llm.chat(conv, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = llm.chat(conv, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    tok = full.token_ids[5]
    by_id = llm.chat(conv, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                          stop_token_ids=[tok]))[0]
    first = full.token_ids.index(tok)
    assert by_id.finish_reason == "stop" and by_id.token_ids == full.token_ids[:first + 1]


def test_one_conversation_gives_one_output_with_its_metrics(llm):
    conv = conversations()["two_images"]
    outs = llm.chat(conv, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(outs) == 1
    m = outs[0].metrics
    assert m.prompt_tokens == len(outs[0].prompt_token_ids)
    assert m.image_tokens > 0 and m.generated_tokens == 5 == len(outs[0].token_ids)
    assert 0 <= m.time_to_first_token <= m.e2e_time


def test_a_bad_sampling_params_entry_adds_no_request(llm):
    from vlm_sdk.errors import InvalidRequestError
    convs = [conversations()["text"], conversations()["one_image"]]
    with pytest.raises(InvalidRequestError, match="sampling params 1"):
        llm.chat(convs, [SamplingParams(max_tokens=4), {"max_tokens": 4}])
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0
    assert not llm.engine.requests


def test_greedy_tokens_equal_transformers_generate(family_ckpt, llm):
    """The engine, knowing no family, against transformers' own class through the family's reference
    (`FamilySpec.reference`): same prompt ids, same greedy tokens, for an image + text and a text-only
    conversation batched together."""
    from transformers import AutoTokenizer

    from vlm_sdk.testing.reference import hf_batch, hf_greedy
    family, path = family_ckpt
    ref = fixtures(family).reference
    convs = [[{"role": "user", "content": [{"type": "image", "image": str(SAMPLE_IMAGE)},
                                           {"type": "text", "text": "What is in this image?"}]}],
             [{"role": "user", "content": "Say something."}]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ours = llm.chat(convs, params)
    model, tokenizer = ref.hf_model(str(path)), AutoTokenizer.from_pretrained(str(path))
    image_processor = ref.hf_image_processor(str(path))
    for conv, out in zip(convs, ours):
        inputs = ref.hf_prompt(tokenizer, image_processor, model.config, conv)
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        theirs = hf_greedy(model, hf_batch([inputs], pad), 12)[0]
        assert out.token_ids == theirs and len(set(theirs)) > 3  # varied tokens: a real comparison
