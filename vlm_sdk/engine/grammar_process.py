"""Compile a user's grammar in a child process first, where whatever it does cannot take the server down.

llguidance is native code: a grammar can overflow its stack (a chain of 1,000 `$ref`s, or of 3,000
Lark rules, segfaults it on an 8 MiB thread), take seconds (a 64,000-string choice list: 14 s), or build
gigabytes (`((a{1001}){1000}){1000}`'s first mask). Here, in a process of its own at a lower CPU
priority, a grammar is compiled on a thread with a smaller stack than the server's compile threads
(`CHILD_STACK`), its first mask is computed, and the memory it then holds is measured (glibc's
allocator statistics). The server compiles it itself only once that passed, so the same work cannot
go further in-process; a crash, `timeout` or too much memory here is the request's 400, and the next
grammar gets a fresh process.

The child is `python -m vlm_sdk.engine.grammar_process` (it imports llguidance and nothing of
the caller). Pipe protocol: every message is an int64 little-endian length and that many bytes of
UTF-8 JSON.

    parent -> child, once:     {tokenizer_json, n_vocab, eos, max_bytes, data_limit}
    child -> parent, once:     {"ready": true}
    parent -> child, per job:  {grammar}                     llguidance's grammar text (grammar_from's)
    child -> parent, per job:  {error, bytes, recycle}       error "" when it compiled; bytes held then;
                                                             recycle: the child exits after this reply
"""
from __future__ import annotations

import json
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

_INT = struct.Struct("<q")
MiB = 1 << 20
# the child's compile thread; the server compiles on threads with a larger one (GrammarCompiler), so
# what did not overflow here cannot overflow there
CHILD_STACK = 16 * MiB
SERVER_STACK = 64 * MiB
SETUP_TIMEOUT = 120.0  # building llguidance's tokenizer: ~1 s for a 150k vocabulary
CHILD_NICE = 19  # the engine and the event loop come first on a busy CPU (its timeout counts its CPU time)


def parser_limits():
    """llguidance's limits, as the child and the server both compile with them: its defaults, without
    the grammar and parser state in error messages (they would reach the client)."""
    import llguidance
    return llguidance.LLParserLimits(verbose_errors=False)


@dataclass(frozen=True)
class CheckResult:
    """`error`: "" when the grammar compiled; `kind` says what failed: "grammar" (llguidance's own
    message), "timeout", "memory" (measured over `max_bytes`), "crash" (the process died: `signal`),
    "start" (no process could be started for it: twice in a row one died or hung while setting up)."""
    error: str = ""
    kind: str = ""
    bytes: int = 0
    seconds: float = 0.0
    signal: int | None = None


class GrammarProcess:
    """`check(grammar, timeout)` in a child; one job at a time (each compile worker owns one)."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: list[int], max_bytes: int):
        self._setup = json.dumps({"tokenizer_json": tokenizer_json, "n_vocab": n_vocab, "eos": eos,
                                  "max_bytes": max_bytes, "data_limit": max(4 * max_bytes, 1 << 30)}).encode()
        self._proc: subprocess.Popen | None = None
        self._stderr = None
        self.starts = 0  # processes started (tests: a crash or a timeout costs one)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None or self._proc.poll() is not None else self._proc.pid

    def _start(self) -> subprocess.Popen:
        self._stderr = tempfile.TemporaryFile()  # a crash's last words, for the log
        proc = subprocess.Popen([sys.executable, "-m", "vlm_sdk.engine.grammar_process"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self.starts += 1
        try:
            _send(proc, self._setup)
            _receive(proc, _Budget(proc.pid, SETUP_TIMEOUT))
        except BaseException:
            self._stop(proc)
            raise
        return proc

    def _start_one(self) -> subprocess.Popen:
        """A ready child; one that dies (or is killed) while it sets up is not the grammar's doing, so a
        second is tried before the grammar is refused."""
        try:
            return self._start()
        except (EOFError, OSError, TimeoutError):
            return self._start()

    def check(self, grammar: str, timeout: float) -> CheckResult:
        """Compile `grammar` and its first mask in the child, within `timeout` seconds of its CPU time
        (a busy machine, where it runs last, stretches the wall time, up to `WALL_FACTOR` x)."""
        t0 = time.monotonic()
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._proc = self._start_one()
            except (EOFError, OSError, TimeoutError) as e:
                return CheckResult(self.last_words() or str(e) or type(e).__name__, "start",
                                   seconds=time.monotonic() - t0)
        proc = self._proc
        try:
            _send(proc, json.dumps({"grammar": grammar}).encode())
            reply = json.loads(_receive(proc, _Budget(proc.pid, timeout)))
        except TimeoutError:
            self._stop(proc)
            return CheckResult(f"it did not compile within {timeout:g} s", "timeout", seconds=time.monotonic() - t0)
        except (EOFError, OSError):  # the child died: a crash, or out of the memory it may use
            code = self._stop(proc)
            return CheckResult(self.last_words() or "the grammar process ended", "crash",
                               seconds=time.monotonic() - t0, signal=-code if code and code < 0 else None)
        if reply.get("recycle"):  # it has kept too much memory: the next job gets a fresh one
            self._stop(proc)
        kind = reply.get("kind", "grammar") if reply["error"] else ""
        return CheckResult(reply["error"], kind, reply.get("bytes", 0), time.monotonic() - t0)

    def resident_bytes(self) -> int:
        """The child's resident memory (Linux; 0 elsewhere or when none runs)."""
        pid = self.pid
        if pid is None:
            return 0
        try:
            with open(f"/proc/{pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            return 0

    def last_words(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()[-2000:].decode(errors="replace").strip()

    def _stop(self, proc: subprocess.Popen) -> int | None:
        if proc.poll() is None:
            proc.kill()
        code = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        if self._proc is proc:
            self._proc = None
        return code

    def close(self) -> None:
        """End the child, if one runs; the next `check` starts another."""
        if self._proc is not None:
            self._stop(self._proc)
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


def _send(proc: subprocess.Popen, data: bytes) -> None:
    proc.stdin.write(_INT.pack(len(data)) + data)  # a blocking write releases the GIL
    proc.stdin.flush()


WALL_FACTOR = 10


class _Budget:
    """`seconds` of the child's CPU time from now (Linux: /proc/PID/stat, every thread's), and at most
    WALL_FACTOR x as much wall time; elsewhere wall time only."""

    def __init__(self, pid: int, seconds: float):
        self.pid, self.seconds = pid, seconds
        self.cpu0 = self._cpu()
        self.wall_end = time.monotonic() + (WALL_FACTOR if self.cpu0 is not None else 1) * seconds

    def _cpu(self) -> float | None:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, IndexError, ValueError):
            return None

    def left(self) -> float:
        """Seconds to wait before looking again; <= 0 once spent."""
        wall = self.wall_end - time.monotonic()
        if wall <= 0:
            return 0.0
        cpu = self._cpu() if self.cpu0 is not None else None
        if cpu is None:  # no CPU clock here, or the child is gone (its pipe tells)
            return wall
        return min(wall, self.seconds - (cpu - self.cpu0), 0.1)


def _receive(proc: subprocess.Popen, budget: _Budget) -> bytes:
    head = _read(proc.stdout.fileno(), 8, budget)
    return _read(proc.stdout.fileno(), _INT.unpack(head)[0], budget)


def _read(fd: int, n: int, budget: _Budget) -> bytes:
    """Exactly `n` bytes from `fd` within `budget` (TimeoutError), or EOFError when the child is gone."""
    parts, got = [], 0
    while got < n:
        left = budget.left()
        if left <= 0:
            raise TimeoutError
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the grammar process closed its pipe")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


# -- the child ------------------------------------------------------------------------------------

def _heap_bytes() -> int:
    """Bytes allocated and not freed (glibc's mallinfo2: exact, whatever the allocator keeps
    cached); the resident size where that is not available."""
    try:
        import ctypes

        class _MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                        "fsmblks", "uordblks", "fordblks", "keepcost")]
        mallinfo2 = ctypes.CDLL(None).mallinfo2
        mallinfo2.restype = _MallInfo2
        info = mallinfo2()
        return info.uordblks + info.hblkhd
    except (OSError, AttributeError):
        return _resident_bytes()


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _compile(llguidance, tokenizer, grammar: str, max_bytes: int) -> dict:
    """Compile and compute the first mask, as the server will; the memory that then holds."""
    before = _heap_bytes()
    limits = parser_limits()
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits)
    if error:
        return {"error": error, "kind": "grammar"}
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    mask = b"" if matcher.is_error() else matcher.compute_bitmask()
    if matcher.is_error():
        return {"error": matcher.get_error(), "kind": "grammar"}
    if not any(mask):
        return {"error": "it allows no token of this model's vocabulary at its start", "kind": "grammar"}
    held = _heap_bytes() - before
    if held > max_bytes:
        return {"error": f"it holds {held} bytes once compiled with its first mask", "kind": "memory", "bytes": held}
    return {"error": "", "bytes": held}


class _MemoryWatch:
    """While a job compiles: the heap's growth read every `_WATCH_S`; past `max_bytes` the job's
    answer is written from here and the process ends at once, so that it never holds much more than
    the limit (the answer is the same as after a compile that ended over it)."""

    def __init__(self, stdout, lock: threading.Lock, max_bytes: int):
        self.stdout, self.lock, self.max_bytes = stdout, lock, max_bytes
        self.base: int | None = None  # the heap when the current job began; None between jobs

    def run(self) -> None:
        while True:
            time.sleep(_WATCH_S)
            base = self.base
            if base is None:
                continue
            held = _heap_bytes() - base
            if held > self.max_bytes:
                with self.lock:
                    _write_message(self.stdout, {"error": f"it held more than {held} bytes while compiling",
                                                 "kind": "memory", "bytes": held, "recycle": True})
                    os._exit(0)


_WATCH_S = 0.02


def _serve(stdin, stdout) -> None:
    import resource

    import llguidance
    setup = json.loads(_read_message(stdin))
    os.nice(CHILD_NICE)
    tokenizer = llguidance.LLTokenizer(setup["tokenizer_json"], n_vocab=setup["n_vocab"], eos_token=setup["eos"])
    max_bytes = setup["max_bytes"]
    # a hard ceiling beyond the measured limit: an allocation past it fails (llguidance then aborts: a
    # "crash" the parent reports), so no grammar can take the machine's memory first
    data = resource.getrlimit(resource.RLIMIT_DATA)
    ceiling = _data_bytes() + setup["data_limit"]
    if data[1] == resource.RLIM_INFINITY or ceiling < data[1]:
        resource.setrlimit(resource.RLIMIT_DATA, (ceiling, data[1]))
    resident = _resident_bytes()
    _write_message(stdout, {"ready": True})
    lock = threading.Lock()  # one answer per job: the job's or the memory watch's
    watch = _MemoryWatch(stdout, lock, max_bytes)
    threading.Thread(target=watch.run, daemon=True).start()
    threading.stack_size(CHILD_STACK)
    while True:
        try:
            job = json.loads(_read_message(stdin))
        except EOFError:
            return
        result: dict = {}

        def run() -> None:
            try:
                result.update(_compile(llguidance, tokenizer, job["grammar"], max_bytes))
            except Exception as e:  # llguidance raises for what it cannot even parse
                result.update(error=f"{type(e).__name__}: {e}", kind="grammar")
        watch.base = _heap_bytes()
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        watch.base = None
        # memory the allocator kept from a large compile stays with this process: start afresh
        result["recycle"] = _resident_bytes() - resident > max_bytes
        with lock:
            _write_message(stdout, result)
        if result["recycle"]:
            return


def _data_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmData:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return 0


def _read_message(stream) -> bytes:
    head = stream.read(8)
    if len(head) != 8:
        raise EOFError
    n = _INT.unpack(head)[0]
    data = stream.read(n)
    if len(data) != n:
        raise EOFError
    return data


def _write_message(stream, value: dict) -> None:
    data = json.dumps(value).encode()
    stream.write(_INT.pack(len(data)) + data)
    stream.flush()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the server's terminal is the server's to handle
    _serve(sys.stdin.buffer, sys.stdout.buffer)
