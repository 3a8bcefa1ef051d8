#!/usr/bin/env bash
# The device check (issue 30): everything a GPU session measures, in one bounded command.
#
#   tools/gpu_check.sh [--out DIR] [--budget SECONDS] [--only STAGES] [--wheels DIR] [--cpu]
#
# Runs on a bare machine that has torch, triton and transformers but not this package: a copy of the
# package (vlm_sdk/, with kernels/ and models/ where setuptools maps them) is staged in a temporary
# folder and put on PYTHONPATH (PYTHONSAFEPATH keeps the checkout's own vlm_sdk/ off sys.path). Python
# packages the machine lacks travel as wheels in --wheels (default .whl/; tools/gpu_wheels.sh downloads
# them on a machine with network) and are unpacked there with pip --no-index --no-deps. env.log says
# which of our dependencies are present and which are missing.
#
# Stages, in this order, each under its own time limit and all within --budget (default 480 s):
#   env        versions, the GPU, which dependencies are present                      env.log
#   bench      vlm-sdk bench --gpu --json --profile: the figures against their floors, bench.json, bench.err,
#              the cold prefill (vision tower and LLM apart), cuBLAS vs the small-M  profile.txt
#              kernel (the winner recorded), the decode profile
#   tests      pytest -m cuda over tests/, one process                                cuda_tests.log
#   multiturn  vlm-sdk bench --multi-turn --device cuda (two engines on one GPU)      extra.log
#   host       vlm-sdk bench --host-overhead on the machine's host CPU                extra.log
# then summary.txt: each stage's exit status and time, the figures, the tests' result line.
# Everything lands in --out (default $OUT, else ./gpu-out), seven files at most, no subfolders.
#
# --cpu checks the plumbing without a GPU: the bench's --tiny path, the CUDA tests collected and
# skipped, the multi-turn bench on the CPU at toy sizes (tests/structure/test_gpu_check.py runs it).
set -u -o pipefail

STAGES="env bench tests multiturn host"
usage() {
  sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit "${1:-2}"
}
die() { echo "gpu_check: $*" >&2; exit 2; }

out=${OUT:-$PWD/gpu-out}; budget=480; only=$STAGES; wheels=.whl; cpu=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || die "--out needs a folder"; out=$2; shift 2 ;;
    --budget) [ $# -ge 2 ] || die "--budget needs seconds"; budget=$2; shift 2 ;;
    --only) [ $# -ge 2 ] || die "--only needs stages, e.g. --only env,bench"; only=${2//,/ }; shift 2 ;;
    --wheels) [ $# -ge 2 ] || die "--wheels needs a folder"; wheels=$2; shift 2 ;;
    --cpu) cpu=1; shift ;;
    -h|--help) usage 0 ;;
    *) echo "gpu_check: unknown argument '$1'" >&2; usage 2 ;;
  esac
done
case "$budget" in ''|*[!0-9]*) die "--budget takes whole seconds, got '$budget'" ;; esac
[ "$budget" -ge 60 ] || die "--budget must be at least 60 seconds, got $budget"
for s in $only; do
  case " $STAGES " in *" $s "*) ;; *) die "unknown stage '$s' in --only; stages: ${STAGES// /,}" ;; esac
done

repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
mkdir -p "$out" || die "cannot create --out $out"
out=$(cd "$out" && pwd)
rm -f "$out"/{env.log,bench.json,bench.err,profile.txt,cuda_tests.log,extra.log,summary.txt}
work=$(mktemp -d "${TMPDIR:-/tmp}/vlm-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
summary() { echo "$*" | tee -a "$out/summary.txt"; }
wanted() { case " $only " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# -- the package, staged as setuptools would install it; wheels beside it
mkdir -p "$work/site" "$work/deps" "$work/cache"
cp -R "$repo/vlm_sdk" "$work/site/vlm_sdk"
cp -R "$repo/kernels" "$work/site/vlm_sdk/kernels"
cp -R "$repo/models" "$work/site/vlm_sdk/models"
cp -R "$repo/samples" "$work/site/samples"  # bench-serve's default image, found beside the package
if compgen -G "$wheels/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/deps" "$wheels"/*.whl \
    > "$work/wheels.log" 2>&1 || summary "wheels: pip could not install $wheels/*.whl (see env.log)"
fi
export PYTHONPATH="$work/site:$work/deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 \
  HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLM_SDK_CACHE="$work/cache"
cd "$repo" || exit 2
summary "gpu_check at $(git rev-parse --short HEAD 2>/dev/null || echo '?'): stages ${only// /,}; budget $budget s; cpu mode $cpu; python $py"

# stage NAME CAP OUT ERR CMD...: run CMD, its output appended to OUT and ERR, with at most CAP seconds,
# less when the budget runs short (keeping 20 s for what follows); under 20 s left it is skipped
stage() {
  local name=$1 cap=$2 stdout=$3 stderr=$4 limit rc start
  shift 4
  limit=$(( $(left) - 20 ))
  [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -lt 20 ]; then summary "$name: skipped, $(left) s of the budget left"; return 0; fi
  start=$(date +%s)
  timeout -s INT -k 15 "$limit" "$@" >> "$stdout" 2>> "$stderr"
  rc=$?
  if [ "$rc" -eq 124 ]; then summary "$name: stopped at its limit of $limit s"
  else summary "$name: exit $rc in $(( $(date +%s) - start )) s"; fi
}

# versions, the GPU, our dependencies present or missing (a script of its own: `timeout` runs it)
cat > "$work/env.sh" <<'ENV'
echo "date $(date -u '+%Y-%m-%d %H:%M UTC'); repo $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
[ -f "$1" ] && { echo "wheels:"; cat "$1"; }
"$2" - <<'EOF'
import importlib, platform, sys
print("python", sys.version.split()[0], sys.executable, "|", platform.machine())
import torch
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| GPU",
      torch.cuda.get_device_name() if torch.cuda.is_available() else None)
import vlm_sdk, vlm_sdk.kernels, vlm_sdk.models.registry
print("vlm_sdk staged at", vlm_sdk.__file__)
# our dependencies (pyproject.toml: runtime, then the tests' extra), by import name
deps = {"torch": "torch", "transformers": "transformers", "huggingface_hub": "huggingface_hub",
        "tokenizers": "tokenizers", "pillow": "PIL", "triton": "triton", "safetensors": "safetensors",
        "aiohttp": "aiohttp", "einops": "einops", "tqdm": "tqdm", "numpy": "numpy", "jinja2": "jinja2",
        "prometheus_client": "prometheus_client", "llguidance": "llguidance", "pytest": "pytest",
        "openai": "openai", "jsonschema": "jsonschema", "pytest-timeout": "pytest_timeout"}
missing = []
for dist, mod in deps.items():
    try:
        m = importlib.import_module(mod)
        print(f"  {dist:<18} {getattr(m, '__version__', 'present')}  {getattr(m, '__file__', '')}")
    except Exception as e:
        missing.append(dist)
        print(f"  {dist:<18} MISSING ({type(e).__name__}: {e})")
print("missing dependencies:", ", ".join(missing) or "none")
EOF
ENV

if [ "$cpu" = 1 ]; then
  bench_args=(--tiny); mt_args=(--device cpu --turns 2 --answer-tokens 2 --rounds 1 --users 2 --user-tokens 2)
  ho_args=(--ho-batches 1,8 --ho-steps 3 --ho-prompt-len 32)
else
  bench_args=(); mt_args=(--device cuda); ho_args=()
fi
timeout_flag=()
"$py" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout 150)

wanted env && stage env 60 "$out/env.log" "$out/env.log" bash "$work/env.sh" "$work/wheels.log" "$py"
wanted bench && stage bench 200 "$out/bench.json" "$out/bench.err" "$py" -m vlm_sdk.cli bench --gpu \
  ${bench_args[@]+"${bench_args[@]}"} --json --profile "$out/profile.txt"
wanted tests && stage tests 240 "$out/cuda_tests.log" "$out/cuda_tests.log" "$py" -m pytest -m cuda -q -rfEs \
  -p no:cacheprovider --durations=15 --continue-on-collection-errors ${timeout_flag[@]+"${timeout_flag[@]}"} tests
if wanted multiturn; then
  echo "== multiturn: vlm-sdk bench --multi-turn ${mt_args[*]}" >> "$out/extra.log"
  stage multiturn 90 "$out/extra.log" "$out/extra.log" "$py" -m vlm_sdk.cli bench --multi-turn "${mt_args[@]}"
fi
if wanted host; then
  echo "== host: vlm-sdk bench --host-overhead ${ho_args[*]}" >> "$out/extra.log"
  stage host 60 "$out/extra.log" "$out/extra.log" "$py" -m vlm_sdk.cli bench --host-overhead \
    ${ho_args[@]+"${ho_args[@]}"}
fi

# the short table, last (a device call returns the end of the output)
{
  if [ -s "$out/bench.json" ]; then
    "$py" - "$out/bench.json" <<'EOF' || echo "bench.json: not readable"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"bench on {r['device']}: {len(r['figures'])} figures, {r['seconds']:.0f} s; notes: {len(r['notes'])}")
for f in r["figures"]:
    print(f"  {f['name'][:66]:<66} {f['value']:>10.3f} {f['unit']:<8} {f['ratio']:>6.2f}x  {f['target']}")
g = r.get("small_m_gemm")
if g:
    print(f"  small-M: recommended small_m_gemm='{g['recommended']}' (torch/triton us): " + ", ".join(
        f"{x['projection']}@{x['rows']} {x['torch_us']:.1f}/{x['triton_us']:.1f}" for x in g["rows"]))
for s in r.get("profile", {}).get("sections", []):
    kinds = ", ".join(f"{k} {v:,.0f}" for k, v in list(s["kinds_us_per_step"].items())[:5])
    print(f"  profile {s['title'][:40]}: wall {s['wall_ms_per_step']:.2f} ms; us by kind: {kinds}")
EOF
  fi
  [ -s "$out/cuda_tests.log" ] && echo "tests: $(grep -E '(passed|failed|skipped|error|no tests ran)' "$out/cuda_tests.log" | tail -1)"
  echo "total $(( $(date +%s) - t0 )) s of a ${budget} s budget; files in $out: $(cd "$out" && ls | tr '\n' ' ')"
} | tee -a "$out/summary.txt"
