#!/usr/bin/env bash
# Quick start (b): install what is missing, build, and run the tests. Without a GPU the tests
# labelled "gpu" are skipped; with --gpu they run too.
set -euo pipefail
cd "$(dirname "$0")/.."
labels=(-LE gpu)
if [[ "${1:-}" == "--gpu" ]]; then labels=(); fi
bash scripts/setup.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure --parallel "$(nproc)" "${labels[@]}"
