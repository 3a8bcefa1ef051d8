"""`vlm-sdk serve --tensor-parallel-size 2` on the CPU: streams end to end; SIGTERM ends every rank
process; a rank killed mid-stream fails every open stream instead of hanging them; a hung rank fails
the step after --distributed-timeout; aborted streams leave no state on any rank; torchrun runs the
same entry point (`python -m vlm_sdk.serve`) with one process per rank."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import process_table, start_server
from vlm_sdk import AsyncLLM, LLM, SamplingParams
from vlm_sdk.errors import EngineDeadError

HELLO = [{"role": "user", "content": "Hello"}]


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid`."""
    return [child for child, parent, _ in process_table() if parent == pid]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stream(url: str, max_tokens: int):
    body = {"model": "m", "messages": HELLO, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=60)


def _events(resp) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in (raw.decode().strip() for raw in resp) if line.startswith("data: ")]


def _rank_processes(server_pid: int) -> list[int]:
    """The spawned rank processes of the server (children running multiprocessing's spawn_main)."""
    pids = []
    for pid in _children(server_pid):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            pass
    return pids


def test_server_on_two_ranks_streams_and_sigterm_ends_every_rank(tiny_ckpt):
    proc, url = start_server([sys.executable, "-m", "vlm_sdk.cli", "serve", str(tiny_ckpt), "--port", "0",
                        "--served-model-name", "m", "--tensor-parallel-size", "2"])
    try:
        ranks = _rank_processes(proc.pid)
        assert len(ranks) == 1, f"one spawned rank expected besides rank 0, got {ranks}"
        children = _children(proc.pid)
        events = _events(_stream(url, 12))
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert text and events[-2]["choices"][0]["finish_reason"] == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        # the executor let its queue go at shutdown: nothing left for the resource tracker to warn of
        assert "leaked semaphore" not in proc.stderr.read()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in children if _alive(p)], "a process of the server outlived it"
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None


def test_killing_a_rank_mid_stream_fails_every_stream(tiny_ckpt):
    proc, url = start_server([sys.executable, "-m", "vlm_sdk.cli", "serve", str(tiny_ckpt), "--port", "0",
                        "--served-model-name", "m", "--tensor-parallel-size", "2"])
    try:
        streams = [_stream(url, 3000) for _ in range(2)]
        for resp in streams:  # both are generating
            for line in resp:
                if b'"content":"' in line and b'"content":""' not in line:
                    break
        t0 = time.monotonic()
        os.kill(_rank_processes(proc.pid)[0], signal.SIGKILL)
        results: list = [None, None]

        def read(i):
            results[i] = _events(streams[i])
        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for r in readers:
            r.start()
        for r in readers:
            r.join(timeout=30)
        assert all(r is not None for r in results), "a stream hung after its rank died"
        assert time.monotonic() - t0 < 30
        for events in results:
            errors = [e for e in events if e != "[DONE]" and "error" in e]
            assert errors, f"no error event: {events[-3:]}"
            assert "engine has stopped" in errors[0]["error"]["message"]  # the cause is in the server log
        # a dead engine is not served on: the process exits non-zero, for its supervisor to restart
        assert proc.wait(timeout=30) == 1
        log = proc.stderr.read()
        assert "vlm-tp-rank-1 exited with code -9" in log, log[-2000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None


def test_a_hung_rank_fails_the_step_after_the_distributed_timeout(tiny_ckpt):
    llm = LLM(tiny_ckpt, show_progress=False, tensor_parallel_size=2, distributed_timeout=3)
    rank = llm.engine.executor._procs[0]
    try:
        time.sleep(5)  # idle longer than the timeout: the heartbeats keep the ranks waiting
        assert llm.chat(HELLO, SamplingParams(max_tokens=4))[0].token_ids
        os.kill(rank.pid, signal.SIGSTOP)  # alive, never answers
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="collective|rank"):
            llm.chat(HELLO, SamplingParams(max_tokens=4))
        assert time.monotonic() - t0 < 20
    finally:
        llm.shutdown()
    assert not rank.is_alive()


def test_ranks_end_when_the_engine_process_is_killed(tiny_ckpt, tmp_path):
    """SIGKILL of rank 0's process gives it no chance to shut down: its ranks notice and exit."""
    script = tmp_path / "engine.py"
    script.write_text(
        "import multiprocessing, sys, time\n"
        "from vlm_sdk import LLM\n"
        f"llm = LLM({str(tiny_ckpt)!r}, show_progress=False, tensor_parallel_size=2)\n"
        "print(*[p.pid for p in multiprocessing.active_children() if p.name.startswith('vlm-tp-rank')], flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        ranks = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(ranks) == 1 and _alive(ranks[0])
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)], "a rank outlived the engine's process"
    finally:
        proc.kill()


def test_aborted_streams_leave_no_state_on_any_rank(tiny_ckpt):
    async def main():
        async with AsyncLLM(tiny_ckpt, show_progress=False, tensor_parallel_size=2) as llm:
            for _ in range(3):
                async for out in llm.chat_stream(HELLO, SamplingParams(max_tokens=500, ignore_eos=True)):
                    if len(out.token_ids) >= 3:
                        break  # leaving the stream aborts the request
            deadline = time.monotonic() + 10
            while (llm.stats()["num_running"] or llm.engine.has_unfinished()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert llm.stats()["kv_blocks_used"] == 0
            # the engine thread is idle now (waiting for work): ask every rank what it still holds
            return llm.engine.executor.collective_rpc("held_state")
    assert asyncio.run(main()) == [(0, 0), (0, 0)]


def test_torchrun_runs_the_server_one_process_per_rank(tiny_ckpt):
    # `torchrun` is `python -m torch.distributed.run`; the module form needs nothing on PATH
    proc, url = start_server([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "vlm_sdk.serve",
                        str(tiny_ckpt), "--port", "0", "--served-model-name", "m", "--tensor-parallel-size", "2"])
    try:
        events = _events(_stream(url, 8))
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        workers = _children(proc.pid)
        assert len(workers) == 2, f"torchrun should run two rank processes, got {workers}"
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in workers if _alive(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
