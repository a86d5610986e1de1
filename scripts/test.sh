#!/usr/bin/env bash
# Quick start (b): install what is missing, build, and run the tests, then the fuzzers for 30
# seconds each (scripts/fuzz.sh). Without a GPU the tests labelled "gpu" are skipped; with --gpu
# they run too.
set -euo pipefail
cd "$(dirname "$0")/.."
labels=(-LE gpu)
if [[ "${1:-}" == "--gpu" ]]; then labels=(); fi
bash scripts/setup.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure --parallel "$(nproc)" "${labels[@]}"
bash scripts/fuzz.sh
