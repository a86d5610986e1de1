#!/usr/bin/env bash
# SIGINT during training saves a checkpoint and exits with 128 + 2; the run then resumes from
# that step and finishes. Usage: interrupt_test.sh FP8TRAIN OUTPUT_DIR
set -euo pipefail
fp8train="$1"
output="$2"
rm -rf "$output"
args=(--depth=2 --vocab-size=4096 --sequence-len=64 --micro-batch-size=2 --train-iters=100
      --save-every=0 --eval-every=0 --sample-tokens=0 --output-dir="$output" --run=interrupt)
log="$output.log"
mkdir -p "$output"
"$fp8train" train "${args[@]}" >"$log" 2>&1 &
pid=$!
# Interrupt once a few steps have run.
for _ in $(seq 600); do
  grep -q "^step  *3/100" "$log" && break
  sleep 0.1
done
kill -INT "$pid"
status=0
wait "$pid" || status=$?
cat "$log"
if [[ $status -ne 130 ]]; then echo "FAIL: exit status $status, expected 130"; exit 1; fi
step=$(sed -n 's/.*continue with --resume-from-step=\([0-9]*\).*/\1/p' "$log")
if [[ -z "$step" || ! -f "$output/interrupt/checkpoints/step_$(printf %06d "$step")/trainer_state.json" ]]; then
  echo "FAIL: no checkpoint announced or saved"; exit 1
fi
"$fp8train" train "${args[@]}" --resume-from-step="$step" >"$log" 2>&1 || { cat "$log"; exit 1; }
grep -q "resumed from step $step" "$log" || { cat "$log"; echo "FAIL: did not resume"; exit 1; }
grep -q "^done: 100 steps" "$log" || { cat "$log"; echo "FAIL: did not finish"; exit 1; }
echo "PASS: interrupted after step $step, resumed and finished"
