"""`vlm-sdk serve` as a process: SIGTERM stops new work, lets in-flight requests finish within
--shutdown-timeout, aborts what is left (its stream still ends properly), and exits 0."""
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from helpers import start_server


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
