"""engine/heap.py: `vlm-sdk serve`'s allocator settings return freed multi-megabyte blocks to the system
(each in a fresh process: the settings are process-wide and outlive the call)."""
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")

# After a 16 MiB block is freed, glibc's default raises its mmap threshold to 16 MiB: the 2 MiB blocks
# that follow come from the heap, and a small block allocated after them keeps their pages resident
# once they are freed. Under bound_server_heap each is mapped on its own and unmapped when freed.
PROBE = """
import sys
from vlm_sdk.engine.heap import bound_server_heap
tuned = bound_server_heap() if sys.argv[1] == "tuned" else False

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10

big = bytearray(16 << 20)
del big
before = rss()
blocks = [bytearray(2 << 20) for _ in range(32)]  # 64 MiB, written (a bytearray is zero-filled)
pins = [bytearray(1000) for _ in range(64)]  # small and alive, allocated after the blocks
del blocks
print(tuned, (rss() - before) >> 20)
"""


def _run(mode: str, **env) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_",
                                                               "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    return out[0], int(out[1])


def test_freed_large_blocks_leave_the_resident_set():
    tuned, kept = _run("tuned")
    assert tuned == "True" and kept < 8, f"{kept} MiB of 64 MiB freed still resident"
    untuned, kept_default = _run("default")  # what the setting is for: glibc's default keeps them
    assert untuned == "False" and kept_default > 32, kept_default


def test_the_users_own_allocator_settings_stand():
    tuned, kept = _run("tuned", MALLOC_ARENA_MAX="4")
    assert tuned == "False" and kept > 32, kept
