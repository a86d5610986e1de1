#!/usr/bin/env bash
# Tensor parallelism (the CPU path, or with DEVICE cuda the GPUs): a GPT whose blocks 2 ranks split (tensor_model_parallel_size
# 2) gives the losses of one process, up to the order of the partial sums, in BF16 and in FP8
# with tensorwise scaling, also with sequence parallelism; so does a job of 4 ranks, 2
# data-parallel replicas of 2 sequence-parallel ranks; a checkpoint of the 2 ranks resumes on one process; a group that
# does not divide the job is refused, and so is a global batch the replicas cannot share.
# Flux's demo model on 2 ranks gives one process's losses too, with sequence parallelism or
# without.
# Usage: tensor_parallel_test.sh FP8TRAIN LAUNCHER OUTPUT_DIR FLUX_CONFIG [DEVICE]
#   LAUNCHER: the path of mpiexec, or "nproc-per-node" (ranks that meet over TCP);
#   FLUX_CONFIG: configs/flux_tiny.yaml; DEVICE: cpu (default), or cuda: one GPU per rank, the
#   2-rank runs only (the 2 x 2 job, the resume and the refusals are the CPU path's).
set -euo pipefail
fp8train="$1"
launcher="$2"
output="$3"
flux_config="$4"
device="${5:-cpu}"
rm -rf "$output"
mkdir -p "$output"
# 4 heads of 32 features (the default head_dim would leave one head, which cannot be split).
args=(--depth=2 --head-dim=32 --vocab-size=4096 --sequence-len=64 --sample-tokens=0
      --micro-batch-size=2 --global-batch-size=4 --train-iters=10 --save-every=5 --eval-every=5
      --eval-iters=2 --log-every=1 --lr-warmup-iters=0 --lr=0.3 --embedding-lr=3 --unembedding-lr=0.15
      --scalar-lr=3 --device="$device" --output-dir="$output")
ranks() {
  local count="$1"
  shift
  if [[ $launcher == nproc-per-node ]]; then
    "$fp8train" train --nproc-per-node "$count" "$@"
  else
    "$launcher" -np "$count" --oversubscribe "$fp8train" train "$@"
  fi
}
# compare ONE TWO LABEL [FIRST_STEP]: the losses, validation losses and gradient norms of two
# runs' metrics agree.
compare() {
  python3 - "$@" <<'PY'
import json, sys
def records(path, key):
    return {r["step"]: r[key] for r in map(json.loads, open(path))
            if r.get(key) is not None and "step" in r}
one_path, two_path, label = sys.argv[1:4]
first = int(sys.argv[4]) if len(sys.argv) > 4 else 1
# The gradient norm too: Muon's and Adam's updates barely change with a gradient's scale, so the
# losses alone would miss gradients that were not summed over the group.
for key in ("loss", "val_loss", "grad_norm"):
    one, two = records(one_path, key), records(two_path, key)
    steps = [s for s in one if s >= first]
    if not steps or any(s not in two for s in steps):
        sys.exit(f"FAIL: {label}: {key} at steps {sorted(steps)} vs {sorted(two)}")
    worst = max(abs(one[s] - two[s]) / abs(one[s]) for s in steps)
    # fp32 partial sums in another order (and with FP8 a few casts that round the other way),
    # carried through 10 Muon steps; a norm of gradients moves more than the loss.
    if worst > (2e-2 if key == "grad_norm" else 2e-3):
        sys.exit(f"FAIL: {label}: {key} differs by {worst:.2e} (relative)")
    if key == "loss" and one == two:
        sys.exit(f"FAIL: {label}: identical to the last bit: did the ranks split anything?")
    print(f"{label}: {key} agrees within {worst:.2e} over steps {min(steps)}-{max(steps)}")
PY
}
for precision in bf16 tensorwise; do
  extra=()
  [[ $precision == tensorwise ]] && extra=(--fp8=hybrid --fp8-recipe=tensorwise)
  "$fp8train" train "${args[@]}" "${extra[@]}" --run=one_$precision >"$output/one.log" 2>&1 ||
    { cat "$output/one.log"; exit 1; }
  ranks 2 "${args[@]}" "${extra[@]}" --tensor-model-parallel-size=2 --run=tp2_$precision \
    >"$output/tp2.log" 2>&1 || { cat "$output/tp2.log"; echo "FAIL: the 2-rank run failed"; exit 1; }
  grep -q "2 micro-batch(es) per step on each of 1 data-parallel replica(s) of 2 tensor-parallel ranks" \
    "$output/tp2.log" || { cat "$output/tp2.log"; echo "FAIL: no tensor-parallel split"; exit 1; }
  compare "$output/one_$precision/metrics.jsonl" "$output/tp2_$precision/metrics.jsonl" \
    "$precision, 2 tensor-parallel ranks"
  # Sequence parallelism: each rank keeps half of the tokens outside the split linears.
  ranks 2 "${args[@]}" "${extra[@]}" --tensor-model-parallel-size=2 --sequence-parallel=true \
    --run=sp2_$precision >"$output/sp2.log" 2>&1 ||
    { cat "$output/sp2.log"; echo "FAIL: the sequence-parallel run failed"; exit 1; }
  compare "$output/one_$precision/metrics.jsonl" "$output/sp2_$precision/metrics.jsonl" \
    "$precision, 2 sequence-parallel ranks"
  # Its plan holds fewer activations than plain tensor parallelism's: the split is on.
  plain=$(grep -o "activations [0-9.]* [KMG]iB" "$output/tp2.log")
  split=$(grep -o "activations [0-9.]* [KMG]iB" "$output/sp2.log")
  [[ -n $split && $split != "$plain" ]] ||
    { echo "FAIL: sequence parallelism planned the activations of plain tensor parallelism" \
      "($split against $plain)"; exit 1; }
done
if [[ $device == cpu ]]; then
  # 2 replicas of 2 sequence-parallel ranks: one micro-batch per replica and step, each group's
  # gathers taking its own ranks' rows out of the whole job's.
  # Overlapped gradient sums are asked for: the CPU path says it sums after the backward.
  ranks 4 "${args[@]}" --tensor-model-parallel-size=2 --sequence-parallel=true --run=tp2_dp2 \
    --overlap-grad-reduce=true >"$output/tp2_dp2.log" 2>&1 ||
    { cat "$output/tp2_dp2.log"; echo "FAIL: the 4-rank run failed"; exit 1; }
  grep -q "1 micro-batch(es) per step on each of 2 data-parallel replica(s) of 2 tensor-parallel" \
    "$output/tp2_dp2.log" || { cat "$output/tp2_dp2.log"; echo "FAIL: expected 2 replicas"; exit 1; }
  grep -q "overlap_grad_reduce has no effect here: the CPU path sums the gradients after the" \
    "$output/tp2_dp2.log" ||
    { cat "$output/tp2_dp2.log"; echo "FAIL: expected the overlap said to be off"; exit 1; }
  compare "$output/one_bf16/metrics.jsonl" "$output/tp2_dp2/metrics.jsonl" "bf16, 2 x 2 ranks"
  # The 2 ranks' checkpoint holds whole tensors: one process resumes it.
  cp -r "$output/tp2_bf16" "$output/resumed"
  rm -rf "$output/resumed/checkpoints/step_000010"
  "$fp8train" train "${args[@]}" --run=resumed --resume-from-step=5 >"$output/resumed.log" 2>&1 ||
    { cat "$output/resumed.log"; echo "FAIL: the resume on one process failed"; exit 1; }
  compare "$output/one_bf16/metrics.jsonl" "$output/resumed/metrics.jsonl" "bf16, resumed on one" 6
fi
# Flux: heads, MLP, linear1 and linear2 split; BF16 (flux_tiny is too narrow for FP8 linears).
# The grid at the end: the group's ranks sample it together, the first writes it.
flux_args=(--config="$flux_config" --train-iters=10 --log-every=1 --eval-every=5 --eval-iters=1
           --save-every=0 --sample-prompts="a red circle on the left" --sample-steps=2
           --sample-images-per-prompt=2 --device="$device" --output-dir="$output")
"$fp8train" train "${flux_args[@]}" --run=flux_one >"$output/flux_one.log" 2>&1 ||
  { cat "$output/flux_one.log"; exit 1; }
ranks 2 "${flux_args[@]}" --tensor-model-parallel-size=2 --run=flux_tp2 >"$output/flux_tp2.log" \
  2>&1 || { cat "$output/flux_tp2.log"; echo "FAIL: the Flux 2-rank run failed"; exit 1; }
grep -q "per step on each of 1 data-parallel replica(s) of 2 tensor-parallel ranks" \
  "$output/flux_tp2.log" || { cat "$output/flux_tp2.log"; echo "FAIL: no Flux split"; exit 1; }
compare "$output/flux_one/metrics.jsonl" "$output/flux_tp2/metrics.jsonl" "flux, 2 tensor-parallel ranks"
[[ -s "$output/flux_tp2/samples/step_000010.png" ]] ||
  { cat "$output/flux_tp2.log"; echo "FAIL: no sample grid from the 2 ranks"; exit 1; }
# Sequence parallelism: each rank keeps half of each sample's image and text tokens outside the
# split linears, and plans fewer activations.
ranks 2 "${flux_args[@]}" --tensor-model-parallel-size=2 --sequence-parallel=true --run=flux_sp2 \
  >"$output/flux_sp2.log" 2>&1 ||
  { cat "$output/flux_sp2.log"; echo "FAIL: the Flux sequence-parallel run failed"; exit 1; }
compare "$output/flux_one/metrics.jsonl" "$output/flux_sp2/metrics.jsonl" \
  "flux, 2 sequence-parallel ranks"
[[ -s "$output/flux_sp2/samples/step_000010.png" ]] ||
  { cat "$output/flux_sp2.log"; echo "FAIL: no sample grid from the sequence-parallel ranks"; exit 1; }
plain=$(grep -o "activations [0-9.]* [KMG]iB" "$output/flux_tp2.log")
split=$(grep -o "activations [0-9.]* [KMG]iB" "$output/flux_sp2.log")
[[ -n $split && $split != "$plain" ]] ||
  { echo "FAIL: Flux sequence parallelism planned the activations of plain tensor parallelism" \
    "($split against $plain)"; exit 1; }
if [[ $device == cuda ]]; then
  echo "PASS: tensor parallelism on the GPU (with sequence parallelism too) matches one process"
  exit 0
fi
# 2 replicas of 2: every rank samples the grid (a group's collectives take every rank here; a
# rank left out would hang the others until the test's time limit).
ranks 4 "${flux_args[@]}" --tensor-model-parallel-size=2 --run=flux_tp2_dp2 \
  >"$output/flux_tp2_dp2.log" 2>&1 ||
  { cat "$output/flux_tp2_dp2.log"; echo "FAIL: the Flux 2 x 2 run failed"; exit 1; }
[[ -s "$output/flux_tp2_dp2/samples/step_000010.png" ]] ||
  { cat "$output/flux_tp2_dp2.log"; echo "FAIL: no sample grid from 2 x 2 ranks"; exit 1; }
# 3 ranks cannot make groups of 2.
if ranks 3 "${args[@]}" --tensor-model-parallel-size=2 --run=bad >"$output/bad.log" 2>&1; then
  cat "$output/bad.log"; echo "FAIL: 3 ranks in groups of 2 ran"; exit 1
fi
grep -q "tensor_model_parallel_size: expected a divisor of the 3 ranks of this job, found 2" \
  "$output/bad.log" ||
  { cat "$output/bad.log"; echo "FAIL: expected the key named"; exit 1; }
# 2 replicas of 2 ranks cannot share a global batch of 6 in micro-batches of 2.
if ranks 4 "${args[@]}" --tensor-model-parallel-size=2 --global-batch-size=6 --run=bad_batch \
  >"$output/bad_batch.log" 2>&1; then
  cat "$output/bad_batch.log"; echo "FAIL: a global batch of 6 ran on 2 replicas of 2"; exit 1
fi
grep -q "global_batch_size: must be a multiple of micro_batch_size × data-parallel replicas (2 × 2 = 4), found 6" \
  "$output/bad_batch.log" ||
  { cat "$output/bad_batch.log"; echo "FAIL: expected the batch refused, naming the key"; exit 1; }
echo "PASS: tensor parallelism matches one process"
