#!/usr/bin/env bash
# Runs on a GPU machine, from a folder made by gpu_bundle.sh: the device report, the GPU tests
# (and the CPU tests), the numerics self-check, the quantization benchmark and the GPT training
# benchmark (W-GPT24, BF16 and FP8); its table comes last. Usage: gpu_check.sh [bench gpt args]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# cuBLASLt (and cuDNN) from the CUDA toolkit or the Python environment's nvidia packages.
nvidia_libs=$(python3 -c "import glob, os, nvidia; print(':'.join(d for p in nvidia.__path__ for d in glob.glob(os.path.join(p, '*', 'lib'))))" 2>/dev/null || true)
export FP8T_TEST_DATA="$here/data"
export LD_LIBRARY_PATH="$here/lib:/usr/local/cuda/lib64${nvidia_libs:+:$nvidia_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
status=0
"$here/fp8train" doctor || status=1
"$here/fp8train_tests" --gtest_brief=1 || status=1
"$here/fp8train_gpu_tests" --gtest_brief=1 || status=1
"$here/fp8train" check-numerics || status=1
"$here/quantize_bench" || status=1
"$here/fp8train" bench gpt "$@" || status=1
echo "gpu_check: $([[ $status == 0 ]] && echo all passed || echo FAILURES above)"
exit $status
