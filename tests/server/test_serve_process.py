"""`vlm-sdk serve` as a process: SIGTERM stops new work, lets in-flight requests finish within
--shutdown-timeout, aborts what is left (its stream still ends properly), and exits 0."""
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from helpers import start_server

# wall-clock bounds: ./run test runs these alone, after the rest (see the README)
pytestmark = pytest.mark.timing


def _start(model, *flags) -> tuple[subprocess.Popen, str]:
    return start_server([sys.executable, "-m", "vlm_sdk.cli", "serve", str(model), "--port", "0", *flags], timeout=60)


def _open_stream(url: str, max_tokens: int):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    for line in resp:  # wait until generation has visibly started
        if b'"content":"' in line and b'"content":""' not in line:
            break
    return resp


def _rest(resp) -> list:
    events = []
    for line in resp:
        line = line.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return events


def _refused(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=2)
    except urllib.error.HTTPError as e:
        return e.code == 503  # still listening for a moment, but draining
    except (urllib.error.URLError, ConnectionError):
        return True
    return False


def test_sigterm_lets_in_flight_requests_finish_and_exits_0(tiny_ckpt):
    proc, url = _start(tiny_ckpt, "--served-model-name", "m", "--shutdown-timeout", "60")
    try:
        resp = _open_stream(url, 400)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not _refused(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _refused(url), "still accepting requests after SIGTERM"
        events = _rest(resp)
        assert events[-1] == "[DONE]"
        assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]] == ["length"]
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        proc.kill()


def test_sigterm_aborts_what_outlives_the_timeout(tiny_ckpt):
    proc, url = _start(tiny_ckpt, "--served-model-name", "m", "--shutdown-timeout", "0.5")
    try:
        resp = _open_stream(url, 4000)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        events = _rest(resp)
        assert events[-1] == "[DONE]"
        assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]] == ["abort"]
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15
        assert "aborting" in proc.stderr.read()
    finally:
        proc.kill()


def test_port_in_use_is_a_plain_error(tiny_ckpt, capsys):
    import socket

    from vlm_sdk.cli import main
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(tiny_ckpt), "--port", str(port), "--num-blocks", "8", "--allow-unfit-images"]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err and "Traceback" not in err


def test_sigterm_exits_within_the_timeout_whatever_the_clients_do(tiny_ckpt):
    """A stream whose client stops reading, a slow-header and a slow-body sender, idle connections:
    none of them may hold the process past --shutdown-timeout + 2 s (issue 18, point 5)."""
    import socket
    import threading
    timeout = 1.0
    proc, url = _start(tiny_ckpt, "--served-model-name", "m", "--shutdown-timeout", str(timeout),
                       "--keep-alive-timeout", "60", "--body-timeout", "60", "--num-blocks", "300")
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    conns, stop = [], threading.Event()

    def connect(small_buffer: bool = False) -> socket.socket:
        conn = socket.socket()
        if small_buffer:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect((host, int(port)))
        conns.append(conn)
        return conn

    def trickle(conn: socket.socket) -> None:
        while not stop.wait(0.1):
            try:
                conn.sendall(b"a")
            except OSError:
                return

    try:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4000,
                           "ignore_eos": True, "stream": True}).encode()
        connect(small_buffer=True).sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d"
                                           b"\r\n\r\n%s" % (len(body), body))  # and never read
        slow_head = connect()
        slow_head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        slow_body = connect()
        slow_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
        for conn in (slow_head, slow_body):
            threading.Thread(target=trickle, args=(conn,), daemon=True).start()
        for _ in range(20):
            connect()
        time.sleep(1.0)  # the stream's socket buffers fill; its handler blocks on writing
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        assert code == 0, proc.stderr.read()[-2000:]
        assert elapsed < timeout + 2.0, elapsed
    finally:
        stop.set()
        for conn in conns:
            conn.close()
        proc.kill()


def test_two_large_tool_bodies_at_once_leave_a_stream_its_pace(tiny_ckpt):
    """Issue 41 row 7 against the process `vlm-sdk serve` is: two 2 MB bodies of 10,000 tools parsed at
    once beside a victim stream. The parse runs Python on two threads; at Python's default switch
    interval (5 ms) the engine's thread waited that long for the GIL after each torch op, and the stream
    stalled 0.17-0.70 s (engine/gil.py); serve's 0.5 ms keeps it under the issue's 0.5 s."""
    import threading

    from server_helpers import VictimStream, post
    proc, url = _start(tiny_ckpt, "--served-model-name", "m", "--num-blocks", "600")
    tool = {"type": "function", "function": {"name": "t", "description": "a tool", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    tools = [dict(tool, function=dict(tool["function"], name=f"t{i}")) for i in range(10_000)]
    data = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": tools,
                       "max_tokens": 8}).encode()
    try:
        with VictimStream(url, "m", key=None) as victim:
            time.sleep(0.5)
            statuses = []
            senders = [threading.Thread(target=lambda: statuses.append(post(url, None, raw=data, key=None)[0]))
                       for _ in range(2)]
            t0 = time.monotonic()
            for s in senders:
                s.start()
            for s in senders:
                s.join()
            t1 = time.monotonic()
            time.sleep(0.2)
            gap = victim.worst_gap(t0, t1)
        assert statuses == [400, 400]  # 10,000 tools: over --max-tools
        assert gap < 0.5, f"the stream stalled {gap:.3f} s while the bodies were parsed"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
