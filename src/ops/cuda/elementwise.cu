// Pointwise kernels: relu^2, the residual mix and the fp32 -> bf16 cast, forward and backward,
// each an op of the grid-stride pointwise kernel (pointwise.cuh).

#include "core/cuda_check.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/cuda/pointwise.cuh"

namespace fp8t::ops::cuda {
namespace {

using device::all_aligned;
using device::check_pointwise_args;
using device::kBf16Vector;
using device::kPointwiseThreads;
using device::launch_pointwise;
using device::launch_pointwise_partials;
using device::PlainOp;

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

struct CastToBf16 : PlainOp {
  bf16* out;
  const float* inp;

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float x[kWidth];
    if constexpr (kWidth == kBf16Vector) {
      device::load_f32x8(inp + i, x);
    } else {
      x[0] = inp[i];
    }
    device::store_bf16(out + i, x);
  }
};

struct AddForward : PlainOp {
  bf16* out;
  const bf16* a;  // either may be out
  const bf16* b;

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float av[kWidth], bv[kWidth];
    device::load_bf16(a + i, av);
    device::load_bf16(b + i, bv);
#pragma unroll
    for (int k = 0; k < kWidth; ++k)
      av[k] += bv[k];
    device::store_bf16(out + i, av);
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
    const float block_x = device::block_sum<kPointwiseThreads>(sum_dout_x);
    const float block_x0 = device::block_sum<kPointwiseThreads>(sum_dout_x0);
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

void add_forward(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
  check_pointwise_args(n, {out, a, b});
  if (n == 0) return;
  AddForward op;
  op.out = out;
  op.a = a;
  op.b = b;
  launch_pointwise(op, n, all_aligned({out, a, b}), stream);
}

void cast_to_bf16(bf16* out, const float* inp, int64_t n, cudaStream_t stream) {
  check_pointwise_args(n, {out, inp});
  if (n == 0) return;
  CastToBf16 op;
  op.out = out;
  op.inp = inp;
  launch_pointwise(op, n, all_aligned({out, inp}), stream);
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
  const unsigned grid = launch_pointwise_partials(op, n, all_aligned({dx, dx0, dout, x, x0}),
                                                  kResidualMixMaxBlocks, stream);
  add_lambda_gradients_kernel<<<1, kFinishThreads, 0, stream>>>(workspace, static_cast<int>(grid),
                                                                dresid_lambda, dx0_lambda);
  FP8T_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8t::ops::cuda
