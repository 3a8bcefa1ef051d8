"""Threads that build prompts for AsyncLLM: a pool per kind of work, each fair between requests.

    PrepPools.pool_for(chars, images, videos) -> video | image | long | text, from the request's
    part counts (multimodal/messages.count_parts) before any of its work:
        video   any video part
        image   any image part (no video)
        long    text of CHILD_TEXT_CHARS (16 KiB) or more, no media    tokenized in a child process
        text    the rest                                              ~10 ms of work at most
    FairPool.submit(request, fn) -> concurrent.futures.Future

Two rules, each held by `FairPool`:
  - Kinds never share threads (each pool has PREP_THREADS of its own): an image or a text never waits
    behind a video (issue 41 row 3: two hostile videos held both of the threads images shared with
    them for 154 s), a short text never waits behind image decoding or a long text's tokenization, and
    an image never waits behind long texts.
  - One request holds at most `per_request` of a pool's threads (half of them, at least one): a
    /v1/completions request of 64 prompts builds them one at a time on the text pool, so another
    request's text always finds the other thread; and the next job a freed thread takes is the
    oldest of the request after the one it served last (round-robin across requests, each request's
    jobs in order), so a request with many jobs queued delays another's first by at most one of its own.

No pool runs at a lower priority: a thread that runs Python holds the GIL part of the time, and one
at nice 10 that the kernel preempts while holding it stalls the engine thread behind it (video threads
at nice 10 on a loaded machine: a 130,000-frame video took 31 s instead of 4.7 s to refuse and the
victim's worst gap went from 0.08 to 0.52 s). Long texts are tokenized in child processes, which do
run at nice 10 (engine/input/tokenizer_process.py): they share no GIL with the server.

A job cancelled before it starts (its caller went away) leaves the queue at once and never runs; a
running one is told through its own `cancelled` event (see AsyncLLM.build_prompt). Threads start when
first needed, up to the pool's size, and live until `shutdown`.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future
from typing import Callable, Hashable

from vlm_sdk.engine.input.prompt_tokenizer import CHILD_TEXT_CHARS

PREP_THREADS = 2  # per pool


class FairPool:
    """`threads` threads running the jobs of many requests: at most `per_request` jobs of one request
    at once; the next job round-robin across requests (see the module docstring)."""

    def __init__(self, name: str, threads: int, per_request: int):
        self.name, self.threads, self.per_request = name, threads, per_request
        self._cond = threading.Condition()
        self._queues: OrderedDict[Hashable, deque] = OrderedDict()  # request -> its jobs not started, in order
        self._running: Counter = Counter()  # request -> its jobs running now
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, request: Hashable, fn: Callable) -> Future:
        """Queue `fn()` as a job of `request`; its result (or exception) comes in the future. Cancelling
        the future before the job starts removes it from the queue."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"the {self.name} prompt pool is shut down")
            self._queues.setdefault(request, deque()).append((future, fn))
            if self._idle == 0 and len(self._workers) < self.threads:
                worker = threading.Thread(target=self._work, name=f"vlm-prep-{self.name}-{len(self._workers)}",
                                          daemon=True)
                self._workers.append(worker)
                worker.start()
            self._cond.notify()
        future.add_done_callback(lambda f: self._drop(request, f) if f.cancelled() else None)
        return future

    def queued(self) -> dict:
        """request -> how many of its jobs wait (a snapshot, for tests and stats)."""
        with self._cond:
            return {request: len(jobs) for request, jobs in self._queues.items()}

    def shutdown(self, timeout: float | None = None) -> None:
        """`close`, then with `timeout` `join` (so that no thread is still ending when the interpreter exits)."""
        self.close()
        if timeout is not None:
            self.join(timeout)

    def close(self) -> None:
        """Cancel every job not started; threads end once their job does."""
        with self._cond:
            self._closed = True
            jobs = [future for queue in self._queues.values() for future, _ in queue]
            self._queues.clear()
            self._cond.notify_all()
        for future in jobs:
            future.cancel()

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds in all for the threads (after `close`)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            workers = list(self._workers)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))

    def _drop(self, request: Hashable, future: Future) -> None:
        with self._cond:
            queue = self._queues.get(request)
            if queue is None:
                return
            for job in queue:
                if job[0] is future:
                    queue.remove(job)
                    break
            if not queue:
                del self._queues[request]

    def _take(self):
        """The next job a free thread runs (under the lock), or None when every queued request is at its
        share; the request served goes to the back of the round."""
        for request, queue in self._queues.items():
            if self._running[request] < self.per_request:
                job = queue.popleft()
                if queue:
                    self._queues.move_to_end(request)
                else:
                    del self._queues[request]
                self._running[request] += 1
                return request, job
        return None

    def _work(self) -> None:
        while self._serve_one():
            pass

    def _serve_one(self) -> bool:
        """Wait for a job and run it; False once the pool is shut down. The job lives in this frame only:
        the loop above must not hold it while it waits for the next one (see `_run`)."""
        taken = self._next()
        if taken is None:
            return False
        self._run(*taken)
        return True

    def _next(self):
        """Block until a job may run; None once the pool is shut down and nothing is queued."""
        with self._cond:
            self._idle += 1
            try:
                while (taken := self._take()) is None:
                    if self._closed:
                        return None
                    self._cond.wait()
            finally:
                self._idle -= 1
            return taken

    def _run(self, request: Hashable, job: tuple) -> None:
        """Run one job. Its function and result die with this frame, while the thread is alive: a thread
        that freed a job's tensors after the interpreter began to exit (its last job still referenced by
        its loop's locals) would be ended inside torch's deallocator, which aborts the process
        ("terminate called without an active exception", seen at the exit of samples/video_qa.py)."""
        future, fn = job
        try:
            if future.set_running_or_notify_cancel():
                try:
                    result = fn()
                except BaseException as e:
                    future.set_exception(e)
                else:
                    future.set_result(result)
        finally:
            with self._cond:
                self._running[request] -= 1
                if not self._running[request]:
                    del self._running[request]
                self._cond.notify()  # that request's next job may run now

class PrepPools:
    """AsyncLLM's four prompt pools (see the module docstring)."""

    def __init__(self, threads: int = PREP_THREADS, image_threads: int | None = None):
        """`image_threads` (default `threads`): the image pool's, as many as there are image preprocessing
        processes (EngineArgs.preprocess_workers) so that each has an image to work on; its threads only wait
        on them, so the pool's order between requests is the order the processes take images."""
        share = max(1, threads // 2)
        self.text = FairPool("text", threads, share)
        self.long = FairPool("long", threads, share)
        image_threads = max(threads, image_threads or 0)
        self.image = FairPool("image", image_threads, max(1, image_threads // 2))
        self.video = FairPool("video", threads, share)

    def pool_for(self, chars: int, images: int, videos: int) -> FairPool:
        if videos:
            return self.video
        if images:
            return self.image
        return self.long if chars >= CHILD_TEXT_CHARS else self.text

    def shutdown(self, timeout: float | None = None) -> None:
        """Close every pool; with `timeout`, wait up to that long in all for their threads."""
        self.close()
        if timeout is not None:
            self.join(timeout)

    def close(self) -> None:
        for pool in self._pools():
            pool.close()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for pool in self._pools():
            pool.join(max(0.0, deadline - time.monotonic()))

    def _pools(self) -> tuple[FairPool, ...]:
        return self.text, self.long, self.image, self.video
