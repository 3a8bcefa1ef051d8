"""The server as clients meet it: the official `openai` package unchanged, 64 concurrent streams,
clients that leave, /health while the engine is busy, and /metrics moving with load."""
import asyncio
import json
import threading
import time

import aiohttp
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from helpers import image
from server_helpers import API_KEY, data_url, get, image_message, post, sse_events, wait_for
from vlm_sdk.testing.families import fixtures
from vlm_sdk import LLM, SamplingParams
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

IMG = image(300, 200, 1)
QUESTION = "What is in this image?"


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny")) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """The same request through the Python API: what the server must reproduce."""
    llm = LLM(tiny_ckpt, show_progress=False)
    conv = [{"role": "user", "content": [{"type": "image", "image": IMG}, {"type": "text", "text": QUESTION}]}]
    return llm.chat(conv, SamplingParams(max_tokens=12, temperature=0.0))[0]


def _client(srv) -> OpenAI:
    return OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0)


def test_openai_client_non_streaming_with_image(srv, reference):
    resp = _client(srv).chat.completions.create(
        model="tiny", messages=image_message(data_url(IMG), QUESTION), max_tokens=12, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == reference.text
    assert choice.finish_reason == reference.finish_reason
    # usage counts image tokens in the prompt, exactly as the engine saw it
    assert resp.usage.prompt_tokens == len(reference.prompt_token_ids)
    assert reference.metrics.image_tokens > 0
    assert resp.usage.completion_tokens == len(reference.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens == 0  # the first request this server sees
    assert resp.model == "tiny" and resp.id.startswith("chatcmpl-")


def test_openai_client_streaming_with_image_and_usage(srv, reference):
    stream = _client(srv).chat.completions.create(
        model="tiny", messages=image_message(data_url(IMG), QUESTION), max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [reference.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(reference.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == len(reference.token_ids)
    # the same prompt as the previous test's: what it left in the prefix cache may serve this one
    assert 0 <= chunks[-1].usage.prompt_tokens_details.cached_tokens < chunks[-1].usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # it really streamed


def test_openai_client_models_and_typed_errors(srv):
    client = _client(srv)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    import openai
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert "'tiny'" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], top_p=7)
    assert info.value.body["param"] == "top_p"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_stop_seed_and_max_completion_tokens(srv, tiny_ckpt):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_completion_tokens": 20, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 7}
    status, a = post(srv.url, body)
    status_b, b = post(srv.url, body)
    assert status == status_b == 200 and a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["completion_tokens"] <= 20
    text = a["choices"][0]["message"]["content"]
    if len(text) > 4:  # cut at a stop string taken from the seeded answer itself
        stop = text[2:4]
        status, c = post(srv.url, {**body, "stop": [stop]})
        assert status == 200 and c["choices"][0]["finish_reason"] == "stop"
        assert c["choices"][0]["message"]["content"] == text[:text.index(stop)]


def _stream_body(max_tokens: int, img=None) -> dict:
    msgs = image_message(data_url(img), QUESTION) if img is not None else [{"role": "user", "content": "Hello"}]
    return {"model": "tiny", "messages": msgs, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


HEADERS = {"Authorization": f"Bearer {API_KEY}"}


async def _stream(session, url, body, leave_after: int | None = None) -> dict:
    """Read an SSE stream; with leave_after, disconnect after that many content chunks."""
    async with session.post(url + "/v1/chat/completions", json=body, headers=HEADERS) as resp:
        assert resp.status == 200, await resp.text()
        seen, events = 0, []
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if isinstance(events[-1], dict) and events[-1].get("choices") and \
                    events[-1]["choices"][0]["delta"].get("content"):
                seen += 1
                if leave_after is not None and seen >= leave_after:
                    resp.close()  # the client goes away mid-stream
                    return {"left": True}
        return {"events": events}


def test_64_concurrent_streams_complete_and_free_every_block(srv):
    images = [image(96 + 8 * (i % 5), 80, i) for i in range(64)]

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*[_stream(session, srv.url, _stream_body(8, img)) for img in images])

    results = asyncio.run(main())
    for r in results:
        events = r["events"]
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 8
        assert [e["choices"][0]["finish_reason"] for e in events[:-2] if e["choices"][0]["finish_reason"]] == ["length"]
    assert wait_for(lambda: srv.stats()["kv_blocks_used"] == 0)
    assert srv.stats()["num_running"] == 0 and srv.stats()["num_waiting"] == 0


def test_clients_that_disconnect_mid_stream_leave_no_blocks(srv):
    async def main():
        async with aiohttp.ClientSession() as session:
            leavers = [_stream(session, srv.url, _stream_body(3000, IMG), leave_after=2) for _ in range(8)]
            stayer = _stream(session, srv.url, _stream_body(16))
            return await asyncio.gather(stayer, *leavers)

    stayer, *leavers = asyncio.run(main())
    assert all(r == {"left": True} for r in leavers)
    assert stayer["events"][-2]["usage"]["completion_tokens"] == 16
    # aborted at once: 3000 tokens each would take far longer than this wait
    assert wait_for(lambda: srv.stats()["kv_blocks_used"] == 0 and srv.stats()["num_running"] == 0, timeout=5)


def test_non_streaming_client_that_leaves_aborts_its_request(srv):
    body = dict(_stream_body(3000), stream=False)
    del body["stream_options"]  # only with stream: true (a 400 otherwise, as in vLLM)

    async def main():
        async with aiohttp.ClientSession() as session:
            task = asyncio.ensure_future(session.post(srv.url + "/v1/chat/completions", json=body, headers=HEADERS))
            assert await asyncio.to_thread(wait_for, lambda: srv.stats()["num_running"] == 1, 10)
            task.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert wait_for(lambda: srv.stats()["kv_blocks_used"] == 0 and srv.stats()["num_running"] == 0, timeout=5)


def test_health_stays_fast_during_a_long_generation(srv):
    result = {}

    def long_request():
        result["resp"] = post(srv.url, _stream_body(1500))

    worker = threading.Thread(target=long_request)
    worker.start()
    assert wait_for(lambda: srv.stats()["num_running"] == 1, timeout=10)
    latencies = []
    while worker.is_alive() and len(latencies) < 40:
        t0 = time.perf_counter()
        status, _ = get(srv.url, "/health", key=None)
        latencies.append(time.perf_counter() - t0)
        assert status == 200
        time.sleep(0.02)
    still_running = srv.stats()["num_running"] == 1
    worker.join()
    assert still_running, "the generation ended before the probes did; make it longer"
    assert len(latencies) >= 10
    latencies.sort()
    # the loop is free: the median probe is a few ms; the slowest stays well under a blocked loop's seconds
    # (0.25 s: a machine shared with other work stalls any one probe now and then)
    assert latencies[len(latencies) // 2] < 0.05 and latencies[-1] < 0.25, latencies
    status, text = result["resp"]
    assert status == 200 and sse_events(text)[-2]["usage"]["completion_tokens"] == 1500


def _metrics(srv) -> dict:
    status, text = get(srv.url, "/metrics", key=None)
    assert status == 200
    values = {}
    for family in text_string_to_metric_families(text):  # raises on anything that is not Prometheus text
        for sample in family.samples:
            values[(sample.name, sample.labels.get("le"))] = sample.value
    return values


def test_metrics_parse_and_move_with_load(srv):
    before = _metrics(srv)
    for name in ("vlm_sdk_kv_blocks_total", "vlm_sdk_kv_blocks_used", "vlm_sdk_kv_cache_usage_ratio",
                 "vlm_sdk_num_requests_running", "vlm_sdk_num_requests_waiting", "vlm_sdk_num_preemptions_total",
                 "vlm_sdk_prompt_tokens_total", "vlm_sdk_image_tokens_total", "vlm_sdk_generation_tokens_total",
                 "vlm_sdk_time_to_first_token_seconds_count", "vlm_sdk_time_per_output_token_seconds_count",
                 "vlm_sdk_e2e_request_latency_seconds_count", "vlm_sdk_image_preprocess_seconds_count",
                 "vlm_sdk_prefix_cache_hit_tokens_total", "vlm_sdk_prefix_cache_query_tokens_total",
                 "vlm_sdk_kv_blocks_cached", "vlm_sdk_encoder_cache_hits_total",
                 "vlm_sdk_encoder_cache_queries_total", "vlm_sdk_encoder_cache_bytes"):
        assert (name, None) in before, name
    assert before[("vlm_sdk_kv_blocks_total", None)] == srv.stats()["kv_blocks_total"]
    assert before[("vlm_sdk_kv_blocks_free", None)] == srv.stats()["kv_blocks_total"]
    assert before[("vlm_sdk_largest_prompt_tokens_now", None)] == srv.stats()["max_model_len"]
    assert before[("vlm_sdk_num_preemptions_last_minute", None)] == 0

    # during a long request the cache gauges show it
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=post(srv.url, _stream_body(600, IMG))))
    worker.start()
    assert wait_for(lambda: srv.stats()["num_running"] == 1, timeout=10)
    during = _metrics(srv)
    worker.join()
    assert during[("vlm_sdk_num_requests_running", None)] == 1
    assert during[("vlm_sdk_kv_blocks_used", None)] > 0 and during[("vlm_sdk_kv_cache_usage_ratio", None)] > 0
    assert during[("vlm_sdk_kv_blocks_free", None)] + during[("vlm_sdk_kv_blocks_used", None)] == \
        during[("vlm_sdk_kv_blocks_total", None)]

    after = _metrics(srv)
    usage = sse_events(result["r"][1])[-2]["usage"]
    assert after[("vlm_sdk_generation_tokens_total", None)] - before[("vlm_sdk_generation_tokens_total", None)] == 600
    assert after[("vlm_sdk_prompt_tokens_total", None)] - before[("vlm_sdk_prompt_tokens_total", None)] == \
        usage["prompt_tokens"]
    assert after[("vlm_sdk_image_tokens_total", None)] > before[("vlm_sdk_image_tokens_total", None)]
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency", "image_preprocess"):
        key = (f"vlm_sdk_{hist}_seconds_count", None)
        assert after[key] == before[key] + 1, hist
    assert after[("vlm_sdk_kv_blocks_used", None)] == 0


def test_prebuilt_chunks_equal_the_plain_json_chunk():
    from vlm_sdk.server.chat_responses import ChunkWriter, chunk_body
    for include_usage in (True, False):
        writer = ChunkWriter("chatcmpl-1", "m\"odel", 5, include_usage)
        for text in ("hi", 'q"uo\\te\n', "é中\u2028", ""):
            line = writer.content(text)
            assert line.startswith("data: ") and line.endswith("\n\n")
            assert json.loads(line[6:-2]) == chunk_body("chatcmpl-1", "m\"odel", 5, {"content": text}, None,
                                                        include_usage)


def test_allowed_media_sources_end_to_end(tiny_ckpt, tmp_path, reference):
    """http(s) from an allowed host and file:// under the allowed folder give the same answer as a
    data: URL; the same sources are refused by a server that does not allow them."""
    from aiohttp import web

    from vlm_sdk.server.config import MediaPolicy

    png = tmp_path / "media" / "img.png"
    png.parent.mkdir()
    IMG.save(png)

    async def serve_png(_request):
        return web.Response(body=png.read_bytes(), content_type="image/png")

    app = web.Application()
    app.router.add_get("/img.png", serve_png)
    holder = {}

    def run_media_server():
        loop = asyncio.new_event_loop()
        holder["loop"] = loop
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        holder["port"] = site._server.sockets[0].getsockname()[1]
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    thread = threading.Thread(target=run_media_server, daemon=True)
    thread.start()
    assert wait_for(lambda: "port" in holder)
    http_url = f"http://127.0.0.1:{holder['port']}/img.png"
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), allow_private_addresses=True,
                         allowed_local_path=str(png.parent))
    try:
        with BackgroundServer(tiny_ckpt, ServerConfig(port=0, served_model_name="tiny", media=policy)) as open_srv:
            for url in (http_url, png.as_uri()):
                status, body = post(open_srv.url, {"model": "tiny", "messages": image_message(url, QUESTION),
                                                   "max_tokens": 12, "temperature": 0})
                assert status == 200, body
                assert body["choices"][0]["message"]["content"] == reference.text
                assert body["usage"]["prompt_tokens"] == len(reference.prompt_token_ids)
        with BackgroundServer(tiny_ckpt, ServerConfig(port=0, served_model_name="tiny")) as closed_srv:
            for url, setting in ((http_url, "--allowed-media-domains"), (png.as_uri(), "--allowed-local-media-path")):
                status, body = post(closed_srv.url, {"model": "tiny", "messages": image_message(url)})
                assert status == 400 and setting in body["error"]["message"], body
    finally:
        holder["loop"].call_soon_threadsafe(holder["loop"].stop)
        thread.join(timeout=10)


def test_health_is_503_once_the_engine_stopped(tiny_ckpt):
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0, served_model_name="tiny")) as s:
        assert get(s.url, "/health", key=None)[0] == 200
        s.call(s.engine.shutdown())
        status, text = get(s.url, "/health", key=None)
        assert status == 503 and "engine has stopped" in json.loads(text)["error"]["message"]
        status, body = post(s.url, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 503 and body["error"]["type"] == "server_error"


def _direct_logprobs(tiny_ckpt, prompt: list[int], generated: list[int]):
    """transformers' log-softmax [len(generated), vocab] at the positions that chose `generated`."""
    import torch

    from vlm_sdk.models import registry
    model = fixtures("qwen2_5_vl").reference.hf_model(str(tiny_ckpt)).float()
    with torch.inference_mode():
        ids = torch.tensor([prompt + generated])  # [1, len]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()  # [len, vocab]
    return logits[len(prompt) - 1:len(prompt) - 1 + len(generated)].log_softmax(-1)


def test_logprobs_in_openai_shape_streaming_and_not(srv, tiny_ckpt):
    client = _client(srv)
    msgs = [{"role": "user", "content": "Say something."}]
    resp = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 8
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and bytes(c.bytes).decode("utf-8", "replace") == c.token
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy: the best
    # the chosen tokens' logprobs against transformers on the same prompt and tokens
    llm_out = LLM(tiny_ckpt, show_progress=False).chat(msgs, SamplingParams(max_tokens=8, temperature=0.0,
                                                                            ignore_eos=True))[0]
    direct = _direct_logprobs(tiny_ckpt, llm_out.prompt_token_ids, llm_out.token_ids)
    assert [c.logprob for c in content] == pytest.approx(
        [direct[j, t].item() for j, t in enumerate(llm_out.token_ids)], abs=1e-3)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_penalties_and_logit_bias_over_http(srv, tiny_ckpt):
    client = _client(srv)
    msgs = [{"role": "user", "content": "Say something."}]
    forced = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                            logit_bias={"42": 100}, logprobs=True)
    assert [c.bytes for c in forced.choices[0].logprobs.content] == [forced.choices[0].logprobs.content[0].bytes] * 4
    # every field reaches the sampler: the reply equals the Python API's with the same settings
    fields = dict(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={"7": 3, "11": -5})
    extra = dict(ignore_eos=True, repetition_penalty=1.3, min_tokens=2)
    reply = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, **fields,
                                           extra_body=extra).choices[0].message.content
    params = SamplingParams(max_tokens=16, temperature=0.0, **{**fields, "logit_bias": {7: 3, 11: -5}}, **extra)
    llm = LLM(tiny_ckpt, show_progress=False)
    assert reply == llm.chat(msgs, params)[0].text
    assert reply != llm.chat(msgs, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].text
