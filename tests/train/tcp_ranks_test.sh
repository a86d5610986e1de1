#!/usr/bin/env bash
# Ranks that meet over TCP (torchrun-style variables, or train --nproc-per-node) fail with a clear
# message instead of hanging: a rank that never arrives, ranks started with different
# configurations, a rank killed in the middle of training (started by hand and by
# --nproc-per-node). Usage: tcp_ranks_test.sh FP8TRAIN OUTPUT_DIR
set -euo pipefail
fp8train="$1"
output="$2"
rm -rf "$output"
mkdir -p "$output"
args=(--depth=2 --vocab-size=4096 --sequence-len=64 --micro-batch-size=2 --global-batch-size=4
      --eval-every=0 --log-every=1 --sample-tokens=0 --device=cpu --output-dir="$output" --overwrite)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# fp8train train as rank R of 2: rank R ARGS..., in a subshell (`( rank ... )` or `rank ... &`),
# which it replaces: $! is fp8train's own process id.
rank() {
  local r="$1"
  shift
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    FP8TRAIN_RENDEZVOUS_TIMEOUT=5 exec "$fp8train" train "$@"
}
expect() {  # expect LOG PATTERN WHAT
  grep -q -E "$2" "$1" || { cat "$1"; echo "FAIL: $3: expected /$2/"; exit 1; }
}
wait_for_step_3() {  # wait_for_step_3 LOG WHAT: up to 60 s
  for _ in $(seq 600); do
    grep -q -E "^step +3/" "$1" && break
    sleep 0.1
  done
  expect "$1" "^step +3/" "$2"
}

# Rank 1 never comes: rank 0 gives up after FP8TRAIN_RENDEZVOUS_TIMEOUT, naming it.
if (rank 0 "${args[@]}" --train-iters=2 --run=alone) >"$output/alone.log" 2>&1; then
  cat "$output/alone.log"; echo "FAIL: rank 0 trained without rank 1"; exit 1
fi
expect "$output/alone.log" "error on rank 0 of 2 \\(torchrun, local rank 0\\): .*127.0.0.1:$port.*rank.* 1" \
  "a missing rank"

# Different configurations: both ranks stop, naming the difference.
rank 0 "${args[@]}" --train-iters=2 --run=differ >"$output/differ0.log" 2>&1 &
zero=$!
if (rank 1 "${args[@]}" --train-iters=3 --run=differ) >"$output/differ1.log" 2>&1; then
  cat "$output/differ1.log"; echo "FAIL: rank 1 ran with another configuration"; exit 1
fi
if wait $zero; then
  cat "$output/differ0.log"; echo "FAIL: rank 0 ran with another configuration"; exit 1
fi
expect "$output/differ1.log" "configuration differs from rank 0" "rank 1, different configurations"
expect "$output/differ0.log" "configuration differs from rank 0" "rank 0, different configurations"

# Rank 1 killed while training: rank 0 stops with an error within the timeout.
rank 0 "${args[@]}" --train-iters=100000 --run=killed >"$output/killed0.log" 2>&1 &
zero=$!
rank 1 "${args[@]}" --train-iters=100000 --run=killed >"$output/killed1.log" 2>&1 &
one=$!
wait_for_step_3 "$output/killed0.log" "training on 2 ranks"
kill -9 $one
if wait $zero; then
  cat "$output/killed0.log"; echo "FAIL: rank 0 went on without rank 1"; exit 1
fi
expect "$output/killed0.log" "error on rank 0 of 2 .*rank 1 closed its connection" "a killed rank"

# --nproc-per-node: a rank killed, the other stopped, the launcher's exit code not 0.
"$fp8train" train --nproc-per-node 2 "${args[@]}" --train-iters=100000 --run=spawned \
  >"$output/spawned.log" 2>&1 &
launcher=$!
wait_for_step_3 "$output/spawned.log" "training on 2 ranks started by --nproc-per-node"
ranks=$(pgrep -P $launcher)
[[ $(wc -w <<<"$ranks") -eq 2 ]] || { echo "FAIL: expected 2 ranks under the launcher: $ranks"; exit 1; }
kill -9 $(tail -n 1 <<<"$ranks")
status=0
timeout 60 tail --pid=$launcher -f /dev/null || { echo "FAIL: the launcher did not end"; exit 1; }
wait $launcher || status=$?
[[ $status -ne 0 ]] || { cat "$output/spawned.log"; echo "FAIL: the launcher exited 0"; exit 1; }
for pid in $ranks; do
  ! kill -0 "$pid" 2>/dev/null || { echo "FAIL: rank process $pid still runs"; exit 1; }
done
echo "PASS: missing, different and killed ranks stop the job with an error (launcher exit $status)"
