#!/usr/bin/env bash
# Regenerates docs/configuration.md from the configuration key table
# (src/config/config_keys.cpp), with `fp8train config --markdown`. Run it after changing a key;
# the test TrainConfig.DocsMatchTheKeyTable fails until the two agree.
# Usage: scripts/gen_config_docs.sh [BUILD_DIR]   (default: build, as scripts/build.sh makes)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
if [[ ! -f "$build/build.ninja" && ! -f "$build/Makefile" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$build" --target fp8train
"$build/src/fp8train" config --markdown > docs/configuration.md
echo "gen_config_docs: wrote docs/configuration.md"
