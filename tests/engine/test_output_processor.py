"""Point 7: the engine returns token ids; text, stop strings and deltas are made outside its step by
an OutputProcessor with a tokenizer of its own, which tells the engine to finish a stopped request."""
from __future__ import annotations

import asyncio

import pytest

from helpers import conversations
from server_helpers import wait_for
from vlm_sdk import LLM, AsyncLLM, SamplingParams
from vlm_sdk.outputs import LogprobColumns


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, show_progress=False)


class _Refuse:
    def __getattr__(self, name):
        raise AssertionError(f"the engine step touched the prompt tokenizer ({name})")


def test_step_never_touches_a_tokenizer(llm):
    engine = llm.engine
    assert llm.output_processor.tokenizer is not engine.inputs.tokenizer._tok  # an instance of its own
    prompts = [engine.inputs.build_prompt(c) for c in conversations().values()]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=["zzzz"])
    prompt_tok, engine.inputs.tokenizer._tok = engine.inputs.tokenizer._tok, _Refuse()
    try:
        ids = [engine.add_request(p, params) for p in prompts]
        raw = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for out in engine.step():
                assert not hasattr(out, "text")  # token ids and the engine's own finish reasons only
                raw[out.request_id].extend(out.new_token_ids)
    finally:
        engine.inputs.tokenizer._tok = prompt_tok
    expected = llm.chat(list(conversations().values()), params)
    assert [raw[rid] for rid in ids] == [o.token_ids for o in expected]


def test_stop_string_finishes_the_request_in_the_engine(llm):
    conv = conversations()["text"]
    full = llm.chat(conv, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop = full.text[3:6]
    cut = llm.chat(conv, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    assert len(cut.token_ids) < len(full.token_ids)  # the engine stopped generating
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and not llm.engine.requests


def test_async_stop_string_frees_the_engine(tiny_ckpt, llm):
    conv = conversations()["text"]
    full = llm.chat(conv, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))[0]
    stop = full.text[4:7]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, stop=[stop])

    async def main():
        async with AsyncLLM(tiny_ckpt, show_progress=False) as engine:
            outs = [o async for o in engine.chat_stream(conv, params)]
            freed = await asyncio.get_running_loop().run_in_executor(
                None, lambda: wait_for(lambda: engine.stats()["kv_blocks_used"] == 0
                                       and engine.stats()["num_running"] == 0, timeout=10))
            return outs, freed, engine.stats()

    outs, freed, stats = asyncio.run(main())
    assert outs[-1].finish_reason == "stop" and outs[-1].text == full.text[:full.text.find(stop)]
    assert freed and stats["total_generation_tokens"] < 200  # finished long before max_tokens


def test_min_tokens_holds_back_stop_strings(llm):
    """As in vLLM: a stop string that ends before min_tokens tokens is kept as text."""
    conv = [{"role": "user", "content": "Say something."}]
    greedy = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    base = llm.chat(conv, SamplingParams(**greedy))[0]
    stop = llm.tokenizer.decode(base.token_ids[1:3])
    assert stop.strip() and base.text.find(stop) < len(llm.tokenizer.decode(base.token_ids[:3]))
    early = llm.chat(conv, SamplingParams(**greedy, stop=[stop]))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 3 and stop not in early.text
    held = llm.chat(conv, SamplingParams(**greedy, stop=[stop], min_tokens=8))[0]
    assert len(held.token_ids) >= 8 and held.text.startswith(llm.tokenizer.decode(base.token_ids[:3]))
    assert held.token_ids == base.token_ids[:len(held.token_ids)]


def test_logprobs_are_kept_as_arrays_and_read_back_exactly(llm):
    """A request's logprobs live in two flat arrays (k + 1 entries a token), which every output of its
    stream views without a copy; `RequestOutput.logprobs` reads back exactly the sampler's values."""
    engine, k = llm.engine, 4
    params = SamplingParams(max_tokens=40, temperature=1.0, top_k=3, seed=3, ignore_eos=True, logprobs=k)
    prompt = engine.inputs.build_prompt(conversations()["text"])
    rid = engine.add_request(prompt, params)
    state = llm.output_processor.new_request(rid, prompt.token_ids, params)
    sampled, outputs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            sampled += out.new_logprobs
            outputs.append(state.process(out))
    assert len(sampled) == 40 and all(len(lp.top_logprobs) == k for lp in sampled)
    columns = outputs[-1].token_logprobs.columns
    assert all(o.token_logprobs.columns is columns for o in outputs)  # one store, viewed by every output
    assert (len(columns.ids), len(columns.values)) == (40 * (k + 1), 40 * (k + 1))
    assert columns.ids.itemsize == 4 and columns.values.itemsize == 4  # int32, float32
    for i, out in enumerate(outputs):
        assert out.logprobs == sampled[:i + 1]  # float32 values: exact, the -inf of a top-k cut included
    assert all(lp.top_logprobs[-1][1] == float("-inf") for lp in sampled)  # top_k 3 cut the 4th best
    assert outputs[-1].token_logprobs.tokens(30) == sampled[30:]
    # outputs compare by value, as when they held lists: a second store of the same tokens is equal
    again = LogprobColumns(k)
    for lp in sampled[:5]:
        again.append(lp)
    assert outputs[4].token_logprobs == again.view() and outputs[5].token_logprobs != again.view()
