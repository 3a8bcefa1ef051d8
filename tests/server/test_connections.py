"""Connection limits (issue 18, point 5) on loopback: an idle or slow-header connection is closed after
the keep-alive timeout, a slow body gets 408, a Content-Length over the limit 413 before any body byte,
connections past the cap 503 before being read; all in OpenAI's error shape."""
import socket
import time

import pytest

from server_helpers import API_KEY, get, read_response, wait_for
from vlm_sdk.server.background import BackgroundServer
from vlm_sdk.server.config import ServerConfig

# wall-clock bounds: ./run test runs these alone, after the rest (see the README)
pytestmark = pytest.mark.timing

KEEP_ALIVE = 1.0
BODY_TIMEOUT = 1.0
MAX_CONNECTIONS = 50
SLACK = 1.5  # a loaded 2-core CI machine
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
        + b"\r\nContent-Type: application/json\r\n")


@pytest.fixture(scope="module")
def srv(tiny_ckpt):
    config = ServerConfig(port=0, api_key=API_KEY, served_model_name="tiny", max_request_bytes=1 << 20,
                          keep_alive_timeout=KEEP_ALIVE, body_timeout=BODY_TIMEOUT, max_connections=MAX_CONNECTIONS)
    with BackgroundServer(tiny_ckpt, config, num_blocks=16) as s:
        yield s


def _connect(srv) -> socket.socket:
    host, port = srv.url.rsplit("/", 1)[-1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_after(conn: socket.socket, trickle: bytes = b"", limit: float = 10.0) -> float:
    """Seconds until the server closes `conn`, sending `trickle` every 0.1 s meanwhile."""
    t0 = time.monotonic()
    conn.settimeout(0.1)
    while time.monotonic() - t0 < limit:
        try:
            if trickle:
                conn.sendall(trickle)
            if conn.recv(65536) == b"":
                break
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
    return time.monotonic() - t0


def test_idle_connections_are_closed_after_the_keep_alive_timeout(srv):
    t0 = time.monotonic()
    idle = [_connect(srv) for _ in range(MAX_CONNECTIONS - 5)]  # the red team held 500 open for good
    opened = time.monotonic() - t0
    try:
        with _connect(srv) as used:
            used.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(used)[0] == 200
            assert KEEP_ALIVE - 0.2 < _closed_after(used) < KEEP_ALIVE + SLACK  # counted from its answer
        for conn in idle:
            _closed_after(conn)
        assert time.monotonic() - t0 < opened + KEEP_ALIVE + SLACK
        assert wait_for(lambda: srv.runner.open_connections == 0, timeout=5)
    finally:
        for conn in idle:
            conn.close()


def test_slow_header_sender_is_closed_however_steadily_it_sends(srv):
    with _connect(srv) as conn:
        conn.sendall(HEAD + b"X-Slow: ")
        assert _closed_after(conn, trickle=b"a") < KEEP_ALIVE + SLACK


def test_slow_body_sender_gets_408(srv):
    with _connect(srv) as conn:
        conn.sendall(HEAD + b"Content-Length: 1000\r\n\r\n{\"model\":")
        t0 = time.monotonic()
        for _ in range(int(BODY_TIMEOUT * 10) + 5):  # a byte every 0.1 s: never enough
            try:
                conn.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)
            conn.settimeout(0.0)
            try:
                if conn.recv(1, socket.MSG_PEEK):
                    break
            except BlockingIOError:
                pass
            finally:
                conn.settimeout(10)
        status, body = read_response(conn)
        elapsed = time.monotonic() - t0
    assert status == 408 and body["error"]["code"] == "request_timeout", body
    assert "--body-timeout" in body["error"]["message"]
    assert BODY_TIMEOUT - 0.2 < elapsed < BODY_TIMEOUT + SLACK


def test_content_length_over_the_limit_is_refused_before_the_body(srv):
    with _connect(srv) as conn:
        t0 = time.monotonic()
        conn.sendall(HEAD + b"Content-Length: 999999999999\r\n\r\n")  # and no body at all
        status, body = read_response(conn)
        assert time.monotonic() - t0 < 1.0
        assert status == 413 and body["error"]["code"] == "request_too_large", body
        assert _closed_after(conn) < 2.0 + SLACK  # after the bounded linger, not when the client is done


def test_connections_past_the_cap_get_503_before_being_read(srv):
    held = [_connect(srv) for _ in range(MAX_CONNECTIONS)]
    try:
        for conn in held:
            conn.sendall(HEAD)  # an unfinished head: open, and counted
        assert wait_for(lambda: srv.runner.open_connections == MAX_CONNECTIONS, timeout=5)
        with _connect(srv) as extra:
            status, body = read_response(extra)
        assert status == 503 and body["error"]["code"] == "too_many_connections", body
        assert "--max-connections" in body["error"]["message"]
    finally:
        for conn in held:
            conn.close()
    assert wait_for(lambda: srv.runner.open_connections == 0, timeout=5)
    assert get(srv.url, "/health")[0] == 200
    assert 'status="503"' in get(srv.url, "/metrics")[1]
