#!/usr/bin/env bash
# The wheels tools/gpu_check.sh needs on a device machine that cannot reach a package index: our
# dependencies its image lacks (the 2026-11-26 H100 image had no llguidance, openai or jsonschema) and
# what they need, for CPython 3.12 on x86-64 Linux, into --dest (default .whl/, ignored by git; name it
# in the device call's `carry`).
#
#   tools/gpu_wheels.sh [--dest DIR] [--python-version 3.12]
#
# pip resolves the requirements for that platform, so versions agree (pydantic-core with pydantic,
# httpcore2 with httpx2). The closure is small pure-Python libraries plus a few compiled ones
# (llguidance, pydantic-core, jiter, rpds-py); installed with --target ahead on PYTHONPATH they may
# shadow older copies in the image (typing-extensions, anyio, idna, attrs), which pydantic and httpx2
# need newer anyway. About 10 MB.
set -euo pipefail

REQUIRE="llguidance>=1.0 openai jsonschema"
dest=.whl; pyver=3.12
while [ $# -gt 0 ]; do
  case "$1" in
    --dest) dest=$2; shift 2 ;;
    --python-version) pyver=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_wheels: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
platforms=()
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
mkdir -p "$dest"
# shellcheck disable=SC2086
python3 -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp "${platforms[@]}" \
  -d "$dest" $REQUIRE
ls -1 "$dest"
