"""End to end on the tiny Qwen2.5-VL checkpoint: greedy tokens equal transformers' generate, alone and
batched; streamed deltas and metrics; the published flat layout gives the same tokens. Behaviour every
family shares (preemption, chunked prefill, seeded sampling, stops) is in test_families.py."""
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
