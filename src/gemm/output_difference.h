// How far one GEMM output lies from another, on the GPU: what autotuning checks each candidate
// algorithm's result with before it may win (CUDA builds only).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "gemm/cublaslt_gemm.h"

namespace fp8t::gemm {

// A GEMM output as cuBLASLt writes it: `batch` column-major matrices [rows, cols] (rows
// contiguous) with leading dimension ld, `stride` elements apart.
struct OutputView {
  GemmType type = GemmType::F32;
  int64_t rows = 0, cols = 0, ld = 0;
  int64_t batch = 1, stride = 0;
};

// ‖out − ref‖/‖ref‖ over the view's elements (FP8 codes decoded), in double; NaN when either
// holds a non-finite value. Runs on `stream` and waits for the result.
double relative_difference(const OutputView& view, const void* out, const void* ref,
                           cudaStream_t stream);

}  // namespace fp8t::gemm
