#!/usr/bin/env bash
# Data parallelism: the same global batch on 2 ranks and on one process gives the same losses (up
# to the order of the gradient sums), in BF16 and in FP8 with delayed scaling, and one run
# folder; the optimizer state the 2 ranks save is one process's, and a checkpoint the 2 ranks
# wrote resumes on one process and the other way round.
# Usage: [MODEL_ARGS=...] data_parallel_test.sh FP8TRAIN LAUNCHER OUTPUT_DIR [DEVICE [TRAIN ARGS...]]
#   LAUNCHER: the path of mpiexec (2 MPI ranks), or "nproc-per-node" (train --nproc-per-node 2:
#   ranks that meet over TCP, and on the GPU through NCCL); DEVICE: cpu (default) or cuda;
#   TRAIN ARGS: more arguments for every run (--data-path=... where the built-in corpus is not).
#   IDENTICAL_OK=1: 2 ranks may match one process to the last bit (a model whose fp32 gradient
#   sums are exact in any order); otherwise that fails, as gradients that were never summed.
set -euo pipefail
fp8train="$1"
launcher="$2"
output="$3"
device="${4:-cpu}"
shift $(($# < 4 ? $# : 4))
rm -rf "$output"
mkdir -p "$output"
# The model: a small GPT unless MODEL_ARGS says otherwise (the Flux demo's test passes its own).
read -r -a model_args <<<"${MODEL_ARGS:---depth=2 --vocab-size=4096 --sequence-len=64 --sample-tokens=0}"
args=("${model_args[@]}" --micro-batch-size=2 --global-batch-size=8 --train-iters=20
      --save-every=10 --eval-every=0 --log-every=1 --device="$device" --output-dir="$output" "$@")
# ZeRO-1 (shard_optimizer_state) is on unless the arguments turn it off.
sharded=1
for arg in "$@"; do [[ $arg == --shard-optimizer-state=false ]] && sharded=0; done
# fp8train train ARGS... on 2 ranks.
two_ranks() {
  if [[ $launcher == nproc-per-node ]]; then
    "$fp8train" train --nproc-per-node 2 "$@"
  else
    "$launcher" -np 2 --oversubscribe "$fp8train" train "$@"
  fi
}
# BF16, and FP8 with delayed scaling (its amaxes max-reduced over the ranks).
for precision in bf16 delayed; do
  extra=()
  [[ $precision == delayed ]] && extra=(--fp8=hybrid --fp8-recipe=delayed)
  "$fp8train" train "${args[@]}" "${extra[@]}" --run=one_$precision >"$output/one.log" 2>&1 ||
    { cat "$output/one.log"; exit 1; }
  two_ranks "${args[@]}" "${extra[@]}" --run=$precision >"$output/two.log" 2>&1 ||
    { cat "$output/two.log"; echo "FAIL: the 2-rank run failed"; exit 1; }
  grep -q "2 micro-batch(es) per step on each of 2 ranks" "$output/two.log" ||
    { cat "$output/two.log"; echo "FAIL: the 2-rank run did not split the step"; exit 1; }
  if (( sharded != $(grep -c "^optimizer: ZeRO-1" "$output/two.log") )); then
    cat "$output/two.log"; echo "FAIL: expected ZeRO-1 $( ((sharded)) && echo on || echo off)"; exit 1
  fi
  [[ $(grep -c "^step " "$output/two.log") -eq 20 ]] ||
    { cat "$output/two.log"; echo "FAIL: expected 20 step lines, from rank 0 only"; exit 1; }
  python3 - "$precision" "$output/one_$precision/metrics.jsonl" "$output/$precision/metrics.jsonl" <<'PY'
import json, os, sys
def losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if "loss" in r]
precision, one, two = sys.argv[1], losses(sys.argv[2]), losses(sys.argv[3])
assert len(one) == len(two) == 20, (len(one), len(two))
worst = max(abs(a - b) / abs(a) for a, b in zip(one, two))
# fp32 gradient sums in another order, carried through 20 Muon steps.
if worst > 2e-3:
    sys.exit(f"FAIL: {precision}: losses differ by {worst:.2e} (relative): {one} vs {two}")
if one == two and os.environ.get("IDENTICAL_OK") != "1":
    sys.exit(f"FAIL: {precision}: identical to the last bit: were the gradients reduced at all?")
print(f"{precision}: losses agree within {worst:.2e}")
PY
done
# Delayed scaling after one step: the 2 ranks' histories hold the largest amax of any rank,
# the same numbers as one process's (the same weights and sequences, so bit for bit). Skipped
# with FP8_LINEARS=none, for a model too small for the FP8 policy to convert any linear.
if [[ ${FP8_LINEARS:-some} != none ]]; then
one_step=(--train-iters=1 --fp8=hybrid --fp8-recipe=delayed)
"$fp8train" train "${args[@]}" "${one_step[@]}" --run=one_step_one >"$output/one.log" 2>&1 ||
  { cat "$output/one.log"; exit 1; }
two_ranks "${args[@]}" "${one_step[@]}" --run=one_step_two >"$output/two.log" 2>&1 ||
  { cat "$output/two.log"; exit 1; }
python3 - "$output/one_step_one" "$output/one_step_two" <<'PY'
import sys
import numpy as np
from safetensors.numpy import load_file
state = "/checkpoints/step_000001/fp8_scaling.safetensors"
one, two = load_file(sys.argv[1] + state), load_file(sys.argv[2] + state)
assert one.keys() == two.keys() and one, "expected the same delayed-scaling tensors"
different = [k for k in one if not np.array_equal(one[k], two[k])]
if different:
    sys.exit(f"FAIL: delayed scaling after one step differs from one process's: {different[:4]}")
print(f"delayed: {len(one)} scaling states equal one process's after one step")
PY
fi
# The optimizer state the 2 ranks saved at step 10 is one process's, up to the order of the
# gradient sums (with shard_optimizer_state: every rank's part, gathered).
python3 - "$output/bf16" "$output/one_bf16" <<'PY'
import sys
import numpy as np
from safetensors.numpy import load_file
state = "/checkpoints/step_000010/optimizer.safetensors"
two, one = load_file(sys.argv[1] + state), load_file(sys.argv[2] + state)
assert two.keys() == one.keys() and one, "expected the same optimizer buffers"
# By kind (exp_avg, momentum, ...) over all tensors: a tensor whose gradient is rounding noise
# (backout_lambda at depth 2) differs wholly, a rank's part missing moves its kind by ~50 %.
kinds = sorted({k.rsplit(".", 1)[1] for k in one if one[k].dtype == np.float32})
for kind in kinds:
    names = [k for k in one if k.endswith("." + kind)]
    a = np.concatenate([two[k].ravel() for k in names]).astype(np.float64)
    b = np.concatenate([one[k].ravel() for k in names]).astype(np.float64)
    error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    if error > 5e-2:
        sys.exit(f"FAIL: optimizer state at step 10: {kind} differs from one process's by {error:.2e}")
    print(f"optimizer state at step 10: {kind} ({len(names)} buffers) within {error:.2e} of one process's")
PY
# Checkpoints across world sizes: the 2 ranks' step 10 on one process, one process's on 2 ranks;
# both end where the uninterrupted runs did.
"$fp8train" train "${args[@]}" --run=bf16 --resume-from-step=10 >"$output/resumed.log" 2>&1 ||
  { cat "$output/resumed.log"; echo "FAIL: the 2-rank checkpoint did not resume on one process"; exit 1; }
two_ranks "${args[@]}" --run=one_bf16 --resume-from-step=10 >"$output/resumed_two.log" 2>&1 ||
  { cat "$output/resumed_two.log"; echo "FAIL: one process's checkpoint did not resume on 2 ranks"; exit 1; }
python3 - "$output" <<'PY'
import json, sys
def final(path):
    return [r["loss"] for r in map(json.loads, open(path)) if "loss" in r][-1]
out = sys.argv[1]
for run in ("bf16", "one_bf16"):  # metrics.jsonl continues across the resume
    records = [r for r in map(json.loads, open(f"{out}/{run}/metrics.jsonl")) if "loss" in r]
    steps = [r["step"] for r in records]
    if steps[-1] != 20 or steps.count(20) != 2:
        sys.exit(f"FAIL: {run}: expected a second run of steps 11..20, found steps {steps}")
    straight, resumed = records[19]["loss"], records[-1]["loss"]
    if abs(straight - resumed) > 2e-3 * abs(straight):
        sys.exit(f"FAIL: {run}: step 20 loss {resumed} after the resume, {straight} straight")
print("resumes across world sizes end where the straight runs did")
PY
# 50 delayed-scaling steps: each checkpoint compares the ranks' scaling state (bit for bit).
if [[ $device == cuda ]]; then
  two_ranks "${args[@]}" --fp8=hybrid --fp8-recipe=delayed --train-iters=50 --save-every=25 \
    --run=delayed_50 >"$output/fifty.log" 2>&1 ||
    { cat "$output/fifty.log"; echo "FAIL: 50 delayed steps on 2 ranks"; exit 1; }
  echo "delayed: the 2 ranks' scaling states are identical after 25 and 50 steps"
fi
echo "PASS: 2 ranks match one process; checkpoints resume across world sizes"
