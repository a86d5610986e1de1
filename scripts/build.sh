#!/usr/bin/env bash
# Configures and builds fp8train in ./build (Release). Extra arguments go to CMake's configure
# step, e.g. -DFP8TRAIN_CUDA=OFF or -DFP8TRAIN_CUDA_ARCHITECTURES=90a.
set -euo pipefail
cd "$(dirname "$0")/.."
# nvcc is often installed outside PATH.
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build build --parallel "$(nproc)"
