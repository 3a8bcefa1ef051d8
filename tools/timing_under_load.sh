#!/usr/bin/env bash
# The suite's wall-clock tests (marked `timing`) beside a CPU-bound load: they measure each stall against
# a baseline taken in the same run (tests/server_helpers.py stall_bound), so they must pass on a machine
# whose cores are all busy with other work, as a shared 2-core CI runner's are.
#   tools/timing_under_load.sh [WORKERS] [pytest args]
# WORKERS busy processes (default: one per core) spin for the whole run; without test paths it runs the
# tests that assert a stream's worst gap beside an attack and the Ray tensor-parallel tests (which skip,
# naming Ray's reason, when Ray's memory monitor sees the node past its threshold).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
workers=${1:-$(nproc)}
shift || true
paths=0
for a in "$@"; do case "$a" in -*) ;; *) paths=1 ;; esac; done
if [ "$paths" -eq 0 ]; then
  set -- "$@" tests/server/test_grammar_budgets.py tests/server/test_prompt_stall.py \
    tests/server/test_request_budgets.py tests/server/test_server_video_costs.py tests/server/test_fair_load.py \
    "tests/server/test_server_video.py::test_decoding_a_video_does_not_stall_another_stream" \
    tests/e2e/test_ray_tensor_parallel.py
fi
# Each busy process is another program (`stress --cpu 1`'s load): a session of its own, as a job started
# from another shell is, so the kernel's autogroups share the CPU between it and the tests as between two
# programs (the engine's grammar processes run at nice 19 inside the tests' share, as in production).
pids=()
for _ in $(seq "$workers"); do
  setsid "$py" -c 'while True: pass' &
  pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
echo "[timing_under_load] $workers busy processes beside: pytest $*; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
rc=0
OMP_NUM_THREADS=1 "$py" -m pytest -q -s -p no:cacheprovider "$@" || rc=$?
echo "[timing_under_load] load average at the end $(cut -d' ' -f1-3 /proc/loadavg)" >&2
exit $rc
