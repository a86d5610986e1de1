#!/usr/bin/env bash
# Builds the libFuzzer targets of fuzz/ (clang 19, AddressSanitizer, UBSan) in ./build-fuzz and
# runs each for SECONDS (default 30) on a copy of its seed corpus in fuzz/corpus/. Fails when a
# fuzzer finds a crash, a sanitizer report, a leak, a timeout or an out-of-memory; the input is
# then in build-fuzz/fuzz-runs/TARGET/, and `build-fuzz/fuzz/TARGET_fuzzer INPUT` replays it.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-30}"
targets=(config safetensors token_shard tokenizer)

CC=clang-19 CXX=clang++-19 cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DFP8TRAIN_FUZZ=ON -DFP8TRAIN_CUDA=OFF -DFP8TRAIN_MPI=OFF >/dev/null
cmake --build build-fuzz --parallel "$(nproc)" --target "${targets[@]/%/_fuzzer}"

# Sanitizer reports name functions and lines only when they find a symbolizer.
if symbolizer=$(command -v llvm-symbolizer-19 || command -v llvm-symbolizer); then
  export ASAN_SYMBOLIZER_PATH="$symbolizer"
fi
failed=()
for target in "${targets[@]}"; do
  run="build-fuzz/fuzz-runs/$target"
  rm -rf "$run"
  mkdir -p "$run/corpus"
  cp "fuzz/corpus/$target"/* "$run/corpus/"
  # -timeout: seconds one input may take; -rss_limit_mb: a reader that allocates what a header
  # claims instead of what the file holds fails here.
  if "build-fuzz/fuzz/${target}_fuzzer" -max_total_time="$seconds" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$run/" "$run/corpus" \
    >"$run/log" 2>&1; then
    echo "fuzz: $target: $(grep -o 'number_of_executed_units: [0-9]*' "$run/log")," \
      "$(find "$run/corpus" -type f | wc -l) inputs in the corpus"
  else
    tail -n 40 "$run/log"
    echo "fuzz: $target: FAILED (log: $run/log)"
    failed+=("$target")
  fi
done
if ((${#failed[@]} > 0)); then
  echo "fuzz: failed: ${failed[*]}" >&2
  exit 1
fi
