#!/usr/bin/env bash
# `fp8train sample` on a Flux run's last checkpoint writes a PNG grid of the expected size: 2
# prompts × 3 pictures of 16×16 with 2-pixel gaps around them are 56×38 pixels.
# Usage: flux_sample_test.sh FP8TRAIN RUN_FOLDER OUTPUT_PNG
set -euo pipefail
fp8train="$1"
run="$2"
output="$3"
rm -f "$output"
"$fp8train" sample --checkpoint "$run" --prompt "a red circle on the left" \
  --prompt "a blue square at the top" --steps 2 --images-per-prompt 3 --output "$output"
[[ -f "$output" ]] || { echo "FAIL: $output was not written"; exit 1; }
# A PNG starts with its 8-byte signature and the IHDR chunk: width and height, big-endian, at
# bytes 16 to 23.
read -r -a bytes < <(od -An -tu1 -j16 -N8 "$output")
width=$(((bytes[0] << 24) | (bytes[1] << 16) | (bytes[2] << 8) | bytes[3]))
height=$(((bytes[4] << 24) | (bytes[5] << 16) | (bytes[6] << 8) | bytes[7]))
if [[ $width -ne 56 || $height -ne 38 ]]; then
  echo "FAIL: the grid is ${width}x${height}, expected 56x38"
  exit 1
fi
echo "PASS: $output is a ${width}x${height} PNG"
