"""End to end on the tiny checkpoint: greedy tokens equal transformers' generate, alone and batched;
preemption changes nothing; seeded sampling is reproducible."""
import pytest
import torch

from helpers import conversations
from vlm_sdk import LLM, SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, show_progress=False)


@pytest.fixture(scope="module")
def hf_reference(tiny_ckpt):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from vlm_sdk.model_loader import read_checkpoint
    from vlm_sdk.models.qwen2_5_vl.reference import hf_image_processor, hf_prompt
    from vlm_sdk.testing.reference import hf_greedy
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    proc = hf_image_processor(str(tiny_ckpt))
    eos = read_checkpoint(tiny_ckpt).eos_token_ids
    ref = {}
    for name, conv in conversations().items():
        inputs = hf_prompt(tok, proc, model.config, conv)
        ref[name] = (inputs["input_ids"][0].tolist(), hf_greedy(model, inputs, MAX_TOKENS, eos)[0])
    return ref


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.mark.parametrize("name", list(conversations()))
def test_greedy_alone_equals_transformers(llm, hf_reference, name):
    prompt_ids, expected = hf_reference[name]
    out = llm.chat(conversations()[name], GREEDY)[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.token_ids == expected
    assert len(set(expected)) > 3, "random weights gave a degenerate reference; the test would be weak"
    assert out.finish_reason == ("length" if len(expected) == MAX_TOKENS and expected[-1] not in
                                 llm.engine.eos_token_ids else "stop")
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_greedy_batched_equals_transformers(llm, hf_reference):
    names = list(conversations())
    outs = llm.chat([conversations()[n] for n in names], GREEDY)
    assert [o.token_ids for o in outs] == [hf_reference[n][1] for n in names]
    assert llm.stats()["kv_blocks_used"] == 0


def test_preemption_changes_nothing(tiny_ckpt, llm):
    convs = list(conversations().values())
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    free = llm.chat(convs, params)
    longest = max(len(o.prompt_token_ids) + 40 for o in free)
    need = sum(-(-(len(o.prompt_token_ids) + 40) // 16) for o in free)
    blocks = -(-longest // 16) + 1  # the longest fits alone; all four together need `need` blocks
    assert blocks < need
    tight = LLM(tiny_ckpt, num_blocks=blocks, show_progress=False)
    outs = tight.chat(convs, params)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in free]
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_chunked_prefill_changes_nothing(tiny_ckpt, llm):
    convs = list(conversations().values())
    free = llm.chat(convs, GREEDY)
    chunked = LLM(tiny_ckpt, max_num_batched_tokens=13, show_progress=False)
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


def test_stop_strings_and_stop_tokens(llm):
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


def test_metrics_and_single_conversation_form(llm):
    conv = conversations()["two_images"]
    outs = llm.chat(conv, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(outs) == 1
    m = outs[0].metrics
    assert m.prompt_tokens == len(outs[0].prompt_token_ids)
    assert m.image_tokens > 0 and m.generated_tokens == 5 == len(outs[0].token_ids)
    assert 0 <= m.time_to_first_token <= m.e2e_time


def test_streamed_deltas_never_show_a_stop_string(tiny_ckpt, llm):
    """Deltas hold back a possible stop-string prefix, so what was streamed is exactly the final text."""
    import asyncio
    from vlm_sdk import AsyncLLM
    conv = conversations()["text"]
    full = llm.chat(conv, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop = full.text[8:12]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])

    async def stream():
        async with AsyncLLM(tiny_ckpt, show_progress=False) as engine:
            outs = [o async for o in engine.chat_stream(conv, params)]
        return outs

    outs = asyncio.run(stream())
    streamed = "".join(o.delta_text for o in outs)
    assert streamed == outs[-1].text == full.text[:full.text.find(stop)]
    assert all(o.text == "".join(p.delta_text for p in outs[:i + 1]) for i, o in enumerate(outs))
    assert stop not in streamed and outs[-1].finish_reason == "stop"


def test_bad_params_entry_adds_nothing(llm):
    from vlm_sdk.errors import InvalidRequestError
    convs = [conversations()["text"], conversations()["one_image"]]
    with pytest.raises(InvalidRequestError, match="sampling params 1"):
        llm.chat(convs, [SamplingParams(max_tokens=4), {"max_tokens": 4}])
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0
    assert not llm.engine.requests


def test_streamed_metrics_are_snapshots(tiny_ckpt):
    """Each streamed output keeps the metrics of its moment; the engine's later steps do not change it."""
    import asyncio
    from vlm_sdk import AsyncLLM

    async def stream():
        async with AsyncLLM(tiny_ckpt, show_progress=False) as engine:
            return [o async for o in engine.chat_stream(
                conversations()["text"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]

    outs = asyncio.run(stream())
    assert [o.metrics.generated_tokens for o in outs] == [1, 2, 3, 4, 5, 6]
    assert outs[0].metrics.finished_time is None and outs[-1].metrics.finished_time is not None


def test_published_flat_layout_sharded_checkpoint_runs_the_same(tiny_ckpt_flat, llm):
    """The published config layout (rope_scaling, flat text fields), flat preprocessor config and
    sharded safetensors load into the same engine and give the same tokens as the nested layout."""
    flat = LLM(tiny_ckpt_flat, show_progress=False)
    convs = list(conversations().values())
    assert [o.token_ids for o in flat.chat(convs, GREEDY)] == [o.token_ids for o in llm.chat(convs, GREEDY)]
