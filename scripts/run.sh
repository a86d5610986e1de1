#!/usr/bin/env bash
# Quick start (a): install what is missing, build, and run the default training job. Extra
# arguments override configuration keys (e.g. --train-iters=50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
# The CPU demo: a small GPT on the built-in English corpus; --overwrite lets it run again.
./build/src/fp8train train --config configs/tiny.yaml --overwrite "$@"
