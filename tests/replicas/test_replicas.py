"""Data-parallel replicas on Ray Serve (vlm_sdk/replicas/): one local Ray cluster (2 CPUs) and one set
of 3 tiny-model replicas for the whole module, behind the OpenAI server.

- 64 concurrent requests through the openai client: the same text as one engine gives, and every
  replica took a share (per-replica figures in /metrics);
- 8 users in multi-turn conversations about their own image: under cache-aware routing every turn
  after the first is served from the prefix cache of the replica that served the turn before, and the
  cached prompt tokens are >= 3x round-robin's on the same replicas in the same run (/metrics shows
  each replica's prefix-cache hits);
- a replica killed (SIGKILL) mid-stream fails only its own streams, with a 503 replica_lost error, the
  next requests all succeed, and Serve's replacement serves; shutdown leaves no replica process.
"""
import asyncio
import os
import signal
import time

import pytest
from openai import APIError, AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from helpers import image, process_alive as alive
from server_helpers import data_url, get
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

ray = pytest.importorskip("ray")  # a test dependency (pyproject's test extra); hidden-package test: test_replica_flags
from vlm_sdk.replicas.launch import ReplicaConfig, serve_replicas  # noqa: E402
from vlm_sdk.replicas.routing import RoutingConfig  # noqa: E402

REPLICAS = 3
# per replica: the 3 users' 4-turn conversations (13 blocks each) cache-aware routing gives a replica
BLOCKS = 44
MAX_TOKENS = 6
STATS_PERIOD_S = 0.2


@pytest.fixture(scope="module")
def replicas(tiny_ckpt, local_ray):
    llm = serve_replicas(tiny_ckpt, ReplicaConfig(data_parallel_size=REPLICAS, replica_cpus=2 / REPLICAS),
                         RoutingConfig(stats_period_s=STATS_PERIOD_S), num_blocks=BLOCKS)
    try:
        yield llm
    finally:
        pids = llm.replica_pids().values()
        asyncio.run(llm.shutdown())
        ray.shutdown()  # the processes Serve started end with the cluster (local_ray's shutdown is then a no-op)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], "replica processes left after shutdown"


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """One engine in this process, as many blocks as the replicas together."""
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0), num_blocks=REPLICAS * BLOCKS) as srv:
        yield srv


def question(i: int) -> list[dict]:
    """Request i: text only, or about one of 4 images (so replicas share some prefixes)."""
    text = f"Request {i}: describe item {i * 7 % 13} in {3 + i % 5} words."
    if i % 2:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image(64, 48, i % 4))}},
                                         {"type": "text", "text": text}]}]


async def ask_all(url: str, model: str, requests: list[list[dict]], **extra) -> list:
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        return await asyncio.gather(*(client.chat.completions.create(
            model=model, messages=m, max_tokens=MAX_TOKENS, temperature=0, **extra) for m in requests))


def replica_figures(url: str, name: str) -> dict[str, float]:
    """vlm_sdk_replica_<name>{replica=...} from /metrics: replica id -> value."""
    status, text = get(url, "/metrics", key=None)
    assert status == 200
    return {s.labels["replica"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in (f"vlm_sdk_replica_{name}", f"vlm_sdk_replica_{name}_total")}


def test_replicas_answer_64_concurrent_requests_as_one_engine_does(replicas, reference, tiny_ckpt):
    requests = [question(i) for i in range(64)]
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0), engine=replicas.with_routing(RoutingConfig())) as srv:
        got = asyncio.run(ask_all(srv.url, srv.model_name, requests))
        prompt_tokens = replica_figures(srv.url, "prompt_tokens")
    want = asyncio.run(ask_all(reference.url, reference.model_name, requests))
    assert [c.choices[0].message.content for c in got] == [c.choices[0].message.content for c in want]
    assert [c.usage.prompt_tokens for c in got] == [c.usage.prompt_tokens for c in want]
    assert len(prompt_tokens) == REPLICAS and min(prompt_tokens.values()) > 0, prompt_tokens  # every one served


USERS, TURNS = 8, 4


def conversation(user: int, answers: list[str]) -> list[dict]:
    """User `user`'s chat about their own image, after `answers` (one per earlier turn)."""
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image(160, 120, 100 + user))}},
                                         {"type": "text", "text": f"I am user {user}. What is in my picture?"}]}]
    for turn, answer in enumerate(answers, start=1):
        msgs += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": f"Turn {turn + 1}: and what colour is the part on the left?"}]
    return msgs


async def chats(srv, run: str) -> list[list]:
    """Every user's conversation, one request at a time in turn order (user 0's turn 1, user 1's turn 1,
    ..., user 0's turn 2, ...), so round robin's placement is the request count modulo the replicas:
    with 8 users on 3 replicas a user's turn lands where their turn 3 turns back ran, never the last 2. [user][turn]
    -> the response. Each user is a tenant (a cache salt of its own, per run), so no user's blocks
    serve another's, nor one run's another's."""
    answers = [[] for _ in range(USERS)]
    responses = [[] for _ in range(USERS)]
    async with AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as client:
        for _ in range(TURNS):
            for u in range(USERS):
                r = await client.chat.completions.create(
                    model=srv.model_name, messages=conversation(u, answers[u]), max_tokens=MAX_TOKENS,
                    temperature=0, extra_body={"cache_salt": f"{run}-{u}"})
                answers[u].append(r.choices[0].message.content)
                responses[u].append(r)
    return responses


def cached(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_cache_aware_routing_keeps_each_users_turns_on_one_replica(replicas, tiny_ckpt):
    block = replicas.stats()["kv_block_size"]
    runs, hits = {}, {}
    for policy in ("round_robin", "cache_aware"):
        with BackgroundServer(tiny_ckpt, ServerConfig(port=0),
                              engine=replicas.with_routing(RoutingConfig(policy=policy))) as srv:
            before = replica_figures(srv.url, "prefix_cache_hit_tokens")
            runs[policy] = asyncio.run(chats(srv, policy))
            time.sleep(3 * STATS_PERIOD_S)  # every replica's last report is in
            after = replica_figures(srv.url, "prefix_cache_hit_tokens")
        hits[policy] = {r: after[r] - before.get(r, 0) for r in after}
    print({p: [[(r.usage.prompt_tokens, cached(r)) for r in u] for u in rs] for p, rs in runs.items()}, hits)
    for user, turns in enumerate(runs["cache_aware"]):
        for prev, now in zip(turns, turns[1:]):
            # the previous turn's whole blocks: only the replica that served it holds this user's blocks
            assert cached(now) >= prev.usage.prompt_tokens // block * block, (user, cached(now), prev.usage)
    total = {policy: sum(cached(r) for turns in rs for r in turns) for policy, rs in runs.items()}
    assert total["cache_aware"] >= 3 * total["round_robin"], total
    # /metrics shows each replica's prefix-cache hits; together they are the users' cached tokens
    assert sum(hits["cache_aware"].values()) == total["cache_aware"], hits
    assert sum(v > 0 for v in hits["cache_aware"].values()) >= REPLICAS - 1, hits  # the users were spread


async def long_streams(srv, count: int, started: asyncio.Event) -> list:
    """`count` streams of 250 tokens; `started` is set once every one has sent its first chunk.
    -> ("done", finish_reason) or ("error", message) each."""
    first_chunks = 0

    async def one(client, i: int):
        nonlocal first_chunks
        finish, seen = None, False
        try:
            stream = await client.chat.completions.create(
                model=srv.model_name, messages=[{"role": "user", "content": f"Stream {i}: count to a thousand."}],
                max_tokens=250, temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if not seen:
                    seen, first_chunks = True, first_chunks + 1
                    if first_chunks == count:
                        started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            return "done", finish
        except APIError as e:
            return "error", str(e)
    async with AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0) as client:
        return await asyncio.gather(*(one(client, i) for i in range(count)))


def test_a_killed_replica_fails_only_its_streams_and_is_replaced(replicas, tiny_ckpt):
    before = set(replicas.stats()["replicas"])
    with BackgroundServer(tiny_ckpt, ServerConfig(port=0), engine=replicas.with_routing(RoutingConfig())) as srv:
        async def kill_one_mid_stream():
            started = asyncio.Event()
            streams = asyncio.ensure_future(long_streams(srv, 2 * REPLICAS, started))
            await asyncio.wait_for(started.wait(), 60)
            await asyncio.sleep(3 * STATS_PERIOD_S)  # the stats show who runs what
            running = {r: s["num_running"] for r, s in replicas.stats()["replicas"].items()}
            victim = max(running, key=running.get)
            os.kill(replicas.replica_pids()[victim], signal.SIGKILL)
            return victim, running, await streams
        victim, running, results = asyncio.run(kill_one_mid_stream())
        errors = [msg for kind, msg in results if kind == "error"]
        assert running[victim] > 0 and 0 < len(errors) < len(results), (running, results)
        assert all("replica" in msg and "retry" in msg for msg in errors), errors
        assert all(finish == "length" for kind, finish in results if kind == "done"), results
        # the router stops sending to it at once: every next request is served
        got = asyncio.run(ask_all(srv.url, srv.model_name, [question(i) for i in range(2 * REPLICAS)]))
        assert all(r.choices[0].finish_reason in ("length", "stop") for r in got)
        # Serve starts a replacement, which reports in and, owning no prefixes yet, takes new ones
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            now = set(replicas.stats()["replicas"])
            if victim not in now and len(now) == REPLICAS:
                break
            time.sleep(0.5)
        new = now - before
        assert len(new) == 1 and victim not in now, (before, now)
        asyncio.run(ask_all(srv.url, srv.model_name, [question(100 + i) for i in range(2 * REPLICAS)]))
        time.sleep(3 * STATS_PERIOD_S)
        assert replica_figures(srv.url, "prompt_tokens")[new.pop()] > 0
