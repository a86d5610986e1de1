#!/usr/bin/env bash
# A run killed with SIGKILL at random moments, and once stopped by SIGUSR1 (Slurm's warning before
# a job's end), restarted each time with the same command (--resume=auto) until it finishes, ends
# with the losses of an uninterrupted run, step for step, bit for bit; and with its newest
# checkpoint damaged, the same command resumes from the one before.
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
# How long a run takes here, to spread the kills over it.
seconds=$(python3 -c "import json; print(sum(json.loads(l).get('step_seconds', 0) for l in open('$output/straight/metrics.jsonl') if '\"step\"' in l))")

seed="${FP8T_TEST_SEED:-$$}"
RANDOM=$seed
echo "soak: $kills kills over a ${seconds} s run (replay with FP8T_TEST_SEED=$seed)"
soak=(train "${common[@]}" --run=soak --resume=auto)
usr1_at=$((RANDOM % kills))
killed_mid_run=0
for attempt in $(seq 0 $((kills - 1))); do
  log="$output/soak_$attempt.log"
  "$fp8train" "${soak[@]}" >"$log" 2>&1 &
  pid=$!
  # At random, up to 1.5 × the run's length / kills: the kills spread over the whole run.
  delay=$(python3 -c "import random; random.seed($RANDOM); print(round(0.2 + random.random() * 1.5 * $seconds / $kills, 2))")
  sleep "$delay"
  if [[ $attempt -eq $usr1_at ]]; then
    # Once a step has run: before the handlers are in place SIGUSR1 would just end the process.
    for _ in $(seq 600); do
      grep -q "^step  *[0-9]*/$steps\|^done:" "$log" && break
      sleep 0.1
    done
    kill -USR1 "$pid" 2>/dev/null || true
    status=0
    wait "$pid" || status=$?
    if [[ $status -ne 138 && $status -ne 0 ]]; then
      cat "$log"; echo "FAIL: SIGUSR1 ended the run with status $status, expected 138"; exit 1
    fi
    if [[ $status -eq 138 ]] && ! grep -q "or --resume=auto" "$log"; then
      cat "$log"; echo "FAIL: SIGUSR1 stopped the run without a checkpoint"; exit 1
    fi
    echo "attempt $attempt: SIGUSR1 after ${delay} s, status $status"
  else
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" || true
    grep -q "^done:" "$log" || killed_mid_run=$((killed_mid_run + 1))
    echo "attempt $attempt: SIGKILL after ${delay} s: $(grep -o 'resumed from step [0-9]*' "$log" || echo 'fresh start')"
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
newest=$(ls -d "$output"/soak/checkpoints/step_* | sort | tail -1)
weights="$newest/model.safetensors"
truncate -s $(( $(stat -c %s "$weights") / 2 )) "$weights"
damaged="$output/soak_damaged.log"
if ! "$fp8train" "${soak[@]}" >"$damaged" 2>&1; then
  cat "$damaged"; echo "FAIL: no fallback from a damaged checkpoint"; exit 1
fi
if ! grep -q "cannot resume from step $((10#${newest##*_})): .*model.safetensors" "$damaged" ||
   ! grep -q "^done: $steps steps" "$damaged"; then
  cat "$damaged"; echo "FAIL: the damaged checkpoint was not named, or the run did not finish"; exit 1
fi
grep -o "resume: auto: cannot resume from step [0-9]*\|resumed from step [0-9]*" "$damaged"

# Each step's loss as the soak last logged it (a restart repeats the steps after its checkpoint)
# against the uninterrupted run's.
python3 - "$output/straight/metrics.jsonl" "$output/soak/metrics.jsonl" "$steps" <<'PY'
import json, sys
def losses(path):
    found = {}
    for line in open(path):
        record = json.loads(line)
        if "step" in record and "loss" in record:
            found[record["step"]] = record["loss"]
    return found
straight, soak, steps = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[3])
missing = [s for s in range(1, steps + 1) if s not in soak]
differ = [(s, straight[s], soak[s]) for s in range(1, steps + 1) if s in soak and soak[s] != straight[s]]
if missing or differ:
    print(f"FAIL: steps missing {missing[:5]}, losses differing (step, straight, soak) {differ[:5]}")
    sys.exit(1)
print(f"PASS: {steps} steps through the kills, every loss equal to the uninterrupted run's")
PY
