"""`n` choices over HTTP with the official `openai` client: seeded choices differ and repeat, the
prompt is built once and counted once, streamed chunks carry each choice's `index`, `--max-n` refuses
more with a 400, and a client that leaves a stream aborts every choice."""
import asyncio

import aiohttp
import openai
import pytest
from openai import OpenAI

from helpers import image
from server_helpers import API_KEY, data_url, image_message, wait_for
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

IMG = image(300, 200, 4)
MESSAGES = image_message(data_url(IMG), "What is in this image?")
MAX_N = 4


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    config = ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny", max_n=MAX_N)
    with BackgroundServer(tiny_ckpt, config) as s:
        yield s


def _client(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def _create(srv, **kw):
    return _client(srv).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.0,
                                                seed=11, extra_body={"ignore_eos": True}, **kw)


def test_three_seeded_choices_prompt_once(srv, tiny_ckpt):
    before = srv.stats()
    resp = _create(srv, n=3)
    after = srv.stats()
    assert [c.index for c in resp.choices] == [0, 1, 2]
    texts = [c.message.content for c in resp.choices]
    assert len(set(texts)) == 3  # seeds 11, 12, 13: different choices
    assert [c.message.content for c in _create(srv, n=3).choices] == texts  # and reproducible
    # choice i is what one request with seed + i answers
    llm = LLM(tiny_ckpt, show_progress=False)
    conv = [{"role": "user", "content": [{"type": "image", "image": IMG},
                                         {"type": "text", "text": "What is in this image?"}]}]
    [alone] = llm.chat(conv, SamplingParams(seed=12, temperature=1.0, max_tokens=10, ignore_eos=True))
    assert alone.text == texts[1]
    # usage: the prompt once, the completions of all three
    assert resp.usage.prompt_tokens == len(alone.prompt_token_ids)
    assert resp.usage.completion_tokens == 30
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 30
    # the other two choices were served the first's prompt blocks, and the image encoded once
    block = after["kv_block_size"]
    shared = (resp.usage.prompt_tokens - 1) // block * block
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 2 * shared > 0
    assert (after["encoder_cache_queries"] - before["encoder_cache_queries"]
            - (after["encoder_cache_hits"] - before["encoder_cache_hits"])) == 1


def test_streamed_choices_carry_their_index(srv):
    whole = _create(srv, n=3)
    chunks = list(_create(srv, n=3, stream=True, stream_options={"include_usage": True}))
    texts, finishes, roles = ["", "", ""], [None] * 3, []
    for c in chunks[:-1]:
        [choice] = c.choices
        if choice.delta.role:
            roles.append(choice.index)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            assert finishes[choice.index] is None
            finishes[choice.index] = choice.finish_reason
    assert sorted(roles) == [0, 1, 2] and finishes == ["length"] * 3
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_every_choice_has_its_own_logprobs_plain_and_streamed(srv):
    whole = _create(srv, n=2, logprobs=True, top_logprobs=2)
    for c in whole.choices:
        assert len(c.logprobs.content) == 10 and all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
    assert [e.token for e in whole.choices[0].logprobs.content] != [e.token for e in whole.choices[1].logprobs.content]
    streamed = [[], []]
    for chunk in _create(srv, n=2, logprobs=True, top_logprobs=2, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed[choice.index] += [e.token for e in choice.logprobs.content]
    assert streamed == [[e.token for e in c.logprobs.content] for c in whole.choices]


def test_max_n_and_bad_n_are_400(srv):
    with pytest.raises(openai.BadRequestError) as info:
        _create(srv, n=MAX_N + 1)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "n" and info.value.body["code"] == "too_many_choices"
    assert f"at most {MAX_N}" in info.value.message and "--max-n" in info.value.message
    for bad in (0, 1.5, "2"):
        with pytest.raises(openai.BadRequestError) as info:
            _create(srv, n=bad)
        assert info.value.body["param"] == "n"
    assert srv.stats()["kv_blocks_used"] == 0


def test_leaving_a_stream_aborts_every_choice(srv):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "n": 3,
            "temperature": 1.0, "stream": True}

    async def leave():
        async with aiohttp.ClientSession() as session:
            async with session.post(srv.url + "/v1/chat/completions", json=body,
                                    headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
                assert resp.status == 200
                seen = 0
                async for line in resp.content:
                    seen += line.startswith(b"data: ") and b'"content":"' in line
                    if seen >= 6:
                        return srv.stats()["num_running"]  # read before the connection closes

    running = asyncio.run(leave())
    assert running == 3  # every choice still generating when the client left
    assert wait_for(lambda: srv.stats()["num_running"] == 0 and srv.stats()["kv_blocks_used"] == 0)


def test_max_n_flag():
    import argparse

    from vlm_sdk.server.cli import add_serve_arguments
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["m"]).max_n == ServerConfig().max_n == 8
    assert parser.parse_args(["m", "--max-n", "3"]).max_n == 3
    with pytest.raises(SystemExit):  # 0 would refuse every request
        parser.parse_args(["m", "--max-n", "0"])
    assert parser.parse_args(["m"]).max_sequences_per_request == ServerConfig().max_sequences_per_request == 64
    assert parser.parse_args(["m", "--max-sequences-per-request", "16"]).max_sequences_per_request == 16


def test_prebuilt_chunks_carry_the_index():
    import json

    from vlm_sdk.server.chat_responses import ChunkWriter, chunk_body
    writer = ChunkWriter("chatcmpl-1", "tiny", 5, True)
    for index in (0, 3):
        line = writer.content('a"b', index)
        assert json.loads(line[6:-2]) == chunk_body("chatcmpl-1", "tiny", 5, {"content": 'a"b'}, None, True, index)
        assert json.loads(writer.finish("stop", index)[6:-2])["choices"][0]["index"] == index


def test_async_client_reads_every_choice(srv):
    from vlm_sdk.client import AsyncClient

    async def main():
        async with AsyncClient(srv.url, API_KEY) as client:
            kw = dict(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True, n=3)
            whole = await client.chat(MESSAGES, **kw)
            texts = ["", "", ""]
            async for delta in client.chat_stream(MESSAGES, **kw):
                texts[delta.index] += delta.text
            return whole, texts

    whole, texts = asyncio.run(main())
    assert len(set(whole.texts)) == 3 and whole.text == whole.texts[0]
    assert texts == list(whole.texts)
