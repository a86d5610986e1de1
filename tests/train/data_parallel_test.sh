#!/usr/bin/env bash
# Data parallelism on the CPU path: the same global batch on 2 MPI ranks and on one process gives
# the same losses (up to the order of the gradient sums) and one run folder; a checkpoint the 2
# ranks wrote resumes on one process. Usage: data_parallel_test.sh FP8TRAIN MPIEXEC OUTPUT_DIR
set -euo pipefail
fp8train="$1"
mpiexec="$2"
output="$3"
rm -rf "$output"
mkdir -p "$output"
args=(--depth=2 --vocab-size=4096 --sequence-len=64 --micro-batch-size=2 --global-batch-size=8
      --train-iters=20 --save-every=10 --eval-every=0 --sample-tokens=0 --device=cpu
      --output-dir="$output")
"$fp8train" train "${args[@]}" --run=one >"$output/one.log" 2>&1 || { cat "$output/one.log"; exit 1; }
"$mpiexec" -np 2 --oversubscribe "$fp8train" train "${args[@]}" --run=two >"$output/two.log" 2>&1 ||
  { cat "$output/two.log"; echo "FAIL: the 2-rank run failed"; exit 1; }
cat "$output/two.log"
grep -q "2 micro-batch(es) per step on each of 2 ranks" "$output/two.log" ||
  { echo "FAIL: the 2-rank run did not split the step"; exit 1; }
[[ $(grep -c "^step " "$output/two.log") -eq 20 ]] || { echo "FAIL: expected 20 step lines, from rank 0 only"; exit 1; }
python3 - "$output/one/metrics.jsonl" "$output/two/metrics.jsonl" <<'PY'
import json, sys
def losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if "loss" in r]
one, two = losses(sys.argv[1]), losses(sys.argv[2])
assert len(one) == len(two) == 20, (len(one), len(two))
worst = max(abs(a - b) / abs(a) for a, b in zip(one, two))
# fp32 gradient sums in another order, carried through 20 Muon steps.
if worst > 2e-3:
    sys.exit(f"FAIL: losses differ by {worst:.2e} (relative): {one} vs {two}")
if one == two:
    sys.exit("FAIL: identical to the last bit: were the gradients reduced over the ranks at all?")
print(f"losses agree within {worst:.2e}")
PY
"$fp8train" train "${args[@]}" --run=two --resume-from-step=10 >"$output/resumed.log" 2>&1 ||
  { cat "$output/resumed.log"; echo "FAIL: the 2-rank checkpoint did not resume on one process"; exit 1; }
grep -q "^done: 20 steps" "$output/resumed.log" || { cat "$output/resumed.log"; exit 1; }
echo "PASS: 2 ranks match one process; their checkpoint resumes on one"
