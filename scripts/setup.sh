#!/usr/bin/env bash
# Installs what fp8train needs to build and test, skipping what is already there.
# Safe to run again. Needs root or sudo for the Debian packages.
set -euo pipefail

packages=(
  build-essential cmake ninja-build clang-format
  libfmt-dev libyaml-cpp-dev libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev
  libopenblas-dev libpcre2-dev libpng-dev zlib1g-dev pkg-config
  libcurl4-openssl-dev  # HTTP(S) to MLflow tracking servers
  libopenmpi-dev openmpi-bin  # several processes: MPI collectives and mpirun
  clang-19 libclang-rt-19-dev  # scripts/fuzz.sh: libFuzzer and the sanitizers' runtimes
  fortunes  # the English text the default training job learns from
)
# Python runs the checkpoint-compatibility tests; any python3 with pip will do.
if ! command -v python3 >/dev/null; then packages+=(python3 python3-pip); fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if ((${#missing[@]} > 0)); then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    sudo_cmd=(sudo)
  fi
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The checkpoint tests read our safetensors files with the reference Python package, the
# event-file test reads TensorBoard scalars with TensorBoard's own reader, and the MLflow test
# runs a tracking server and reads runs back with MLflow's client.
if ! python3 -c "import safetensors.numpy, tensorboard, mlflow" 2>/dev/null; then
  echo "setup: installing the Python packages safetensors, numpy, tensorboard and mlflow"
  python3 -m pip install --quiet safetensors numpy tensorboard mlflow ||
    python3 -m pip install --quiet --break-system-packages safetensors numpy tensorboard mlflow
fi

# The cuDNN frontend's headers (attention on the GPU) come from its Python package.
if ! python3 -c "import cudnn" 2>/dev/null; then
  echo "setup: installing the Python package nvidia-cudnn-frontend (cuDNN frontend headers)"
  python3 -m pip install --quiet nvidia-cudnn-frontend ||
    python3 -m pip install --quiet --break-system-packages nvidia-cudnn-frontend
fi

if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: CUDA toolkit found: the CUDA path will be built"
else
  echo "setup: no CUDA toolkit (nvcc): building the CPU path only"
fi
