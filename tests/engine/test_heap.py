"""engine/heap.py: `vlm-sdk serve`'s allocator setting, two malloc arenas however many threads allocate
(each case in a fresh process: the setting is process-wide and outlives the call)."""
import os
import platform
import subprocess
import sys

import pytest

from vlm_sdk.engine.heap import USER_ALLOCATOR_SETTINGS

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and malloc_info are glibc's")

# Eight threads alive at once each allocate (blocks over 512 bytes go to malloc, not Python's own
# allocator); glibc's malloc_info then lists one <heap> per arena. By default a thread that allocates
# gets an arena of its own (up to 8 per core).
PROBE = """
import ctypes, sys, tempfile, threading
from vlm_sdk.engine.heap import bound_server_heap
tuned = bound_server_heap() if sys.argv[1] == "tuned" else False
barrier = threading.Barrier(9)
kept = []

def work():
    kept.append([bytearray(4096) for _ in range(64)])
    barrier.wait()  # all alive together: none hands its arena on to the next
    barrier.wait()

threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
barrier.wait()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile("r") as f:
    fp = ctypes.c_void_p(libc.fopen(f.name.encode(), b"w"))
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    arenas = f.read().count("<heap nr=")
barrier.wait()
for t in threads:
    t.join()
print(tuned, arenas)
"""


def _run(mode: str, **env) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in USER_ALLOCATOR_SETTINGS}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    return out[0], int(out[1])


def test_threads_share_two_arenas():
    tuned, arenas = _run("tuned")
    assert tuned == "True" and arenas == 2, arenas
    untuned, arenas_default = _run("default")  # what the setting is for: by default, one a thread
    assert untuned == "False" and arenas_default > 4, arenas_default


def test_the_users_own_allocator_settings_stand():
    tuned, arenas = _run("tuned", MALLOC_ARENA_MAX="3")
    assert tuned == "False" and arenas == 3, arenas
