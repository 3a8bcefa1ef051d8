"""Raw HTTP helpers for the server tests: what any client would send, no SDK code in between."""
from __future__ import annotations

import base64
import io
import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from PIL import Image

API_KEY = "test-key"

# A stream's worst gap between chunks beside an attack, on an idle machine. On a loaded one (a 2-core CI
# runner beside other jobs) the server's own CPU work is slower by the load, and a quiet stream's worst
# gap can pass it by itself, so the bound is measured against the same stream over a quiet window in the
# same run (`stall_bound`): what is tested is the property (the attack costs the stream no more than a
# bounded number of its own steps), not the machine's speed. A real stall is the attack's whole work time
# (a 30 MB text tokenized, a grammar compiled to its timeout, a clip decoded on the engine thread:
# thousands of steps), far past the bound.
MAX_GAP_S = 0.5
STALL_STEPS = 150  # the stream's own median gaps (decode steps): ~0.5 s of the tiny model's on an idle 2-core VM
STALL_FACTOR = 4  # or 4x the worst gap it shows with nothing else sent (scheduling hiccups from outside)


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str, text: str = "What is in this image?", **pixels) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, **pixels}},
                                         {"type": "text", "text": text}]}]


def post(url: str, body, *, key: str | None = API_KEY, raw: bytes | None = None,
         timeout: float = 60.0) -> tuple[int, dict | str]:
    """POST /v1/chat/completions; returns (status, decoded JSON or the SSE text)."""
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def get(url: str, path: str, key: str | None = API_KEY) -> tuple[int, str]:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sse_events(text: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def raw_http(url: str, data: bytes, timeout: float = 10.0) -> tuple[int | None, dict | str, float]:
    """Send `data` as it is, no HTTP client in between, and read one response: (status, decoded JSON or
    text, seconds until the answer). Status None: the server closed the connection without answering."""
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=timeout) as conn:
        conn.sendall(data)
        return read_response(conn) + (time.monotonic() - t0,)


def read_response(conn: socket.socket) -> tuple[int | None, dict | str]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = conn.recv(65536)
        if not chunk:
            return None, buf.decode(errors="replace")
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", -1))
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    text = body.decode(errors="replace")
    try:
        return int(lines[0].split()[1]), json.loads(text)
    except json.JSONDecodeError:
        return int(lines[0].split()[1]), text


def post_bytes(body: bytes, key: str | bytes | None = API_KEY, extra: bytes = b"") -> bytes:
    """A whole POST /v1/chat/completions request as bytes on the wire."""
    key = key.encode() if isinstance(key, str) else key
    auth = b"Authorization: Bearer %s\r\n" % key if key else b""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n" + auth
            + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)


class VictimStream:
    """An innocent client streaming long generations one after another while an attack runs, timing
    every SSE line it receives; `worst_gap(t0, t1)` is its longest wait between two lines over the
    interval (the lines just before t0 and just after t1 included):

        with VictimStream(srv.url, srv.model_name) as victim:
            t0 = time.monotonic(); attack(); t1 = time.monotonic()
            assert victim.worst_gap(t0, t1) < 0.5
    """

    def __init__(self, url: str, model: str, key: str | None = API_KEY, max_tokens: int = 3000):
        import threading
        self.url, self.model, self.key, self.max_tokens = url, model, key, max_tokens
        self.times: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "VictimStream":
        self._thread.start()
        assert wait_for(lambda: len(self.times) >= 20, timeout=60), "the victim stream did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        import http.client
        from urllib.parse import urlparse
        u = urlparse(self.url)
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": "Hello"}],
                           "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True})
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        while not self._stop.is_set():
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
            try:
                conn.request("POST", "/v1/chat/completions", body, headers)
                resp = conn.getresponse()
                self.statuses.append(resp.status)
                while not self._stop.is_set():
                    line = resp.readline()
                    if not line:
                        break
                    if line.startswith(b"data: "):
                        self.times.append(time.monotonic())
            finally:
                conn.close()  # the client leaves: the server aborts the request

    def worst_gap(self, t0: float, t1: float) -> float:
        """Waits for a line after t1 first, so that a stall running past t1 is counted whole."""
        wait_for(lambda: self.times and self.times[-1] > t1, timeout=30)
        times = list(self.times)
        points = [t for t in times if t < t0][-1:] + [t for t in times if t0 <= t <= t1] + \
            [t for t in times if t > t1][:1]
        return max((b - a for a, b in zip(points, points[1:])), default=float("inf"))

    def quiet_gap(self, seconds: float) -> "Quiet":
        """The baseline: the stream over the next `seconds` (1 to 10) with nothing else sent, the
        machine as loaded as it is now. Measure it over as long a window as the attack took, so both
        had the same chance of a hiccup from outside."""
        t0 = time.monotonic()
        time.sleep(min(max(seconds, 1.0), 10.0))
        return self.pace(t0, time.monotonic())

    def pace(self, t0: float, t1: float) -> "Quiet":
        """The stream's worst and median gap over [t0, t1]."""
        worst = self.worst_gap(t0, t1)
        times = [t for t in self.times if t0 <= t <= t1]
        steps = sorted(b - a for a, b in zip(times, times[1:]))
        return Quiet(worst, steps[len(steps) // 2] if steps else worst)


@dataclass(frozen=True)
class Quiet:
    """A stream's pace with nothing else sent: its worst gap, and its median gap (one decode step)."""
    worst: float
    step: float

    def __format__(self, spec: str) -> str:
        return f"worst {self.worst:.3f} s, step {self.step * 1000:.1f} ms"


def stall_bound(quiet: Quiet) -> float:
    """The worst gap allowed beside an attack: MAX_GAP_S, or, on a machine too loaded for MAX_GAP_S to
    tell an attack from the load, STALL_STEPS of the stream's own quiet steps or STALL_FACTOR x its quiet
    worst gap, whichever is larger."""
    return max(MAX_GAP_S, STALL_STEPS * quiet.step, STALL_FACTOR * quiet.worst)


def latency_bound(bound: float, alone: list[float]) -> float:
    """The longest a probe may take beside an attack: `bound`, or on a machine too loaded for it,
    STALL_FACTOR x the same probe's worst latency with nothing else sent, measured in the same run."""
    return max(bound, STALL_FACTOR * max(alone))


def assert_no_stall(gap: float, quiet: Quiet, what: str) -> None:
    bound = stall_bound(quiet)
    assert gap < bound, (f"the stream stalled {gap:.2f} s {what}; allowed {bound:.2f} s: the most of {MAX_GAP_S} s, "
                         f"{STALL_STEPS} of its quiet steps ({quiet.step * 1000:.1f} ms each) and {STALL_FACTOR} x "
                         f"its quiet worst gap ({quiet.worst:.2f} s), the quiet window as long as the attack")


def rss_bytes() -> int:
    """This process's resident memory (an in-process server's)."""
    import re
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
