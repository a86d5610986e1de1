#!/usr/bin/env bash
# A run killed with SIGKILL at random moments, and once stopped by SIGUSR1 (Slurm's warning before
# a job's end), restarted each time with the same command (--resume=auto) until it finishes, ends
# with the losses of an uninterrupted run, step for step, bit for bit; with its newest checkpoint
# damaged, `checkpoint verify` names the file and the same command resumes from the one before.
# Usage: soak_test.sh FP8TRAIN OUTPUT_DIR [KILLS]. FP8T_TEST_SEED replays the kill times.
set -euo pipefail
fp8train="$1"
output="$2"
kills="${3:-5}"
steps=40
rm -rf "$output"
mkdir -p "$output"
common=(--depth=2 --vocab-size=4096 --sequence-len=64 --micro-batch-size=2 --train-iters=$steps
        --save-every=4 --eval-every=0 --sample-tokens=0 --output-dir="$output")

if ! "$fp8train" train "${common[@]}" --run=straight >"$output/straight.log" 2>&1; then
  cat "$output/straight.log"; echo "FAIL: the uninterrupted run failed"; exit 1
fi

# The last step an attempt's log shows (0: none yet).
last_step() { grep -o "^step  *[0-9]*" "$1" | tail -1 | grep -o "[0-9]*$" || echo 0; }

seed="${FP8T_TEST_SEED:-$$}"
RANDOM=$seed
echo "soak: $kills interruptions over $steps steps (replay with FP8T_TEST_SEED=$seed)"
soak=(train "${common[@]}" --run=soak --resume=auto)
# Early, so that SIGUSR1 finds the run training (after it, the handler is gone).
usr1_at=$((RANDOM % 2))
killed_mid_run=0
for attempt in $(seq 0 $((kills - 1))); do
  log="$output/soak_$attempt.log"
  "$fp8train" "${soak[@]}" >"$log" 2>&1 &
  pid=$!
  # Attempt a interrupts at a random step of the a-th of kills + 1 stretches of the run (or as
  # soon as it is past it, having resumed there), plus up to 0.3 s: inside a step, a save or
  # the start-up, wherever that falls.
  stretch=$((steps / (kills + 1)))
  target=$((attempt * stretch + 1 + RANDOM % stretch))
  for _ in $(seq 1200); do
    [[ $(last_step "$log") -ge $target ]] && break
    grep -q "^done:" "$log" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  sleep "0.$((RANDOM % 3))$((RANDOM % 10))"
  if [[ $attempt -eq $usr1_at ]]; then
    kill -USR1 "$pid" 2>/dev/null || true
    status=0
    wait "$pid" || status=$?
    if [[ $status -ne 138 && $status -ne 0 ]]; then
      cat "$log"; echo "FAIL: SIGUSR1 ended the run with status $status, expected 138"; exit 1
    fi
    if [[ $status -eq 138 ]] && ! grep -q "or --resume=auto" "$log"; then
      cat "$log"; echo "FAIL: SIGUSR1 stopped the run without a checkpoint"; exit 1
    fi
    echo "attempt $attempt: SIGUSR1 at step $(last_step "$log"), status $status"
  else
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" || true
    grep -q "^done:" "$log" || killed_mid_run=$((killed_mid_run + 1))
    echo "attempt $attempt: SIGKILL at step $(last_step "$log") ($(grep -o 'resumed from step [0-9]*' "$log" || echo 'fresh start'))"
  fi
done
if [[ $killed_mid_run -eq 0 ]]; then echo "FAIL: no SIGKILL landed before the run ended"; exit 1; fi
final="$output/soak_final.log"
if ! "$fp8train" "${soak[@]}" >"$final" 2>&1; then
  cat "$final"; echo "FAIL: the last restart failed"; exit 1
fi
grep -q "^done: $steps steps" "$final" || { cat "$final"; echo "FAIL: did not finish"; exit 1; }
grep -o "resumed from step [0-9]*\|no checkpoint in .*, starting fresh" "$final" || true

# The newest checkpoint damaged (its weights cut short): the same command names it, resumes from
# the one before and runs the last steps again.
# (A kill during a save can leave step_N.partial or step_N.replaced folders: not checkpoints.)
newest=$(ls -d "$output"/soak/checkpoints/step_* | grep -E '/step_[0-9]+$' | sort | tail -1)
weights="$newest/model.safetensors"
truncate -s $(( $(stat -c %s "$weights") / 2 )) "$weights"
verify_status=0
"$fp8train" checkpoint verify "$newest" >"$output/verify.log" 2>&1 || verify_status=$?
if [[ $verify_status -ne 1 ]] || ! grep -q "^FAIL .*model.safetensors: .*cut short" "$output/verify.log"; then
  cat "$output/verify.log"; echo "FAIL: checkpoint verify did not find the damage (status $verify_status)"; exit 1
fi
damaged="$output/soak_damaged.log"
if ! "$fp8train" "${soak[@]}" >"$damaged" 2>&1; then
  cat "$damaged"; echo "FAIL: no fallback from a damaged checkpoint"; exit 1
fi
if ! grep -q "cannot resume from step $((10#${newest##*_})): .*model.safetensors" "$damaged" ||
   ! grep -q "^done: $steps steps" "$damaged"; then
  cat "$damaged"; echo "FAIL: the damaged checkpoint was not named, or the run did not finish"; exit 1
fi
grep -o "resume: auto: cannot resume from step [0-9]*\|resumed from step [0-9]*" "$damaged"

# Each step's loss against the uninterrupted run's.
python3 "$(dirname "$0")/compare_losses.py" "$output/straight/metrics.jsonl" \
  "$output/soak/metrics.jsonl" "$steps"
