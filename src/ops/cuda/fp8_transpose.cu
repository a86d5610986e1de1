// Transposes of FP8 weights already cast (ops/fp8_linear_layout.h, WeightTransposes::InBackward):
// the bytes, and blockwise's padded 128x128 scale grids.
#include "core/cuda_check.h"
#include "core/error.h"
#include "numerics/scaling.h"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::ops::cuda {
namespace {

// A block moves a tile of 64x64 bytes through shared memory, each thread 4 bytes per access, so
// that reads and writes both go along rows. Rows of the shared tile are padded by 4 bytes: the
// 16 words a half-warp reads down a column then fall in different banks.
constexpr int kTile = 64;
constexpr int kWordsPerRow = kTile / 4;
constexpr int kTransposeThreads = 256;
constexpr int kRowsPerPass = kTransposeThreads / kWordsPerRow;

__global__ void __launch_bounds__(kTransposeThreads)
    transpose_bytes_kernel(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {
  __shared__ uint8_t tile[kTile][kTile + 4];
  const int64_t row0 = int64_t(blockIdx.y) * kTile, col0 = int64_t(blockIdx.x) * kTile;
  const int word = static_cast<int>(threadIdx.x) % kWordsPerRow;
  const int first = static_cast<int>(threadIdx.x) / kWordsPerRow;
  for (int r = first; r < kTile; r += kRowsPerPass) {
    const int64_t row = row0 + r, col = col0 + 4 * word;
    uint32_t bytes = 0;
    if (row < rows && col < cols) bytes = *reinterpret_cast<const uint32_t*>(in + row * cols + col);
    *reinterpret_cast<uint32_t*>(&tile[r][4 * word]) = bytes;
  }
  __syncthreads();
  // Output row c is input column c; its word covers input rows 4·word .. 4·word + 3.
  for (int c = first; c < kTile; c += kRowsPerPass) {
    const int64_t out_row = col0 + c, out_col = row0 + 4 * word;
    if (out_row >= cols || out_col >= rows) continue;
    const int r = 4 * word;
    const uint32_t bytes = uint32_t(tile[r][c]) | uint32_t(tile[r + 1][c]) << 8 |
                           uint32_t(tile[r + 2][c]) << 16 | uint32_t(tile[r + 3][c]) << 24;
    *reinterpret_cast<uint32_t*>(out + out_row * rows + out_col) = bytes;
  }
}

constexpr int kGridThreads = 256;

__global__ void __launch_bounds__(kGridThreads)
    transpose_grid_kernel(float* out, const float* padded, int64_t grid_rows, int64_t grid_cols,
                          int64_t in_ld, int64_t out_ld) {
  const int64_t total = grid_cols * out_ld;
  for (int64_t i = int64_t(blockIdx.x) * kGridThreads + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * kGridThreads) {
    const int64_t r = i / out_ld, c = i % out_ld;
    out[i] = c < grid_rows ? padded[c * in_ld + r] : 0.0f;
  }
}

}  // namespace

void transpose_fp8(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                   cudaStream_t stream) {
  FP8T_CHECK(rows > 0 && cols > 0 && rows % 4 == 0 && cols % 4 == 0,
             "an FP8 transpose takes rows and columns that are multiples of 4, found [{}, {}]",
             rows, cols);
  FP8T_CHECK(in != nullptr && out != nullptr && reinterpret_cast<uintptr_t>(in) % 4 == 0 &&
                 reinterpret_cast<uintptr_t>(out) % 4 == 0,
             "an FP8 transpose takes 4-byte aligned buffers");
  const dim3 blocks(static_cast<unsigned>((cols + kTile - 1) / kTile),
                    static_cast<unsigned>((rows + kTile - 1) / kTile));
  FP8T_CHECK(blocks.y <= 65535u, "an FP8 transpose of {} rows exceeds the grid", rows);
  transpose_bytes_kernel<<<blocks, kTransposeThreads, 0, stream>>>(in, rows, cols, out);
  FP8T_CUDA_CHECK_LAUNCH();
}

void transpose_tile_scale_grid(float* out, const float* padded, int64_t grid_rows,
                               int64_t grid_cols, cudaStream_t stream) {
  FP8T_CHECK(grid_rows > 0 && grid_cols > 0 && out != nullptr && padded != nullptr,
             "expected a non-empty scale grid, found [{}, {}]", grid_rows, grid_cols);
  const int64_t out_ld = padded_tile_scale_row(grid_rows);
  const int64_t blocks = (grid_cols * out_ld + kGridThreads - 1) / kGridThreads;
  transpose_grid_kernel<<<device::grid_size(blocks, 4), kGridThreads, 0, stream>>>(
      out, padded, grid_rows, grid_cols, padded_tile_scale_row(grid_cols), out_ld);
  FP8T_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8t::ops::cuda
