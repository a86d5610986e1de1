#!/usr/bin/env bash
# Activation recompute in training: the tiny GPT in FP8 (delayed scaling, whose amax histories
# a recompute must not touch) and flux_tiny, trained on the CPU under each recompute setting,
# log the losses of the same run without recompute, step for step and to the last bit.
# Usage: recompute_test.sh FP8TRAIN CONFIGS_DIR OUTPUT_DIR
set -euo pipefail
fp8train="$1"
configs="$2"
output="$3"
rm -rf "$output"
mkdir -p "$output"
steps=4
common=(--train-iters=$steps --eval-every=0 --save-every=0 --log-every=1 --device=cpu
        --output-dir="$output")
gpt=(--config "$configs/tiny.yaml" --depth=3 --sample-tokens=0 --fp8=hybrid
     --fp8-recipe=delayed "${common[@]}")
# flux_tiny: one double and one single block.
flux=(--config "$configs/flux_tiny.yaml" --sample-steps=1 --sample-images-per-prompt=1
      "${common[@]}")
gpt_settings=("selective" "full uniform 1" "full uniform 2" "full block 1" "full block 3")
flux_settings=("selective" "full uniform 1" "full block 1" "full block 2")
for model in gpt flux; do
  declare -n args=$model settings=${model}_settings
  "$fp8train" train "${args[@]}" --run="${model}_none" >"$output/${model}_none.log" 2>&1 ||
    { cat "$output/${model}_none.log"; exit 1; }
  for setting in "${settings[@]}"; do
    read -r granularity method layers <<<"$setting"
    run="${model}_${granularity}_${method:-}_${layers:-}"
    flags=(--recompute-granularity="$granularity")
    [[ -n ${method:-} ]] && flags+=(--recompute-method="$method" --recompute-num-layers="$layers")
    "$fp8train" train "${args[@]}" "${flags[@]}" --run="$run" >"$output/$run.log" 2>&1 ||
      { cat "$output/$run.log"; exit 1; }
    grep -q "activation recompute: $granularity" "$output/$run.log" ||
      { echo "FAIL: $run.log does not name the recompute"; exit 1; }
    python3 "$(dirname "$0")/compare_losses.py" "$output/${model}_none/metrics.jsonl" \
      "$output/$run/metrics.jsonl" $steps
  done
done
echo "PASS: every recompute setting gave the losses of the run without it"
