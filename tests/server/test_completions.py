"""POST /v1/completions through the official `openai` client against the server on the tiny model:
text and token-id prompts (the four shapes) give what `LLM.generate` gives, streaming in the
completions shape with usage and [DONE], legacy logprobs, n per prompt, echo, stop, max_tokens'
default, the limits and errors chat has, metrics, and our own client's `completions`."""
import asyncio
import contextlib

import aiohttp
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from server_helpers import API_KEY, get, sse_events, wait_for
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

PROMPT = "Once upon a time, in a land far away,"
MAX_N, MAX_PROMPTS = 4, 6


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    config = ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny", max_n=MAX_N,
                          max_completion_prompts=MAX_PROMPTS)
    with BackgroundServer(tiny_ckpt, config) as s:
        yield s


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    """The same checkpoint through the Python API: what the server must reproduce."""
    return LLM(tiny_ckpt, show_progress=False)


def _client(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def _create(srv, **kw):
    kw.setdefault("max_tokens", 10)
    kw.setdefault("temperature", 0)
    return _client(srv).completions.create(model="tiny", **kw)


def test_text_prompt_matches_the_python_api(srv, llm):
    resp = _create(srv, prompt=PROMPT, extra_body={"ignore_eos": True})
    [ref] = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    [choice] = resp.choices
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == "tiny"
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, ref.text, "length", None)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids) and resp.usage.completion_tokens == 10
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 10


def test_token_prompts_and_lists_of_prompts(srv, llm):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    refs = llm.generate([PROMPT, "Hello there"], params)
    ids = [refs[0].prompt_token_ids, refs[1].prompt_token_ids]
    by_ids = _create(srv, prompt=ids[0], extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == refs[0].text
    for prompt in ([PROMPT, "Hello there"], ids, [PROMPT, ids[1]]):
        resp = _create(srv, prompt=prompt, extra_body={"ignore_eos": True})
        assert [(c.index, c.text) for c in resp.choices] == [(0, refs[0].text), (1, refs[1].text)]
        assert resp.usage.prompt_tokens == len(ids[0]) + len(ids[1]) and resp.usage.completion_tokens == 20


def test_max_tokens_defaults_to_16(srv):
    resp = _client(srv).completions.create(model="tiny", prompt=PROMPT, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_streaming_in_the_completions_shape_with_usage_and_done(srv):
    whole = _create(srv, prompt=[PROMPT, "Hello there"], n=2, temperature=1.0, seed=4,
                    extra_body={"ignore_eos": True})
    chunks = list(_create(srv, prompt=[PROMPT, "Hello there"], n=2, temperature=1.0, seed=4, stream=True,
                          stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts, finishes = [""] * 4, [None] * 4
    for c in chunks[:-1]:
        assert c.object == "text_completion" and c.usage is None and c.id == chunks[0].id
        [choice] = c.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            assert finishes[choice.index] is None
            finishes[choice.index] = choice.finish_reason
    assert texts == [c.text for c in whole.choices] and finishes == ["length"] * 4
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    # on the wire: every chunk but the last has "usage": null, and [DONE] ends the stream
    status, raw = _post(srv, {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": True,
                              "stream_options": {"include_usage": True}})
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert all("usage" in e and e["usage"] is None for e in events[:-2])


def _post(srv, body):
    import json
    import urllib.request
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, r.read().decode()


def test_legacy_logprobs_plain_and_streamed(srv, llm):
    [ref] = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3))
    lp = _create(srv, prompt=PROMPT, max_tokens=8, logprobs=3, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-5)
    speller = srv.server.speller
    assert lp.tokens == [speller.spell(t)[0] for t in ref.token_ids]
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets  # each token's start: the token texts before it, as vLLM counts
    for token, value, top, entry in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, ref.logprobs):
        # the 3 most likely and the sampled token (OpenAI: up to logprobs + 1); greedy: the best is sampled
        assert top[token] == value and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(value, abs=1e-5)
        assert set(top) <= {speller.spell(t)[0] for t, _ in entry.top_logprobs} | {token}
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in _create(srv, prompt=PROMPT, max_tokens=8, logprobs=3, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(chunk.choices[0].logprobs, key)
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}
    zero = _create(srv, prompt=PROMPT, max_tokens=3, logprobs=0).choices[0].logprobs
    assert all(len(top) == 1 and top[t] == v for t, top, v in zip(zero.tokens, zero.top_logprobs,
                                                                    zero.token_logprobs))


def test_seeded_choices_per_prompt(srv, llm):
    resp = _create(srv, prompt=PROMPT, n=3, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    texts = [c.text for c in resp.choices]
    assert [c.index for c in resp.choices] == [0, 1, 2] and len(set(texts)) == 3
    [alone] = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=12, ignore_eos=True))
    assert alone.text == texts[1]  # choice i draws from seed + i
    assert resp.usage.prompt_tokens == len(alone.prompt_token_ids) and resp.usage.completion_tokens == 30


def test_echo(srv, llm):
    [ref] = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    resp = _create(srv, prompt=PROMPT, max_tokens=5, echo=True, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == PROMPT + ref.text
    by_ids = _create(srv, prompt=ref.prompt_token_ids, max_tokens=5, echo=True, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == PROMPT + ref.text  # the ids' decoding
    streamed = "".join(c.choices[0].text for c in _create(srv, prompt=PROMPT, max_tokens=5, echo=True, stream=True,
                                                          extra_body={"ignore_eos": True}))
    assert streamed == PROMPT + ref.text
    only = _create(srv, prompt=[PROMPT, "Hi"], max_tokens=0, echo=True)  # the prompts back, nothing generated
    assert [(c.text, c.finish_reason) for c in only.choices] == [(PROMPT, "length"), ("Hi", "length")]
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == len(ref.prompt_token_ids) + len(
        llm.generate("Hi", SamplingParams(max_tokens=1))[0].prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as info:
        _create(srv, prompt=PROMPT, echo=True, logprobs=1)
    assert info.value.body["param"] == "logprobs" and "prompt tokens' logprobs" in info.value.message


def test_stop_string_ends_the_text(srv):
    full = _create(srv, prompt=PROMPT, max_tokens=20, extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = _create(srv, prompt=PROMPT, max_tokens=20, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_errors_are_400s_naming_the_numbers_and_leave_no_block(srv):
    limit = srv.stats()["max_model_len"]
    cases = [
        (dict(prompt=[3, 10 ** 6]), "prompt", None, ["outside the vocabulary", "1000000 (position 1)"]),
        (dict(prompt=["ok", [3, -1]]), "prompt", None, ["-1"]),
        (dict(prompt=[1] * (limit + 1)), "prompt", "context_length_exceeded", [f"{limit + 1} tokens"]),
        (dict(prompt=["fine", [1] * (limit + 1)]), "prompt", "context_length_exceeded", ["prompt 1:"]),
        (dict(prompt=[1] * 10, max_tokens=limit), "max_tokens", "context_length_exceeded",
         [f"'max_tokens' is {limit}", "10 tokens", f"at most {limit - 10}"]),
        (dict(prompt=["a"] * (MAX_PROMPTS + 1)), "prompt", "too_many_prompts", ["--max-completion-prompts"]),
        (dict(prompt=PROMPT, n=MAX_N + 1), "n", "too_many_choices", ["--max-n"]),
        (dict(prompt=PROMPT, suffix="!"), "suffix", "unsupported_parameter", ["'suffix'"]),
        (dict(prompt=PROMPT, best_of=2), "best_of", "unsupported_parameter", ["'best_of'"]),
        (dict(prompt=""), "prompt", None, ["empty"]),
        # 2 MB of text: refused from its length before it is tokenized whole, as a chat message is
        (dict(prompt="word " * 400_000), "prompt", "context_length_exceeded", ["more than", "Shorten the text"]),
    ]
    for kw, param, code, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            _create(srv, **kw)
        assert (info.value.body["param"], info.value.body["code"]) == (param, code), info.value.body
        for word in words:
            assert word in info.value.message, info.value.message
    placeholder = srv.server.engine.engine.inputs.processor.image_token_id
    with pytest.raises(openai.BadRequestError, match="image placeholder"):
        _create(srv, prompt=[1, placeholder])
    with pytest.raises(openai.NotFoundError):
        _client(srv).completions.create(model="nope", prompt="x")
    stats = srv.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert _create(srv, prompt=PROMPT, max_tokens=2).choices[0].finish_reason  # serving on


def test_cache_salt_keeps_cached_blocks_apart(srv):
    """vLLM's cache_salt on completions: the same prompt under another salt shares no block."""
    prompt = "A prompt long enough to fill more than one block of the prefix cache, " * 3
    _create(srv, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-a"})
    same = _create(srv, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-a"})
    other = _create(srv, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-b"})
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as info:
        _create(srv, prompt=prompt, extra_body={"cache_salt": ""})
    assert info.value.body["param"] == "cache_salt"


def test_metrics_count_completions(srv):
    def samples():
        text = get(srv.url, "/metrics")[1]
        return {(s.name, s.labels.get("finished_reason", ""), s.labels.get("status", "")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}
    before = samples()
    _create(srv, prompt=[PROMPT, "Hi"], n=2, max_tokens=3, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):
        _create(srv, prompt=[10 ** 6])
    after = samples()
    ttft = ("vlm_sdk_time_to_first_token_seconds_count", "", "")
    assert after[ttft] - before[ttft] == 1  # one request
    length = ("vlm_sdk_request_success_total", "length", "")
    assert after[length] - before.get(length, 0) == 4  # every choice's finish reason
    refused = ("vlm_sdk_request_errors_total", "", "400")
    assert after[refused] - before.get(refused, 0) == 1


def test_leaving_a_stream_aborts_every_choice(srv):
    body = {"model": "tiny", "prompt": [PROMPT, "Hi"], "n": 2, "max_tokens": 400, "ignore_eos": True,
            "temperature": 1.0, "stream": True}

    async def leave():
        async with aiohttp.ClientSession() as session:
            async with session.post(srv.url + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
                assert resp.status == 200
                seen = 0
                async for line in resp.content:
                    seen += line.startswith(b"data: ")
                    if seen >= 8:
                        assert srv.stats()["num_running"] == 4
                        return
    asyncio.run(leave())
    assert wait_for(lambda: srv.stats()["num_running"] == 0 and srv.stats()["kv_blocks_used"] == 0)


def test_our_client_completions(srv, llm):
    from vlm_sdk.client import AsyncClient, BadRequestError
    [ref] = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))

    async def main():
        async with AsyncClient(srv.url, api_key=API_KEY) as client:
            result = await client.completions(PROMPT, max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
            two = await client.completions([PROMPT, ref.prompt_token_ids], max_tokens=6, temperature=0,
                                           ignore_eos=True)
            async with contextlib.aclosing(client.completions_stream(PROMPT, max_tokens=6, temperature=0,
                                                                     ignore_eos=True)) as stream:
                deltas = [d async for d in stream]
            with pytest.raises(BadRequestError) as info:
                await client.completions([10 ** 6])
            return result, two, deltas, info.value
    result, two, deltas, err = asyncio.run(main())
    assert result.text == ref.text and result.finish_reason == "length" and result.usage.completion_tokens == 6
    assert result.choices[0].logprobs["token_logprobs"] == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-5)
    assert two.texts == (ref.text, ref.text) and [c.index for c in two.choices] == [0, 1]
    assert "".join(d.text for d in deltas) == ref.text and deltas[-1].usage.completion_tokens == 6
    assert err.status == 400 and err.param == "prompt"
