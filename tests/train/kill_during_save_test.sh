#!/usr/bin/env bash
# SIGKILL aimed inside checkpoint saves, many times over: after every kill the run folder's
# complete checkpoints pass `checkpoint verify`, the unfinished save (step_N.partial) is neither
# listed nor loaded as a checkpoint, and --resume=auto resumes from the newest complete one;
# resumed to the end, the run has the losses of an uninterrupted run, step for step, bit for bit.
# Usage: kill_during_save_test.sh FP8TRAIN OUTPUT_DIR [KILLS]. FP8T_TEST_SEED replays the kills.
set -euo pipefail
shopt -s nullglob
fp8train="$1"
output="$2"
kills="${3:-24}"
# Each attempt is killed by its second save at the latest (below): the kills never reach the end.
steps=$((2 * kills + 2))
rm -rf "$output"
mkdir -p "$output"
# A checkpoint every step, about as long as the step itself; delayed scaling so that every kind
# of checkpoint file is written, and keep_checkpoints so that pruning is killed too.
common=(--depth=2 --vocab-size=4096 --sequence-len=64 --micro-batch-size=2 "--train-iters=$steps"
        --save-every=1 --keep-checkpoints=3 --fp8=hybrid --fp8-recipe=delayed --eval-every=0
        --sample-tokens=0 --output-dir="$output")

if ! "$fp8train" train "${common[@]}" --run=straight >"$output/straight.log" 2>&1; then
  cat "$output/straight.log"; echo "FAIL: the uninterrupted run failed"; exit 1
fi

seed="${FP8T_TEST_SEED:-$$}"
RANDOM=$seed
echo "kill during save: $kills kills over $steps steps (replay with FP8T_TEST_SEED=$seed)"
killed=(train "${common[@]}" --run=killed --resume=auto)
checkpoints="$output/killed/checkpoints"

# A sleep without a process per call (the polling below runs every few milliseconds): a read
# that times out on a pipe nothing writes to.
exec {idle}<> <(:)
nap() { read -r -t "$1" -u "$idle" _ || true; }

# The newest complete checkpoint's step, 0 when none.
newest_step() {
  local folder newest=0
  for folder in "$checkpoints"/step_*; do
    [[ $folder =~ /step_([0-9]+)$ ]] && newest=$((10#${BASH_REMATCH[1]}))
  done
  echo "$newest"
}

# A save's files in the order it writes them, each with the most milliseconds to wait once it
# is there (less before the small files that end a save): the kill waits for a random one of
# them (or just the new .partial folder), then up to that long, landing inside the write of a
# file (its temporary .NAME.XXXXXX), between two files or, past the save's end, in the rename
# and the pruning after it.
stages=(":9" model.safetensors:9 optimizer.safetensors:3 fp8_scaling.safetensors:1 manifest.json:0)
# Put into a .partial folder that a kill left, so that the poll tells it from the next save's.
stale_marker=left-by-an-earlier-kill

in_save=0
for attempt in $(seq 0 $((kills - 1))); do
  resumed_from=$(newest_step)
  for partial in "$checkpoints"/step_*.partial; do : >"$partial/$stale_marker"; done
  # The save of the step after the resumed one, or of the one after that.
  target=$((resumed_from + 1 + RANDOM % 2))
  printf -v saved "%s/step_%06d" "$checkpoints" "$target"
  partial="$saved.partial"
  stage=${stages[RANDOM % ${#stages[@]}]}
  most_ms=${stage#*:}
  stage=${stage%:*}
  log="$output/killed_$attempt.log"
  "$fp8train" "${killed[@]}" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 20000); do  # ~1 minute
    [[ -d $partial && ! -e $partial/$stale_marker ]] && break
    [[ -d $saved ]] && break  # a save quicker than the poll
    kill -0 "$pid" 2>/dev/null || break
    nap 0.002
  done
  while [[ -n $stage && -d $partial && ! -e $partial/$stage ]] && kill -0 "$pid" 2>/dev/null; do
    nap 0.001
  done
  nap "0.00$((RANDOM % (most_ms + 1)))"
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true  # quiet: the shell would report each kill

  if grep -q "^done:" "$log"; then
    cat "$log"; echo "FAIL: the run ended before the kill"; exit 1
  fi
  if [[ $resumed_from -eq 0 ]]; then
    expected="no checkpoint in .*, starting fresh"
  else
    expected="resumed from step $resumed_from of"
  fi
  grep -q "$expected" "$log" || { cat "$log"; echo "FAIL: expected '$expected'"; exit 1; }

  # Where the kill landed: a .partial folder of the target step is a save cut short.
  if [[ -d $partial && ! -e $partial/$stale_marker ]]; then
    in_save=$((in_save + 1))
    files=("$partial"/* "$partial"/.[!.]*)
    where="inside the save of step $target, its folder holding: ${files[*]##*/}"
    # Without trainer_state.json (written last) it is no checkpoint, and verify says so.
    if [[ ! -e $partial/trainer_state.json ]] &&
       { "$fp8train" checkpoint verify "$partial" >"$output/verify_partial.log" 2>&1 ||
         ! grep -q "no trainer_state.json" "$output/verify_partial.log"; }; then
      cat "$output/verify_partial.log"
      echo "FAIL: an unfinished save taken for a checkpoint"; exit 1
    fi
  else
    where="outside a save (after step $target's, or before it began)"
  fi
  newest=$(newest_step)
  echo "kill $attempt (resumed from step $resumed_from, waiting for '${stage:-the folder}'):" \
       "$where; newest complete checkpoint: step $newest"

  if [[ $newest -gt 0 ]]; then
    verify="$output/verify_$attempt.log"
    if ! "$fp8train" checkpoint verify "$output/killed" >"$verify" 2>&1; then
      cat "$verify"; echo "FAIL: a complete checkpoint does not verify after the kill"; exit 1
    fi
    if grep -q "\.partial\|\.replaced" "$verify" ||
       ! grep -q "^ok .*step_$(printf %06d "$newest"): " "$verify"; then
      cat "$verify"
      echo "FAIL: checkpoint verify listed other than the complete checkpoints"; exit 1
    fi
  fi
done

minimum=$((kills / 2))
echo "$in_save of $kills kills landed inside a save (at least $minimum wanted)"
if [[ $in_save -lt $minimum ]]; then echo "FAIL: too few kills landed inside a save"; exit 1; fi

resumed_from=$(newest_step)
final="$output/killed_final.log"
if ! "$fp8train" "${killed[@]}" >"$final" 2>&1; then
  cat "$final"; echo "FAIL: the last restart failed"; exit 1
fi
if ! grep -q "resumed from step $resumed_from of" "$final" ||
   ! grep -q "^done: $steps steps" "$final"; then
  cat "$final"; echo "FAIL: did not resume from step $resumed_from and finish"; exit 1
fi

# Each step's loss against the uninterrupted run's.
python3 "$(dirname "$0")/compare_losses.py" "$output/straight/metrics.jsonl" \
  "$output/killed/metrics.jsonl" "$steps"
