#!/usr/bin/env bash
# Our engine on `vlm-sdk bench`'s workload at two checkouts, alternated, in process CPU seconds with one
# torch thread (tools/engine_cpu_time.py): a before/after comparison that holds on a machine shared with
# other work, where wall time does not. Each checkout is used as a source tree (kernels/ and models/
# symlinked into vlm_sdk/, as the GPU device check does), with this environment's python.
#   tools/engine_cpu_ab.sh BEFORE_REV AFTER_REV [ROUNDS]     one JSON line per run on stdout
set -euo pipefail
cd "$(dirname "$0")/.."
before=$1 after=$2 rounds=${3:-4}
py=${PYTHON:-.venv/bin/python}
ckpt=$("$py" -c "from vlm_sdk.demo_checkpoint import tiny_model_dir; print(tiny_model_dir('bench', 'qwen2_5_vl'))")
work=$(mktemp -d)
trap 'git worktree remove --force "$work/before" >/dev/null 2>&1; git worktree remove --force "$work/after" >/dev/null 2>&1; rm -rf "$work"' EXIT
for side in before after; do
  rev=${!side}
  git worktree add --detach -q "$work/$side" "$rev"
  ln -s ../kernels "$work/$side/vlm_sdk/kernels"
  ln -s ../models "$work/$side/vlm_sdk/models"
done
for i in $(seq "$rounds"); do
  for side in before after; do
    PYTHONPATH="$work/$side" "$py" tools/engine_cpu_time.py "$ckpt" | sed "s/^{/{\"side\": \"$side\", /"
  done
done
