// The grid-stride pointwise kernel behind the small ops of elementwise.cu and gpt_gates.cu:
// 16-byte vectors (8 bf16, or 8 fp32 as two float4) while every pointer is 16-byte aligned, then
// single elements for the tail (or for everything, unaligned). An op is a small struct copied
// into each thread: apply<kWidth>(i) handles elements [i, i + kWidth) (kWidth 8 or 1), begin()
// and end() load its scalars and publish its per-thread sums. nvcc only: included by the .cu
// files of src/ops/cuda.
#pragma once

#include <algorithm>
#include <initializer_list>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::ops::cuda::device {

constexpr int kPointwiseThreads = 256;
constexpr int kPointwiseBlocksPerSm = 8;  // 2048 resident threads per SM

template <typename Op>
__global__ void __launch_bounds__(kPointwiseThreads)
    pointwise_kernel(Op op, int64_t n, bool vectorized) {
  Op local = op;
  local.begin();
  const int64_t stride = int64_t(gridDim.x) * kPointwiseThreads;
  const int64_t first = int64_t(blockIdx.x) * kPointwiseThreads + threadIdx.x;
  int64_t scalar_begin = 0;
  if (vectorized) {
    const int64_t vectors = n / kBf16Vector;
    for (int64_t v = first; v < vectors; v += stride)
      local.template apply<kBf16Vector>(v * kBf16Vector);
    scalar_begin = vectors * kBf16Vector;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride)
    local.template apply<1>(i);
  local.end();
}

// Ops without scalars to load or sums to publish.
struct PlainOp {
  __device__ void begin() {}
  __device__ void end() {}
};

// Blocks for n elements: one thread per vector (vectorized) or per element, up to
// kPointwiseBlocksPerSm blocks per SM.
inline unsigned pointwise_grid(int64_t n, bool vectorized) {
  const int64_t items = vectorized ? (n + kBf16Vector - 1) / kBf16Vector : n;
  return grid_size((items + kPointwiseThreads - 1) / kPointwiseThreads, kPointwiseBlocksPerSm);
}

template <typename Op>
void launch_pointwise(const Op& op, int64_t n, bool vectorized, cudaStream_t stream) {
  pointwise_kernel<<<pointwise_grid(n, vectorized), kPointwiseThreads, 0, stream>>>(op, n,
                                                                                    vectorized);
  FP8T_CUDA_CHECK_LAUNCH();
}

// For ops whose end() writes one partial sum per block into a workspace of max_blocks: runs op
// on at most max_blocks blocks and returns the grid. The grid depends only on n and the GPU, so
// the order in which the partials are added does too.
template <typename Op>
unsigned launch_pointwise_partials(const Op& op, int64_t n, bool vectorized, int64_t max_blocks,
                                   cudaStream_t stream) {
  const unsigned grid = std::min(pointwise_grid(n, vectorized), static_cast<unsigned>(max_blocks));
  pointwise_kernel<<<grid, kPointwiseThreads, 0, stream>>>(op, n, vectorized);
  FP8T_CUDA_CHECK_LAUNCH();
  return grid;
}

// n >= 0, and every pointer set unless n is 0.
inline void check_pointwise_args(int64_t n, std::initializer_list<const void*> pointers) {
  FP8T_CHECK(n >= 0, "expected n >= 0, found {}", n);
  check_pointers(n, pointers);
}

}  // namespace fp8t::ops::cuda::device
