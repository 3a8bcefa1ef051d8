"""Tokenize long texts in child processes, so that no GIL-holding step of it runs in ours.

In-process, a fast tokenizer's encode of a 30 MB text can release the GIL while it tokenizes
(`encode_batch`), but converting its ids and freeing its `Encoding` (a string per token) hold the
GIL in single calls of ~0.15 s per million tokens. Here the child does all of that: it answers the
token count, and the ids only when there are at most `max_tokens` of them.

The child is `python -m vlm_sdk.engine.input.tokenizer_process` (it imports only `tokenizers`; never the
caller's `__main__`), started on the first long text. Pipe protocol, all integers int64 little-endian:

    parent -> child, once:      len | tokenizer.json bytes
    parent -> child, per text:  add_special_tokens | max_tokens (-1: none) | len | UTF-8 text
    child -> parent, per text:  token count | number of ids sent (0 when over max_tokens) | ids
"""
from __future__ import annotations

import array
import os
import queue
import struct
import subprocess
import sys
import threading

_INT = struct.Struct("<q")
# the children yield the cores to the server's engine and event loop: two of them tokenizing 1 MiB
# texts at nice 0 took both cores of a 2-core machine, and the other streams' steps waited for a core
CHILD_NICE = 10
_IDS_BLOCK = 1 << 15


def _read_exact(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError("the tokenizer process closed its pipe")
    return data


def _read_int(stream) -> int:
    return _INT.unpack(_read_exact(stream, 8))[0]


class TokenizerProcess:
    """`encode(text, ...)` -> (token count, ids or None when over `max_tokens`), run in a child."""

    def __init__(self, tokenizer_json: str):
        self._json = tokenizer_json.encode()
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one text at a time through the pipe

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "vlm_sdk.engine.input.tokenizer_process"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        proc.stdin.write(_INT.pack(len(self._json)) + self._json)
        return proc

    def encode(self, text: str, add_special_tokens: bool, max_tokens: int | None) -> tuple[int, list[int] | None]:
        data = text.encode()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            try:
                proc.stdin.write(_INT.pack(int(add_special_tokens)) + _INT.pack(-1 if max_tokens is None else max_tokens)
                                 + _INT.pack(len(data)))
                proc.stdin.write(data)  # blocking writes release the GIL
                proc.stdin.flush()
                n, sent = _read_int(proc.stdout), _read_int(proc.stdout)
                packed = _read_exact(proc.stdout, 8 * sent)
            except BaseException:
                self._stop(proc)
                raise
        if sent == 0 and n > 0:
            return n, None
        ids = array.array("q")
        ids.frombytes(packed)
        out: list[int] = []  # a block at a time: one tolist of 500,000 ids holds the GIL for ~80 ms
        for start in range(0, len(ids), _IDS_BLOCK):
            out += ids[start:start + _IDS_BLOCK].tolist()
        return n, out

    def _stop(self, proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()
        if self._proc is proc:
            self._proc = None

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._stop(self._proc)

    def __del__(self):
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()


class TokenizerProcesses:
    """`count` `TokenizerProcess`es (each started on its first text): `encode` takes an idle one, waiting
    (GIL released) only when `count` texts are being tokenized at once, so one long text never holds up
    the next."""

    def __init__(self, tokenizer_json: str, count: int):
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._all = [TokenizerProcess(tokenizer_json) for _ in range(count)]
        for proc in self._all:
            self._idle.put(proc)

    def encode(self, text: str, add_special_tokens: bool, max_tokens: int | None) -> tuple[int, list[int] | None]:
        proc = self._idle.get()
        try:
            return proc.encode(text, add_special_tokens, max_tokens)
        finally:
            self._idle.put(proc)

    def close(self) -> None:
        for proc in self._all:
            proc.close()


def _serve(stdin, stdout) -> None:
    from tokenizers import Tokenizer
    os.nice(CHILD_NICE)
    tokenizer = Tokenizer.from_str(_read_exact(stdin, _read_int(stdin)).decode())
    while True:
        try:
            add_special, max_tokens = _read_int(stdin), _read_int(stdin)
        except EOFError:
            return
        text = _read_exact(stdin, _read_int(stdin)).decode()
        encoding = tokenizer.encode(text, add_special_tokens=bool(add_special))
        n = len(encoding)
        ids = b"" if 0 <= max_tokens < n else array.array("q", encoding.ids).tobytes()
        stdout.write(_INT.pack(n) + _INT.pack(len(ids) // 8) + ids)
        stdout.flush()


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
