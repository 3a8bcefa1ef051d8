"""`vlm-sdk bench-serve --soak SECONDS`: a server under mixed traffic for a while, and what it left behind.

`--concurrency` workers send, until the time is up, a random mix of: streamed and plain chat requests,
with and without images (of several sizes), streams the client abandons after a few chunks, and
requests that are the client's mistake (bad JSON, nesting, Unicode, parameters, images, malformed
HTTP). Each request ends in one outcome:

    completed            a good request answered with its full completion
    aborted              a stream this client left on purpose
    refused              a bad request answered 4xx in OpenAI's error shape, as it should be
    server_error         not the client's fault: a 5xx, an in-band stream error, a good request refused,
                         a bad one accepted or answered outside OpenAI's shape, a connection dropped
    lost                 no answer within --request-timeout

Afterwards: the server's resident memory at the start and the end, and its slope per 1000 requests
(least squares over samples taken during the run), and the KV blocks still held once the traffic has
stopped (a leak if not 0). RSS and blocks are read from the server's /metrics, so `--url` works too.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import re
import statistics
import sys
import time
from collections import Counter

import aiohttp

OUTCOMES = ("completed", "aborted", "refused", "server_error", "lost")
# share of each kind of request
_MIX = {"stream": 0.25, "plain": 0.2, "image_stream": 0.1, "image_plain": 0.1, "abort": 0.15, "bad": 0.2}


def _bad_bodies(model: str) -> list[tuple[str, bytes]]:
    good = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def body(**fields) -> bytes:
        return json.dumps({**good, **fields}).encode()

    return [("invalid_json", b'{"model": "' + model.encode() + b'", "messages": ['),
            ("unknown_model", body(model="no-such-model")),
            ("top_p_out_of_range", body(top_p=7)),
            ("negative_max_tokens", body(max_tokens=-3)),
            ("nested_too_deep", b'{"model":"x","messages":' + b"[" * 200 + b"]" * 200 + b"}"),
            ("lone_surrogate", body(messages=[{"role": "user", "content": "a\ud800"}])),
            ("not_an_image", body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}}]}])),
            ("bad_role", body(messages=[{"role": "robot", "content": "hi"}]))]


_RAW_BAD = [("bad_request_line", b"GE T / HTTP/1.1\r\nHost: x\r\n\r\n"),
            ("content_length_over_limit", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                          b"Content-Length: 999999999999\r\n\r\n")]


def _images(image_bytes: bytes, rng: random.Random) -> list[str]:
    """The given image and noise images of a few sizes, as data URLs."""
    from PIL import Image
    urls = ["data:image/png;base64," + base64.b64encode(image_bytes).decode()]
    for w, h in ((64, 48), (224, 224), (320, 200)):
        img = Image.frombytes("RGB", (w, h), bytes(rng.getrandbits(8) for _ in range(w * h * 3)))
        buf = io.BytesIO()
        img.save(buf, "PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


class Soak:
    def __init__(self, url: str, api_key: str | None, model: str, args, image_bytes: bytes):
        self.url, self.model, self.args = url.rstrip("/"), model, args
        self.rng = random.Random(args.seed)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.images = _images(image_bytes, self.rng)
        self.bad = _bad_bodies(model)
        self.outcomes: Counter = Counter()
        self.problems: list[str] = []  # the first few server errors, for the report
        self.samples: list[tuple[int, float]] = []  # (requests done, RSS bytes)

    # -- one request -------------------------------------------------------------------------------
    async def one(self, session: aiohttp.ClientSession) -> None:
        kind = self.rng.choices(list(_MIX), weights=list(_MIX.values()))[0]
        try:
            outcome, problem = await asyncio.wait_for(self._send(session, kind), self.args.request_timeout)
        except asyncio.TimeoutError:
            outcome, problem = "lost", f"{kind}: no answer within {self.args.request_timeout:g} s"
        except (aiohttp.ClientError, OSError) as e:
            outcome, problem = "server_error", f"{kind}: {type(e).__name__}: {e}"
        self.outcomes[outcome] += 1
        if problem and len(self.problems) < 10:
            self.problems.append(problem)

    async def _send(self, session: aiohttp.ClientSession, kind: str) -> tuple[str, str | None]:
        if kind == "bad":
            return await self._bad(session)
        content: object = "Tell me about the sea."
        if kind.startswith("image"):
            content = [{"type": "image_url", "image_url": {"url": self.rng.choice(self.images)}},
                       {"type": "text", "text": "What is in this image?"}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], "ignore_eos": True,
                "max_tokens": self.rng.randint(1, self.args.max_tokens), "temperature": self.rng.choice((0, 0.8)),
                "stream": kind in ("stream", "image_stream", "abort")}
        async with session.post(self.url + "/v1/chat/completions", json=body, headers=self.headers) as resp:
            if resp.status != 200:
                return "server_error", f"{kind}: HTTP {resp.status} {(await resp.text())[:200]}"
            if not body["stream"]:
                data = await resp.json()
                done = data["choices"][0]["finish_reason"] == "length"
                return ("completed", None) if done else ("server_error", f"{kind}: {str(data)[:200]}")
            leave_after = self.rng.randint(1, 4) if kind == "abort" else None
            chunks, finish = 0, None
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "server_error", f"{kind}: in-band {event['error']}"
                chunks += 1
                if event["choices"] and event["choices"][0]["finish_reason"]:
                    finish = event["choices"][0]["finish_reason"]
                if leave_after is not None and chunks >= leave_after:
                    resp.close()  # the client leaves: the server must abort and free the blocks
                    return "aborted", None
            if finish == "length":  # eos is ignored: every completion runs to its max_tokens
                return "completed", None
            return "server_error", f"{kind}: stream ended without a finish reason"

    async def _bad(self, session: aiohttp.ClientSession) -> tuple[str, str | None]:
        if self.rng.random() < 0.2:
            name, data = self.rng.choice(_RAW_BAD)
            status, text = await self._raw(data)
        else:
            name, data = self.rng.choice(self.bad)
            headers = {**self.headers, "Content-Type": "application/json"}
            async with session.post(self.url + "/v1/chat/completions", data=data, headers=headers) as resp:
                status, text = resp.status, await resp.text()
        try:
            shaped = set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError):
            shaped = False
        if 400 <= status < 500 and shaped:
            return "refused", None
        return "server_error", f"bad request {name}: HTTP {status} {text[:200]}"

    async def _raw(self, data: bytes) -> tuple[int, str]:
        host, port = self.url.split("//", 1)[1].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        try:
            writer.write(data)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            return int(head.split()[1]), (await reader.readexactly(length)).decode()
        finally:
            writer.close()

    # -- the run -----------------------------------------------------------------------------------
    async def metrics(self, session: aiohttp.ClientSession) -> dict:
        async with session.get(self.url + "/metrics") as resp:
            text = await resp.text()
        found = {}
        for name in ("process_resident_memory_bytes", "vlm_sdk_kv_blocks_used", "vlm_sdk_kv_blocks_total",
                     "vlm_sdk_num_requests_running", "vlm_sdk_num_requests_waiting"):
            match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            found[name] = float(match.group(1)) if match else None
        return found

    async def run(self) -> dict:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        connector = aiohttp.TCPConnector(limit=self.args.concurrency + 2)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            start = await self.metrics(session)
            t0 = time.monotonic()
            deadline = t0 + self.args.soak

            async def worker():
                while time.monotonic() < deadline:
                    await self.one(session)

            async def sampler():
                every = max(1.0, self.args.soak / 30)
                while time.monotonic() < deadline:
                    rss = (await self.metrics(session))["process_resident_memory_bytes"]
                    if rss is not None:
                        self.samples.append((sum(self.outcomes.values()), rss))
                    await asyncio.sleep(every)

            sampling = asyncio.create_task(sampler())
            await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))
            wall = time.monotonic() - t0
            await sampling
            end = await self.settled(session)
        return self.report(start, end, wall)

    async def settled(self, session: aiohttp.ClientSession) -> dict:
        """/metrics once the aborts of the last abandoned streams have reached the engine (a step or two)."""
        for _ in range(50):
            end = await self.metrics(session)
            if not end["vlm_sdk_num_requests_running"] and not end["vlm_sdk_num_requests_waiting"]:
                break
            await asyncio.sleep(0.1)
        return end

    def report(self, start: dict, end: dict, wall: float) -> dict:
        total = sum(self.outcomes.values())
        return {"url": self.url, "seconds": wall, "concurrency": self.args.concurrency, "requests": total,
                "requests_per_s": total / wall if wall else 0.0,
                "outcomes": {k: self.outcomes.get(k, 0) for k in OUTCOMES},
                "not_client_fault": self.outcomes.get("server_error", 0) + self.outcomes.get("lost", 0),
                "problems": self.problems,
                "rss_start_bytes": start["process_resident_memory_bytes"],
                "rss_end_bytes": end["process_resident_memory_bytes"],
                "rss_slope_bytes_per_1000_requests": _slope(self.samples),
                # the first half holds the warm-up (allocator pools, caches filling); a leak shows in both
                "rss_slope_second_half": _slope(self.samples[len(self.samples) // 2:]), "rss_samples": len(self.samples),
                "kv_blocks_used_end": end["vlm_sdk_kv_blocks_used"], "kv_blocks_total": end["vlm_sdk_kv_blocks_total"],
                "running_end": end["vlm_sdk_num_requests_running"], "waiting_end": end["vlm_sdk_num_requests_waiting"]}


def _slope(samples: list[tuple[int, float]]) -> float | None:
    """Bytes per 1000 requests, least squares; None without enough spread to tell."""
    if len(samples) < 3 or len({n for n, _ in samples}) < 2:
        return None
    return statistics.linear_regression([n for n, _ in samples], [r for _, r in samples]).slope * 1000


def soak_ok(report: dict) -> bool:
    return report["not_client_fault"] == 0 and report["kv_blocks_used_end"] == 0


def print_soak(r: dict) -> None:
    def mib(x) -> str:
        return "n/a" if x is None else f"{x / 2**20:.1f} MiB"

    o = r["outcomes"]
    print(f"soak {r['seconds']:.0f} s against {r['url']}: {r['requests']} requests ({r['requests_per_s']:.1f}/s), "
          f"concurrency {r['concurrency']}")
    print(f"  completed {o['completed']}, aborted by the client {o['aborted']}, bad requests refused "
          f"{o['refused']}")
    print(f"  not the client's fault: {r['not_client_fault']} (server errors {o['server_error']}, lost {o['lost']})")
    def per_1000(x) -> str:
        return "n/a" if x is None else f"{x / 2**20:+.2f} MiB"

    print(f"  server RSS {mib(r['rss_start_bytes'])} at the start, {mib(r['rss_end_bytes'])} at the end; slope "
          f"{per_1000(r['rss_slope_bytes_per_1000_requests'])} per 1000 requests, "
          f"{per_1000(r['rss_slope_second_half'])} over the second half ({r['rss_samples']} samples)")
    print(f"  KV blocks used at the end: {r['kv_blocks_used_end']:g} of {r['kv_blocks_total']:g} "
          f"(running {r['running_end']:g}, waiting {r['waiting_end']:g})")
    for problem in r["problems"]:
        print(f"  problem: {problem}", file=sys.stderr)


async def soak(url: str, api_key: str | None, model: str | None, args, image_bytes: bytes) -> dict:
    if model is None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with aiohttp.ClientSession() as session:
            async with session.get(url.rstrip("/") + "/v1/models", headers=headers) as resp:
                model = (await resp.json())["data"][0]["id"]
    return await Soak(url, api_key, model, args, image_bytes).run()


def run_soak(args) -> int:
    """`bench-serve --soak`: against --url, or a `vlm-sdk serve` child process on --model."""
    from pathlib import Path

    from vlm_sdk.bench.serve import ServerProcess
    from vlm_sdk.demo_checkpoint import tiny_model_dir
    from vlm_sdk.errors import InvalidRequestError
    if args.soak <= 0 or args.concurrency < 1 or args.max_tokens < 1:
        raise InvalidRequestError("--soak, --concurrency and --max-tokens must each be > 0")
    try:
        image = Path(args.image).read_bytes()
    except OSError as e:
        raise InvalidRequestError(f"cannot read --image {args.image!r}: {e}") from e
    server = None
    url = args.url
    if url is None:
        model_dir = args.model or str(tiny_model_dir())
        server = ServerProcess(model_dir, {"device": args.device} if args.device else {}).__enter__()
        url = server.url
    try:
        report = asyncio.run(soak(url, args.api_key if args.url else None, args.served_model, args, image))
    finally:
        if server is not None:
            exit_code = server.stop()
    if server is not None:
        report["server_exit_code"] = exit_code
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_soak(report)
    return 0 if soak_ok(report) else 1
