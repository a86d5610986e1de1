#!/usr/bin/env bash
# Quick start (a): install what is missing, build, and run the default job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
./build/src/fp8train doctor
./build/src/fp8train check-numerics
