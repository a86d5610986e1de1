#!/usr/bin/env bash
# Builds the CUDA binaries (Release, sm_90a by default) and gathers them with the
# non-system shared libraries they load into one folder, for a GPU machine that has a
# driver but none of the build dependencies. Usage: scripts/gpu_bundle.sh [DEST] [cmake args]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.gpu}
shift || true
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
# Without MPI: the bundle would have to carry OpenMPI's libraries and plugins; ranks started by
# --nproc-per-node meet over TCP and the GPUs talk through NCCL (the host's libnccl).
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP8TRAIN_CUDA=ON -DFP8TRAIN_MPI=OFF "$@"
cmake --build build-gpu --parallel "$(nproc)"
rm -rf "$dest" && mkdir -p "$dest/lib"
binaries=(build-gpu/src/fp8train build-gpu/tests/fp8train_tests build-gpu/tests/fp8train_gpu_tests
          build-gpu/bench/quantize_bench build-gpu/bench/gemm_bench)
cp "${binaries[@]}" "$dest/"
# Every library the binaries load except the host's own: glibc's, libstdc++ and libgcc_s (they
# go with the host's loader) and the CUDA driver and toolkit libraries (matched to its driver).
# The rest comes along: Debian's C++ libraries, and libcurl with its TLS, compression and
# authentication libraries, a list that depends on how Debian builds libcurl and that a list of
# names here would miss as it changes.
host_libs='/(libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libanl|libstdc\+\+|libgcc_s'
host_libs+='|libcuda|libcudart|libcublas|libcublasLt|libcudnn[a-z_]*|libnvrtc[a-z-]*|libnvJitLink|libnccl)\.so'
ldd "${binaries[@]}" | awk '/=> \// {print $3}' | sort -u | grep -Ev "$host_libs" |
  xargs -r -I{} cp -L {} "$dest/lib/"
cp scripts/gpu_check.sh "$dest/"
cp -r tests/data "$dest/data"  # the golden files some GPU tests compare with
echo "gpu_bundle: $(du -sh "$dest" | cut -f1) in $dest"
