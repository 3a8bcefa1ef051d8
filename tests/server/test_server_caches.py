"""Prefix and encoder caches as a server's users and operators see them: `usage.prompt_tokens_details.
cached_tokens` on a follow-up turn, the same hits in `stats()` and in /metrics, and every KV block back
in the pool (`kv_blocks_used` 0) once all requests end, aborted and sharing ones included."""
import json
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import image
from server_helpers import data_url, get, post, sse_events, wait_for
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

IMG = data_url(image(300, 200, 1))
SYSTEM = "You answer questions about pictures."

# /metrics name -> stats() key
COUNTERS = {"vlm_sdk_prefix_cache_hit_tokens_total": "prefix_cache_hit_tokens",
            "vlm_sdk_prefix_cache_query_tokens_total": "prefix_cache_query_tokens",
            "vlm_sdk_encoder_cache_hits_total": "encoder_cache_hits",
            "vlm_sdk_encoder_cache_queries_total": "encoder_cache_queries"}
GAUGES = {"vlm_sdk_kv_blocks_cached": "kv_blocks_cached", "vlm_sdk_encoder_cache_bytes": "encoder_cache_bytes",
          "vlm_sdk_kv_blocks_used": "kv_blocks_used"}


@pytest.fixture
def srv(tiny_ckpt):
    """A fresh server per test: each test's counters start from a cache that has seen nothing."""
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0)) as s:
        yield s


def conversation(system: str, *turns: str) -> list[dict]:
    """A chat about IMG: the image with the first question, then (answer, question) pairs."""
    first, rest = turns[0], turns[1:]
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMG}},
                                         {"type": "text", "text": first}]}]
    for i, text in enumerate(rest):
        msgs.append({"role": "assistant" if i % 2 == 0 else "user", "content": text})
    return msgs


def ask(srv, messages: list[dict], stream: bool = False, max_tokens: int = 8) -> tuple[str, dict]:
    """(answer, usage) of one greedy request, streamed with include_usage or not."""
    body = {"model": srv.model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    status, resp = post(srv.url, body, key=None)
    assert status == 200, resp
    if not stream:
        return resp["choices"][0]["message"]["content"], resp["usage"]
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2] if e["choices"])
    return text, events[-2]["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def metrics(srv) -> dict[str, float]:
    status, text = get(srv.url, "/metrics", key=None)
    assert status == 200
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def assert_metrics_match_stats(srv) -> dict:
    """/metrics and stats() read at rest agree on every cache figure; returns the stats."""
    stats, scraped = srv.stats(), metrics(srv)
    for name, key in {**COUNTERS, **GAUGES}.items():
        assert scraped[name] == stats[key], (name, scraped[name], stats)
    return stats


def test_follow_up_turn_is_served_from_the_prefix_cache(srv):
    block = srv.stats()["kv_block_size"]
    before = assert_metrics_match_stats(srv)
    answer1, usage1 = ask(srv, conversation(SYSTEM, "What is in this image?"))
    assert cached(usage1) == 0  # nothing seen before
    # turn 2 sends the whole history again, image included; streamed, so the usage chunk carries it too
    answer2, usage2 = ask(srv, conversation(SYSTEM, "What is in this image?", answer1, "Which colour is it?"),
                          stream=True)
    # at least every full block of turn 1's prompt is reused: the history starts with that prompt
    assert usage1["prompt_tokens"] // block * block <= cached(usage2) < usage2["prompt_tokens"], (usage1, usage2)
    assert cached(usage2) % block == 0  # whole blocks only
    _, usage3 = ask(srv, conversation(SYSTEM, "What is in this image?", answer1, "Which colour is it?", answer2,
                                      "Is there text?"))
    assert cached(usage3) >= usage2["prompt_tokens"] // block * block

    after = assert_metrics_match_stats(srv)
    usages = (usage1, usage2, usage3)
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == sum(map(cached, usages))
    assert after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"] == \
        sum(u["prompt_tokens"] for u in usages)
    assert after["kv_blocks_used"] == 0 and after["kv_blocks_cached"] > 0  # free, and still reusable
    assert after["num_running"] == after["num_waiting"] == 0


def test_same_image_after_other_text_hits_the_encoder_cache(srv):
    """Another system prompt changes the first block, so no KV is shared; the image's embeddings are."""
    ask(srv, conversation(SYSTEM, "What is in this image?"))
    before = assert_metrics_match_stats(srv)
    assert before["encoder_cache_queries"] >= 1 and before["encoder_cache_bytes"] > 0
    _, usage = ask(srv, conversation("Be brief. " + SYSTEM, "What is in this image?"))
    after = assert_metrics_match_stats(srv)
    assert cached(usage) == 0  # the prompts differ from their first block on
    assert after["encoder_cache_hits"] - before["encoder_cache_hits"] == 1
    assert after["encoder_cache_queries"] - before["encoder_cache_queries"] == 1
    assert after["kv_blocks_used"] == 0


def test_users_sharing_a_prefix_leave_no_blocks_held(srv):
    """Eight users ask about the same image under the same system prompt, at once; one leaves mid-answer.
    All of them reuse the prefix a first request left, and every block returns to the pool."""
    ask(srv, conversation(SYSTEM, "What is in this image?"))
    before = srv.stats()
    results: dict[int, tuple[str, dict]] = {}

    def user(i: int) -> None:
        results[i] = ask(srv, conversation(SYSTEM, f"Question {i}: what is in the corner?"), stream=True,
                         max_tokens=24)

    def leaver() -> None:  # reads the first event, then drops the connection: the server aborts it
        body = json.dumps({"model": srv.model_name, "max_tokens": 2000, "ignore_eos": True, "stream": True,
                            "messages": conversation(SYSTEM, "Describe everything.")}).encode()
        req = urllib.request.Request(srv.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.readline().startswith(b"data: ")

    threads = [threading.Thread(target=user, args=(i,)) for i in range(8)] + [threading.Thread(target=leaver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(8))
    assert all(cached(usage) > 0 for _, usage in results.values()), results
    # the leaver's abort lands on the engine's next step
    assert wait_for(lambda: srv.stats()["num_running"] == 0, timeout=10), srv.stats()
    after = assert_metrics_match_stats(srv)
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= \
        sum(cached(u) for _, u in results.values())
    assert after["kv_blocks_used"] == 0 and after["kv_blocks_cached"] > 0, after
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
