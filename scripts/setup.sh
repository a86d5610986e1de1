#!/usr/bin/env bash
# Installs what fp8train needs to build and test, skipping what is already there.
# Safe to run again. Needs root or sudo for the Debian packages.
set -euo pipefail

packages=(
  build-essential cmake ninja-build clang-format
  libfmt-dev libyaml-cpp-dev libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev
  libopenblas-dev
)

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

if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: CUDA toolkit found: the CUDA path will be built"
else
  echo "setup: no CUDA toolkit (nvcc): building the CPU path only"
fi
