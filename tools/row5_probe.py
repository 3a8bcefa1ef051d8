"""Issue 28's row 5 in process, on the tiny checkpoint: what one request's logprobs hold, and where a victim
stream waits while big logprob bodies are made. Run from the checkout's root (PYTHONPATH at another
checkout measures that one):

    python tools/row5_probe.py rss [tokens]            one n=8 x tokens x 21-logprob request through
                                                       AsyncLLM: RSS and gc-tracked objects its final
                                                       outputs hold (malloc_trim first), then after
                                                       reading `.logprobs`
    python tools/row5_probe.py stall [n tokens requests blocks] [--legacy]
                                                       that many non-streamed requests at once beside a
                                                       victim stream (BackgroundServer, tests'
                                                       VictimStream): the victim's worst gaps, the
                                                       event loop's lateness (a heartbeat every 2 ms)
                                                       and the garbage collections of generation 1-2
                                                       inside the window; --legacy: /v1/completions
"""
import asyncio
import ctypes
import gc
import json
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, "tests")
from server_helpers import API_KEY, VictimStream  # noqa: E402
from vlm_sdk.async_llm import AsyncLLM  # noqa: E402
from vlm_sdk.sampling_params import SamplingParams  # noqa: E402
from vlm_sdk.server.background import BackgroundServer  # noqa: E402
from vlm_sdk.server.config import MiB, ServerConfig  # noqa: E402
from vlm_sdk.testing import make_tiny_checkpoint  # noqa: E402


def rss_trimmed() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # memory freed but kept by glibc does not count
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def held_by_one_request(ckpt, tokens: int) -> None:
    llm = AsyncLLM(str(ckpt), num_blocks=2400)
    params = SamplingParams(n=8, max_tokens=tokens, logprobs=20, ignore_eos=True, temperature=1.0, seed=1)
    await llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))  # warm-up
    gc.collect()
    rss0, objects0 = rss_trimmed(), len(gc.get_objects())
    out = await llm.chat([{"role": "user", "content": "Hello"}], params)
    gc.collect()
    rss1, objects1 = rss_trimmed(), len(gc.get_objects())
    built = [o.logprobs for o in out.outputs]
    rss2 = rss_trimmed()
    print(f"n=8 x {tokens} tokens x 21 logprobs: the final outputs hold +{(rss1 - rss0) / MiB:.1f} MiB, "
          f"+{objects1 - objects0} gc-tracked objects; after reading .logprobs +{(rss2 - rss0) / MiB:.1f} MiB")
    del built, out
    await llm.shutdown()


class LoopWatch:
    """A heartbeat on the server's loop every 2 ms, and a thread noting how late it is (> 50 ms)."""

    def __init__(self, loop):
        self.beat, self.late, self.stop = time.monotonic(), [], threading.Event()
        asyncio.run_coroutine_threadsafe(self._heartbeat(), loop)
        threading.Thread(target=self._watch, daemon=True).start()

    async def _heartbeat(self):
        while not self.stop.is_set():
            self.beat = time.monotonic()
            await asyncio.sleep(0.002)

    def _watch(self):
        while not self.stop.is_set():
            time.sleep(0.005)
            if (lag := time.monotonic() - self.beat) > 0.05:
                self.late.append((lag, time.monotonic()))


class Collections:
    """Generation 1 and 2 collections: (generation, seconds, thread, when it ended)."""

    def __init__(self):
        self.done, self._start = [], 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        elif info["generation"] >= 1:
            self.done.append((info["generation"], time.perf_counter() - self._start,
                              threading.current_thread().name, time.monotonic()))


def post(url: str, body: dict, legacy: bool) -> bytes:
    path = "/v1/completions" if legacy else "/v1/chat/completions"
    if legacy:
        body = {k: v for k, v in body.items() if k not in ("messages", "top_logprobs")} | {"prompt": "Hello",
                                                                                          "logprobs": 20}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.read()


def stall(ckpt, n: int, tokens: int, requests: int, blocks: int, legacy: bool) -> None:
    collections = Collections()
    config = ServerConfig(port=0, api_key=API_KEY, max_request_bytes=64 * MiB)
    with BackgroundServer(ckpt, config, num_blocks=blocks) as srv:
        watch = LoopWatch(srv._loop)
        body = {"model": srv.model_name, "messages": [{"role": "user", "content": "Hello"}], "n": n,
                "max_tokens": tokens, "logprobs": True, "top_logprobs": 20, "ignore_eos": True,
                "temperature": 1.0, "seed": 1}
        sizes = [0] * requests
        with VictimStream(srv.url, srv.model_name) as victim:
            t0 = time.monotonic()
            threads = [threading.Thread(target=lambda i=i: sizes.__setitem__(i, len(post(srv.url, body, legacy))))
                       for i in range(requests)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            t1 = time.monotonic()
            worst = victim.worst_gap(t0, t1)
        watch.stop.set()
    times = [t for t in victim.times if t0 - 1 <= t <= t1 + 1]
    gaps = sorted(((b - a, a - t0) for a, b in zip(times, times[1:])), reverse=True)[:5]
    inside = [c for c in collections.done if t0 <= c[3] <= t1]
    print(f"{requests} x n={n} x {tokens} tokens ({'completions' if legacy else 'chat'}): {t1 - t0:.1f} s, "
          f"bodies {[s >> 20 for s in sizes]} MiB; victim's worst gap {worst:.3f} s")
    print("  victim's 5 worst gaps (s, at s):", [(round(g, 3), round(at, 1)) for g, at in gaps])
    print("  loop late > 50 ms (s, at s):", [(round(g, 3), round(at - t0, 1)) for g, at in sorted(watch.late)[-5:]])
    print(f"  generation 1-2 collections: {len(inside)}, {sum(c[1] for c in inside):.3f} s; of generation 2 or "
          f"> 20 ms:", [(g, round(s, 3), name) for g, s, name, _ in inside if g == 2 or s > 0.02])


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    ckpt = make_tiny_checkpoint(tempfile.mkdtemp() + "/ckpt")
    if args[0] == "rss":
        asyncio.run(held_by_one_request(ckpt, int(args[1]) if len(args) > 1 else 4000))
    else:
        n, tokens, requests, blocks = (int(a) for a in (args[1:5] if len(args) > 4 else (4, 2000, 2, 1600)))
        stall(ckpt, n, tokens, requests, blocks, "--legacy" in sys.argv)
