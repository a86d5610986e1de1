// Pointwise kernels: relu^2 and the residual mix, forward and backward. One grid-stride kernel
// runs every op: 16-byte vectors (8 bf16) while every pointer is 16-byte aligned, then single
// elements for the tail (or for everything, unaligned). An op is a small struct copied into
// each thread, whose begin()/end() load its scalars and publish its per-thread sums.
#include <algorithm>
#include <initializer_list>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::ops::cuda {
namespace {

using device::kBf16Vector;

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

template <typename Op>
__global__ void __launch_bounds__(kThreads) pointwise_kernel(Op op, int64_t n, bool vectorized) {
  Op local = op;
  local.begin();
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
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

struct Relu2Forward : PlainOp {
  bf16* out;
  const bf16* inp;  // may be out

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float x[kWidth];
    device::load_bf16(inp + i, x);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      const float r = fmaxf(x[k], 0.0f);  // NaN -> 0, as the CPU's x > 0 ? x : 0
      x[k] = r * r;
    }
    device::store_bf16(out + i, x);
  }
};

struct Relu2Backward : PlainOp {
  bf16* dinp;
  const bf16* dout;
  const bf16* inp;
  bool add;

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float x[kWidth], dy[kWidth], dx[kWidth] = {};
    device::load_bf16(inp + i, x);
    device::load_bf16(dout + i, dy);
    if (add) device::load_bf16(dinp + i, dx);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      const float g = x[k] > 0.0f ? 2.0f * x[k] * dy[k] : 0.0f;
      dx[k] = add ? dx[k] + g : g;
    }
    device::store_bf16(dinp + i, dx);
  }
};

struct ResidualMixForward {
  bf16* out;
  const bf16* x;  // may be out
  const bf16* x0;
  const float* resid_lambda;
  const float* x0_lambda;
  float a, b;

  __device__ void begin() {
    a = *resid_lambda;
    b = *x0_lambda;
  }
  __device__ void end() {}

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float xv[kWidth], x0v[kWidth];
    device::load_bf16(x + i, xv);
    device::load_bf16(x0 + i, x0v);
#pragma unroll
    for (int k = 0; k < kWidth; ++k)
      xv[k] = fmaf(a, xv[k], b * x0v[k]);
    device::store_bf16(out + i, xv);
  }
};

struct ResidualMixBackward {
  bf16* dx;
  bf16* dx0;
  float* block_partials;  // [gridDim.x][2]
  const bf16* dout;
  const bf16* x;
  const bf16* x0;
  const float* resid_lambda;
  const float* x0_lambda;
  bool add_dx, add_dx0;
  float a, b;
  float sum_dout_x, sum_dout_x0;

  __device__ void begin() {
    a = *resid_lambda;
    b = *x0_lambda;
    sum_dout_x = 0.0f;
    sum_dout_x0 = 0.0f;
  }

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float dy[kWidth], xv[kWidth], x0v[kWidth], dxv[kWidth] = {}, dx0v[kWidth] = {};
    device::load_bf16(dout + i, dy);
    device::load_bf16(x + i, xv);
    device::load_bf16(x0 + i, x0v);
    if (add_dx) device::load_bf16(dx + i, dxv);
    if (add_dx0) device::load_bf16(dx0 + i, dx0v);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      dxv[k] = add_dx ? fmaf(a, dy[k], dxv[k]) : a * dy[k];
      dx0v[k] = add_dx0 ? fmaf(b, dy[k], dx0v[k]) : b * dy[k];
      sum_dout_x = fmaf(dy[k], xv[k], sum_dout_x);
      sum_dout_x0 = fmaf(dy[k], x0v[k], sum_dout_x0);
    }
    device::store_bf16(dx + i, dxv);
    device::store_bf16(dx0 + i, dx0v);
  }

  __device__ void end() {
    const float block_x = device::block_sum<kThreads>(sum_dout_x);
    const float block_x0 = device::block_sum<kThreads>(sum_dout_x0);
    if (threadIdx.x == 0) {
      block_partials[2 * blockIdx.x] = block_x;
      block_partials[2 * blockIdx.x + 1] = block_x0;
    }
  }
};

// Adds the blocks' partial sums, in block order and in double, to the lambda gradients.
constexpr int kFinishThreads = 256;
__global__ void __launch_bounds__(kFinishThreads)
    add_lambda_gradients_kernel(const float* block_partials, int blocks, float* dresid_lambda,
                                float* dx0_lambda) {
  double sum_x = 0.0;
  double sum_x0 = 0.0;
  for (int i = threadIdx.x; i < blocks; i += kFinishThreads) {
    sum_x += block_partials[2 * i];
    sum_x0 += block_partials[2 * i + 1];
  }
  sum_x = device::block_sum<kFinishThreads>(sum_x);
  sum_x0 = device::block_sum<kFinishThreads>(sum_x0);
  if (threadIdx.x == 0) {
    *dresid_lambda += static_cast<float>(sum_x);
    *dx0_lambda += static_cast<float>(sum_x0);
  }
}

bool all_aligned(std::initializer_list<const void*> pointers) {
  for (const void* pointer : pointers)
    if (!device::aligned16(pointer)) return false;
  return true;
}

unsigned pointwise_grid(int64_t n, bool vectorized) {
  const int64_t items = vectorized ? (n + kBf16Vector - 1) / kBf16Vector : n;
  return device::grid_size((items + kThreads - 1) / kThreads, kBlocksPerSm);
}

template <typename Op>
void launch_pointwise(const Op& op, int64_t n, bool vectorized, cudaStream_t stream) {
  pointwise_kernel<<<pointwise_grid(n, vectorized), kThreads, 0, stream>>>(op, n, vectorized);
  FP8T_CUDA_CHECK_LAUNCH();
}

void check_pointwise_args(int64_t n, std::initializer_list<const void*> pointers) {
  FP8T_CHECK(n >= 0, "expected n >= 0, found {}", n);
  for (const void* pointer : pointers)
    FP8T_CHECK(n == 0 || pointer != nullptr, "null device pointer for {} elements", n);
}

}  // namespace

void relu2_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream) {
  check_pointwise_args(n, {out, inp});
  if (n == 0) return;
  Relu2Forward op;
  op.out = out;
  op.inp = inp;
  launch_pointwise(op, n, all_aligned({out, inp}), stream);
}

void relu2_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t n, GradStore store,
                    cudaStream_t stream) {
  check_pointwise_args(n, {dinp, dout, inp});
  if (n == 0) return;
  Relu2Backward op;
  op.dinp = dinp;
  op.dout = dout;
  op.inp = inp;
  op.add = store == GradStore::Add;
  launch_pointwise(op, n, all_aligned({dinp, dout, inp}), stream);
}

void residual_mix_forward(bf16* out, const bf16* x, const bf16* x0, const float* resid_lambda,
                          const float* x0_lambda, int64_t n, cudaStream_t stream) {
  check_pointwise_args(n, {out, x, x0, resid_lambda, x0_lambda});
  if (n == 0) return;
  ResidualMixForward op{};
  op.out = out;
  op.x = x;
  op.x0 = x0;
  op.resid_lambda = resid_lambda;
  op.x0_lambda = x0_lambda;
  launch_pointwise(op, n, all_aligned({out, x, x0}), stream);
}

void residual_mix_backward(bf16* dx, bf16* dx0, float* dresid_lambda, float* dx0_lambda,
                           const bf16* dout, const bf16* x, const bf16* x0,
                           const float* resid_lambda, const float* x0_lambda, int64_t n,
                           GradStore dx_store, GradStore dx0_store, float* workspace,
                           cudaStream_t stream) {
  check_pointwise_args(
      n, {dx, dx0, dresid_lambda, dx0_lambda, dout, x, x0, resid_lambda, x0_lambda, workspace});
  if (n == 0) return;
  ResidualMixBackward op{};
  op.dx = dx;
  op.dx0 = dx0;
  op.block_partials = workspace;
  op.dout = dout;
  op.x = x;
  op.x0 = x0;
  op.resid_lambda = resid_lambda;
  op.x0_lambda = x0_lambda;
  op.add_dx = dx_store == GradStore::Add;
  op.add_dx0 = dx0_store == GradStore::Add;
  const bool vectorized = all_aligned({dx, dx0, dout, x, x0});
  // The grid depends only on n and the GPU, so the order of the sums does too.
  const unsigned grid =
      std::min(pointwise_grid(n, vectorized), static_cast<unsigned>(kResidualMixMaxBlocks));
  pointwise_kernel<<<grid, kThreads, 0, stream>>>(op, n, vectorized);
  FP8T_CUDA_CHECK_LAUNCH();
  add_lambda_gradients_kernel<<<1, kFinishThreads, 0, stream>>>(workspace, static_cast<int>(grid),
                                                                dresid_lambda, dx0_lambda);
  FP8T_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8t::ops::cuda
