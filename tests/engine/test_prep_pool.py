"""AsyncLLM's prompt pools (engine/input/prep_pool.py), exact orders: a kind of work per pool, one
request's jobs one at a time, the next job round-robin across requests, cancelled jobs never run."""
import threading

import pytest

from vlm_sdk.engine.input.prep_pool import FairPool, PrepPools
from vlm_sdk.engine.input.prompt_tokenizer import CHILD_TEXT_CHARS
from vlm_sdk.multimodal.messages import count_parts


def test_each_kind_of_request_has_its_pool():
    pools = PrepPools()
    try:
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        video = {"type": "video", "video": "clip.mp4"}
        text = {"type": "text", "text": "hi"}
        cases = {"text": [text], "image": [image, text], "video": [image, video, text],
                 "long": [{"type": "text", "text": "x" * CHILD_TEXT_CHARS}]}
        for name, parts in cases.items():
            counts = count_parts([{"role": "user", "content": parts}])
            assert pools.pool_for(*counts) is getattr(pools, name), name
        assert count_parts([{"role": "user", "content": [image, video, video, text]}]) == (2, 1, 2)
        assert pools.pool_for(CHILD_TEXT_CHARS - 1, 0, 0) is pools.text
        assert pools.pool_for(CHILD_TEXT_CHARS, 1, 0) is pools.image
        assert {p.per_request for p in (pools.text, pools.long, pools.image, pools.video)} == {1}  # half of 2
    finally:
        pools.shutdown()


def _blocked(pool: FairPool, request, release: threading.Event, started: threading.Event):
    def job():
        started.set()
        assert release.wait(10)
        return request
    return pool.submit(request, job)


def test_next_job_round_robin_across_requests_each_in_order():
    pool = FairPool("t", threads=1, per_request=1)
    release, started = threading.Event(), threading.Event()
    first = _blocked(pool, "X", release, started)
    assert started.wait(10)
    order: list[str] = []
    futures = [pool.submit(request, lambda name=name: order.append(name))
               for request, name in [("A", "a1"), ("A", "a2"), ("A", "a3"), ("B", "b1"), ("C", "c1")]]
    assert pool.queued() == {"A": 3, "B": 1, "C": 1}
    release.set()
    for f in futures:
        f.result(10)
    assert first.result(10) == "X" and order == ["a1", "b1", "c1", "a2", "a3"]
    pool.shutdown()


def test_one_request_holds_at_most_its_share_of_threads():
    """A request with two slow jobs on a 2-thread pool holds one thread; another request's job runs on
    the other at once, while the first request's second job waits for its first."""
    pool = FairPool("t", threads=2, per_request=1)
    release, started = threading.Event(), threading.Event()
    a1 = _blocked(pool, "A", release, started)
    assert started.wait(10)
    a2_started = threading.Event()
    a2 = pool.submit("A", a2_started.set)
    b = pool.submit("B", lambda: "b")
    assert b.result(10) == "b"
    assert not a2_started.is_set() and not a1.done() and pool.queued() == {"A": 1}
    release.set()
    assert a1.result(10) == "A" and a2.result(10) is None and a2_started.is_set()
    pool.shutdown()


def test_cancelled_before_it_starts_leaves_the_queue_and_never_runs():
    pool = FairPool("t", threads=1, per_request=1)
    release, started = threading.Event(), threading.Event()
    blocker = _blocked(pool, "X", release, started)
    assert started.wait(10)
    ran: list[str] = []
    gone = pool.submit("A", lambda: ran.append("gone"))
    kept = pool.submit("B", lambda: ran.append("kept"))
    assert gone.cancel() and pool.queued() == {"B": 1}
    release.set()
    kept.result(10)
    assert blocker.result(10) == "X" and ran == ["kept"]
    pool.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit("A", lambda: None)


def test_shutdown_cancels_what_has_not_started_and_a_failing_job_fails_its_future_alone():
    pool = FairPool("t", threads=1, per_request=1)
    with pytest.raises(ZeroDivisionError):
        pool.submit("A", lambda: 1 / 0).result(10)
    assert pool.submit("A", lambda: 2).result(10) == 2  # the thread lives on
    release, started = threading.Event(), threading.Event()
    running = _blocked(pool, "X", release, started)
    assert started.wait(10)
    waiting = pool.submit("A", lambda: 3)
    pool.shutdown()
    assert waiting.cancelled()
    release.set()
    assert running.result(10) == "X"
