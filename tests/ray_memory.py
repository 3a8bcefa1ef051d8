"""Ray's memory monitor, seen from the tests: a test on a local Ray cluster is skipped, with Ray's
reason, when the node is past the monitor's threshold (Ray would kill its workers: the test would show
the machine's memory, not the code), before it starts or when a kill happened while it ran.

The share is computed as Ray's monitor computes it (`ray._private.utils`: the cgroup's usage less its
file cache when in one, else the system's used memory); the threshold is Ray's,
`RAY_memory_usage_threshold` (0.95 unless set). A kill is read from the test's error (a rank's
OutOfMemoryError reaches it) or from the GCS's and raylet's logs, where Ray writes "N worker(s) were
killed due to the node running low on memory"."""
from __future__ import annotations

import os
from pathlib import Path

KILL_LINE = "killed due to the node running low on memory"


def threshold() -> float:
    return float(os.environ.get("RAY_memory_usage_threshold", "0.95"))


def node_memory() -> tuple[int, int]:
    """(used, total) bytes of this node, as Ray's memory monitor reads them."""
    from ray._private.utils import get_system_memory, get_used_memory
    return get_used_memory(), get_system_memory()


def over_threshold() -> str | None:
    """The reason to skip when the node is past Ray's threshold now, else None."""
    used, total = node_memory()
    if used < threshold() * total:
        return None
    return (f"the node is at {used / total:.0%} of its memory ({used / 2**30:.1f} of {total / 2**30:.1f} GiB), "
            f"past Ray's memory monitor threshold {threshold():.0%} (RAY_memory_usage_threshold): Ray kills "
            "workers there, so this test would fail for the machine, not the code")


def raylet_logs() -> list[Path]:
    import ray
    node = ray._private.worker._global_node
    if node is None:
        return []
    logs = Path(node.get_logs_dir_path())
    return sorted([*logs.glob("raylet*.out"), *logs.glob("gcs_server*.out")])


def log_sizes() -> dict[Path, int]:
    return {p: p.stat().st_size for p in raylet_logs()}


def kill_since(sizes: dict[Path, int], error: str = "") -> str | None:
    """Ray's own line, when its memory monitor killed a worker since `log_sizes()` returned `sizes` (or
    the test's `error` says so)."""
    for line in error.splitlines():
        if KILL_LINE in line:
            return f"Ray's memory monitor killed a worker while the test ran: {line.strip()[:400]}"
    for path in raylet_logs():
        try:
            with open(path, "rb") as f:
                f.seek(sizes.get(path, 0))
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if KILL_LINE in line:
                return f"Ray's memory monitor killed a worker while the test ran ({path.name}): {line.strip()[:400]}"
    return None
