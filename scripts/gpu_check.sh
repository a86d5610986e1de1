#!/usr/bin/env bash
# Runs on a GPU machine, from a folder made by gpu_bundle.sh: the device report, the GPU tests
# (and the CPU tests), the numerics self-check and the quantization benchmark; the benchmark
# table comes last. Usage: gpu_check.sh [benchmark args]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
"$here/fp8train" doctor || status=1
"$here/fp8train_tests" --gtest_brief=1 || status=1
"$here/fp8train_gpu_tests" --gtest_brief=1 || status=1
"$here/fp8train" check-numerics || status=1
"$here/quantize_bench" "$@" || status=1
echo "gpu_check: $([[ $status == 0 ]] && echo all passed || echo FAILURES above)"
exit $status
