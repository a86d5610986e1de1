// 128x128 block-scale grids from quantize_blocks()' row-major layout to the one cuBLASLt's
// block-scaled GEMMs read (gemm/cublaslt_gemm.h, ScaleMode::Block128x128).
#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::ops::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    padded_grid_kernel(float* out, const float* grid, int64_t grid_rows, int64_t grid_cols,
                       int64_t out_cols) {
  const int64_t total = grid_rows * out_cols;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t r = i / out_cols, c = i % out_cols;
    out[i] = c < grid_cols ? grid[r * grid_cols + c] : 0.0f;
  }
}

}  // namespace

void pad_tile_scale_grid(float* out, const float* grid, int64_t grid_rows, int64_t grid_cols,
                         cudaStream_t stream) {
  FP8T_CHECK(grid_rows > 0 && grid_cols > 0 && out != nullptr && grid != nullptr,
             "expected a non-empty scale grid, found [{}, {}]", grid_rows, grid_cols);
  const int64_t out_cols = (grid_cols + 3) / 4 * 4;
  const int64_t blocks = (grid_rows * out_cols + kThreads - 1) / kThreads;
  padded_grid_kernel<<<device::grid_size(blocks, 4), kThreads, 0, stream>>>(out, grid, grid_rows,
                                                                            grid_cols, out_cols);
  FP8T_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8t::ops::cuda
