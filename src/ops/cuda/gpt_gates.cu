// The value-embedding gate, the smear, the backout, add and scale.
//
// Value gate: the forward gives a warp to each (token, kv head): the gate's dot product over
// gate_channels is a warp sum, then the warp updates the head's head_dim channels of v. The
// backward gives a warp to each token, since all of a token's heads add into the same channels
// of dx_norm. Smear: a warp per (batch, position) row, forward and backward.
//
// Parameter gradients: each warp accumulates its tokens' terms in its own row of shared memory,
// one lane per entry (no atomics, a fixed order); at the end the block adds its warps' rows in
// warp order into its partial in the workspace, and add_block_partials_kernel adds the blocks'
// partials in block order, in double.
//
// Backout, add and scale: ops of the grid-stride pointwise kernel (pointwise.cuh).
#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/gpt_gates.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/cuda/pointwise.cuh"
#include "ops/elementwise.h"

namespace fp8t::ops::cuda {
namespace {

using device::all_aligned;
using device::check_pointers;
using device::check_pointwise_args;
using device::kBf16Vector;
using device::kPointwiseThreads;
using device::kWarpSize;
using device::launch_pointwise;
using device::launch_pointwise_partials;
using device::load_bf16x8;
using device::PlainOp;
using device::store_bf16x8;
using device::to_bf16;
using device::to_f32;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kBlocksPerSm = 8;  // 2048 resident threads per SM

// The value gate's backward: smaller blocks, so that more of them share the workspace when
// kv_heads * gate_channels is large, and its shared memory stays within 32 KiB.
constexpr int kGateThreads = 128;
constexpr int kGateWarps = kGateThreads / kWarpSize;
constexpr int kGateBlocksPerSm = 16;

// The value gate is 3 sigmoid(z): range (0, 3), as the CPU op's.
constexpr float kValueGateRange = 3.0f;

__device__ inline float sigmoid(float z) {
  return 1.0f / (1.0f + expf(-z));
}

// x[:count] . w[:count], x bf16 and w fp32, summed over a warp: every lane gets the sum.
__device__ inline float warp_gate_dot(const bf16* x, const float* w, int64_t count) {
  const int lane = threadIdx.x % kWarpSize;
  float sum = 0.0f;
  for (int64_t c = lane; c < count; c += kWarpSize)
    sum = fmaf(to_f32(x[c]), w[c], sum);
  return device::group_sum(sum);
}

// --- Deterministic parameter gradients ---

// Zeroes the block's per-warp accumulator rows (count floats in all).
__device__ inline void zero_shared(float* rows, int count) {
  for (int i = threadIdx.x; i < count; i += blockDim.x)
    rows[i] = 0.0f;
  __syncthreads();
}

// Adds the block's warps' accumulator rows [warps][entries], in warp order, into the block's
// partial [entries] in block_partials [gridDim.x][entries]. Call from all threads.
__device__ inline void write_block_partial(const float* rows, int warps, int entries,
                                           float* block_partials) {
  __syncthreads();
  for (int e = threadIdx.x; e < entries; e += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < warps; ++w)
      sum += rows[w * entries + e];
    block_partials[int64_t(blockIdx.x) * entries + e] = sum;
  }
}

// Where the entries of a partial go: the first weight_count are added to weights[e], the one
// after them (if scalar is not null) to *scalar.
struct GradientTargets {
  float* weights;
  int weight_count;
  float* scalar;
};

// One block per entry: adds the entry's partials of all blocks, in a fixed order, in double.
constexpr int kFinishThreads = 256;
__global__ void __launch_bounds__(kFinishThreads)
    add_block_partials_kernel(const float* block_partials, int blocks, int entries,
                              GradientTargets targets) {
  const int e = blockIdx.x;
  double sum = 0.0;
  for (int b = threadIdx.x; b < blocks; b += kFinishThreads)
    sum += block_partials[int64_t(b) * entries + e];
  sum = device::block_sum<kFinishThreads>(sum);
  if (threadIdx.x == 0) {
    float* target = e < targets.weight_count ? targets.weights + e : targets.scalar;
    *target += static_cast<float>(sum);
  }
}

void add_block_partials(const float* block_partials, unsigned blocks, int entries,
                        GradientTargets targets, cudaStream_t stream) {
  add_block_partials_kernel<<<static_cast<unsigned>(entries), kFinishThreads, 0, stream>>>(
      block_partials, static_cast<int>(blocks), entries, targets);
  FP8T_CUDA_CHECK_LAUNCH();
}

// --- Value gate ---

// One warp per (token, kv head) item. The vector path needs head_dim % 8 == 0 and 16-byte
// aligned v and value_embed.
template <bool kVector>
__global__ void __launch_bounds__(kThreads)
    value_gate_forward_kernel(bf16* __restrict__ v, float* __restrict__ gate,
                              const bf16* __restrict__ x_norm, const bf16* __restrict__ value_embed,
                              const float* __restrict__ gate_weight, ValueGateShape shape) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t items = shape.tokens * shape.kv_heads;
  const int64_t item_stride = int64_t(gridDim.x) * kWarps;
  for (int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; item < items;
       item += item_stride) {
    const int64_t token = item / shape.kv_heads;
    const int64_t head = item - token * shape.kv_heads;
    const float z = warp_gate_dot(x_norm + token * shape.channels,
                                  gate_weight + head * shape.gate_channels, shape.gate_channels);
    const float g = kValueGateRange * sigmoid(z);
    if (lane == 0) gate[item] = g;
    // [tokens, kv_heads, head_dim]: the item's channels start at item * head_dim.
    bf16* v_head = v + item * shape.head_dim;
    const bf16* ve_head = value_embed + item * shape.head_dim;
    if constexpr (kVector) {
      for (int64_t i = lane * kBf16Vector; i < shape.head_dim; i += kWarpSize * kBf16Vector) {
        float vv[kBf16Vector], ve[kBf16Vector];
        load_bf16x8(v_head + i, vv);
        load_bf16x8(ve_head + i, ve);
#pragma unroll
        for (int k = 0; k < kBf16Vector; ++k)
          vv[k] = fmaf(g, ve[k], vv[k]);
        store_bf16x8(v_head + i, vv);
      }
    } else {
      for (int64_t i = lane; i < shape.head_dim; i += kWarpSize)
        v_head[i] = to_bf16(fmaf(g, to_f32(ve_head[i]), to_f32(v_head[i])));
    }
  }
}

// One warp per token, its kv heads in turn. Shared memory: the warps' dgate_weight
// accumulators [kGateWarps][kv_heads * gate_channels], then each warp's dz [kGateWarps][kv_heads].
template <bool kVector>
__global__ void __launch_bounds__(kGateThreads)
    value_gate_backward_kernel(bf16* __restrict__ dx_norm, float* __restrict__ block_partials,
                               bf16* __restrict__ dvalue_embed, const bf16* __restrict__ dv,
                               const bf16* __restrict__ x_norm,
                               const bf16* __restrict__ value_embed,
                               const float* __restrict__ gate_weight,
                               const float* __restrict__ gate, ValueGateShape shape) {
  extern __shared__ float shared[];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int heads = static_cast<int>(shape.kv_heads);
  const int gate_channels = static_cast<int>(shape.gate_channels);
  const int weights = heads * gate_channels;
  float* warp_dw = shared + warp * weights;
  float* warp_dz = shared + kGateWarps * weights + warp * heads;
  zero_shared(shared, kGateWarps * weights);

  const int64_t token_stride = int64_t(gridDim.x) * kGateWarps;
  for (int64_t token = int64_t(blockIdx.x) * kGateWarps + warp; token < shape.tokens;
       token += token_stride) {
    for (int h = 0; h < heads; ++h) {
      const int64_t item = token * heads + h;
      const float g = gate[item];
      const bf16* dv_head = dv + item * shape.head_dim;
      const bf16* ve_head = value_embed + item * shape.head_dim;
      bf16* dve_head = dvalue_embed + item * shape.head_dim;
      float dgate = 0.0f;
      if constexpr (kVector) {
        for (int64_t i = lane * kBf16Vector; i < shape.head_dim; i += kWarpSize * kBf16Vector) {
          float dy[kBf16Vector], ve[kBf16Vector];
          load_bf16x8(dv_head + i, dy);
          load_bf16x8(ve_head + i, ve);
#pragma unroll
          for (int k = 0; k < kBf16Vector; ++k) {
            dgate = fmaf(dy[k], ve[k], dgate);
            dy[k] *= g;
          }
          store_bf16x8(dve_head + i, dy);
        }
      } else {
        for (int64_t i = lane; i < shape.head_dim; i += kWarpSize) {
          const float dy = to_f32(dv_head[i]);
          dgate = fmaf(dy, to_f32(ve_head[i]), dgate);
          dve_head[i] = to_bf16(g * dy);
        }
      }
      dgate = device::group_sum(dgate);
      // g = 3 s with s = sigmoid(z): dg/dz = 3 s (1 - s) = g (1 - g / 3).
      if (lane == 0) warp_dz[h] = dgate * g * (1.0f - g / kValueGateRange);
    }
    __syncwarp();
    const bf16* x_row = x_norm + token * shape.channels;
    for (int e = lane; e < weights; e += kWarpSize) {
      const int h = e / gate_channels;
      warp_dw[e] = fmaf(warp_dz[h], to_f32(x_row[e - h * gate_channels]), warp_dw[e]);
    }
    bf16* dx_row = dx_norm + token * shape.channels;
    for (int c = lane; c < gate_channels; c += kWarpSize) {
      float sum = 0.0f;
      for (int h = 0; h < heads; ++h)
        sum = fmaf(warp_dz[h], gate_weight[h * gate_channels + c], sum);
      dx_row[c] = to_bf16(to_f32(dx_row[c]) + sum);
    }
    __syncwarp();  // warp_dz is rewritten for the next token
  }
  write_block_partial(shared, kGateWarps, weights, block_partials);
}

// --- Smear ---

// One warp per (batch, position) row. The vector path needs channels % 8 == 0 and 16-byte
// aligned out and inp.
template <bool kVector>
__global__ void __launch_bounds__(kThreads)
    smear_forward_kernel(bf16* __restrict__ out, float* __restrict__ gate,
                         const bf16* __restrict__ inp, const float* __restrict__ gate_weight,
                         const float* __restrict__ smear_lambda, SmearShape shape) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t rows = shape.batch * shape.seq_len;
  const int64_t channels = shape.channels;
  const float lambda = *smear_lambda;
  const int64_t row_stride = int64_t(gridDim.x) * kWarps;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; row < rows;
       row += row_stride) {
    const bf16* x = inp + row * channels;
    bf16* y = out + row * channels;
    const bool first = row % shape.seq_len == 0;
    // The first position has no previous token: mix 0 copies it.
    const float g = first ? 0.0f : sigmoid(warp_gate_dot(x, gate_weight, shape.gate_channels));
    if (lane == 0) gate[row] = g;
    const float mix = lambda * g;
    const bf16* x_prev = first ? x : x - channels;
    if constexpr (kVector) {
      for (int64_t i = lane * kBf16Vector; i < channels; i += kWarpSize * kBf16Vector) {
        float xv[kBf16Vector], prev[kBf16Vector];
        load_bf16x8(x + i, xv);
        load_bf16x8(x_prev + i, prev);
#pragma unroll
        for (int k = 0; k < kBf16Vector; ++k)
          xv[k] = first ? xv[k] : fmaf(mix, prev[k], xv[k]);
        store_bf16x8(y + i, xv);
      }
    } else {
      for (int64_t i = lane; i < channels; i += kWarpSize)
        y[i] = first ? x[i] : to_bf16(fmaf(mix, to_f32(x_prev[i]), to_f32(x[i])));
    }
  }
}

// dinp[t] = dout[t] + lambda g[t + 1] dout[t + 1] (t + 1 < seq_len)
//         + dz[t] gate_weight (first gate_channels channels, t >= 1),
// dz[t] = lambda (dout[t] . inp[t - 1]) g[t] (1 - g[t]); dgate_weight += dz[t] inp[t, :gc],
// dsmear_lambda += g[t] (dout[t] . inp[t - 1]). One warp per row. Shared memory: the warps'
// accumulators [kWarps][gate_channels + 1], dsmear_lambda's last. The vector path needs
// channels % 8 == 0 and 16-byte aligned dinp, dout and inp.
template <bool kVector>
__global__ void __launch_bounds__(kThreads)
    smear_backward_kernel(bf16* __restrict__ dinp, float* __restrict__ block_partials,
                          const bf16* __restrict__ dout, const bf16* __restrict__ inp,
                          const float* __restrict__ gate, const float* __restrict__ gate_weight,
                          const float* __restrict__ smear_lambda, SmearShape shape, bool add) {
  extern __shared__ float shared[];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int gate_channels = static_cast<int>(shape.gate_channels);
  const int entries = gate_channels + 1;
  float* warp_sums = shared + warp * entries;
  zero_shared(shared, kWarps * entries);

  const int64_t rows = shape.batch * shape.seq_len;
  const int64_t channels = shape.channels;
  const float lambda = *smear_lambda;
  const int64_t row_stride = int64_t(gridDim.x) * kWarps;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + warp; row < rows; row += row_stride) {
    const int64_t t = row % shape.seq_len;
    const bf16* dy = dout + row * channels;
    const bf16* x = inp + row * channels;
    bf16* dx = dinp + row * channels;
    float dz = 0.0f;
    if (t >= 1) {  // the same branch for the whole warp
      const bf16* x_prev = x - channels;
      const float dy_dot_prev = device::warp_dot<kVector>(dy, x_prev, channels);
      const float g = gate[row];
      // d(sigmoid)/dz = s (1 - s).
      dz = lambda * dy_dot_prev * g * (1.0f - g);
      for (int c = lane; c < gate_channels; c += kWarpSize)
        warp_sums[c] = fmaf(dz, to_f32(x[c]), warp_sums[c]);
      if (lane == gate_channels % kWarpSize)
        warp_sums[gate_channels] = fmaf(g, dy_dot_prev, warp_sums[gate_channels]);
    }
    // The next position's smear of this row.
    const bool has_next = t + 1 < shape.seq_len;
    const float mix_next = has_next ? lambda * gate[row + 1] : 0.0f;
    const bf16* dy_next = has_next ? dy + channels : dy;
    if constexpr (kVector) {
      for (int64_t i = lane * kBf16Vector; i < channels; i += kWarpSize * kBf16Vector) {
        float dyv[kBf16Vector], next[kBf16Vector], dxv[kBf16Vector] = {};
        load_bf16x8(dy + i, dyv);
        load_bf16x8(dy_next + i, next);
        if (add) load_bf16x8(dx + i, dxv);
#pragma unroll
        for (int k = 0; k < kBf16Vector; ++k) {
          float value = fmaf(mix_next, next[k], dyv[k]);
          if (i + k < gate_channels) value = fmaf(dz, gate_weight[i + k], value);
          dxv[k] = add ? dxv[k] + value : value;
        }
        store_bf16x8(dx + i, dxv);
      }
    } else {
      for (int64_t i = lane; i < channels; i += kWarpSize) {
        float value = fmaf(mix_next, to_f32(dy_next[i]), to_f32(dy[i]));
        if (i < gate_channels) value = fmaf(dz, gate_weight[i], value);
        dx[i] = to_bf16(add ? to_f32(dx[i]) + value : value);
      }
    }
  }
  write_block_partial(shared, kWarps, entries, block_partials);
}

bool overlap(const void* a, const void* b, int64_t bytes) {
  const auto first = reinterpret_cast<uintptr_t>(a);
  const auto second = reinterpret_cast<uintptr_t>(b);
  const auto size = static_cast<uintptr_t>(bytes);
  return first < second + size && second < first + size;
}

// --- Pointwise ops ---

struct BackoutForward {
  bf16* out;
  const bf16* x;  // may be out
  const bf16* x_backout;
  const float* backout_lambda;
  float lambda;

  __device__ void begin() { lambda = *backout_lambda; }
  __device__ void end() {}

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float xv[kWidth], xb[kWidth];
    device::load_bf16(x + i, xv);
    device::load_bf16(x_backout + i, xb);
#pragma unroll
    for (int k = 0; k < kWidth; ++k)
      xv[k] = fmaf(-lambda, xb[k], xv[k]);
    device::store_bf16(out + i, xv);
  }
};

struct BackoutBackward {
  bf16* dx;
  bf16* dx_backout;
  float* block_partials;  // [gridDim.x]
  const bf16* dout;
  const bf16* x_backout;
  const float* backout_lambda;
  bool add_dx, add_dx_backout;
  float lambda;
  float sum;  // of -dout * x_backout

  __device__ void begin() {
    lambda = *backout_lambda;
    sum = 0.0f;
  }

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float dy[kWidth], xb[kWidth], dxv[kWidth] = {}, dxbv[kWidth] = {};
    device::load_bf16(dout + i, dy);
    device::load_bf16(x_backout + i, xb);
    if (add_dx) device::load_bf16(dx + i, dxv);
    if (add_dx_backout) device::load_bf16(dx_backout + i, dxbv);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      dxv[k] = add_dx ? dxv[k] + dy[k] : dy[k];
      dxbv[k] = add_dx_backout ? fmaf(-lambda, dy[k], dxbv[k]) : -lambda * dy[k];
      sum = fmaf(-dy[k], xb[k], sum);
    }
    device::store_bf16(dx + i, dxv);
    device::store_bf16(dx_backout + i, dxbv);
  }

  __device__ void end() {
    const float block = device::block_sum<kPointwiseThreads>(sum);
    if (threadIdx.x == 0) block_partials[blockIdx.x] = block;
  }
};

struct ScaleF32 : PlainOp {
  float* x;
  float factor;

  template <int kWidth>
  __device__ void apply(int64_t i) {
    if constexpr (kWidth == kBf16Vector) {
      float v[kBf16Vector];
      device::load_f32x8(x + i, v);
      auto* destination = reinterpret_cast<float4*>(x + i);
      destination[0] = make_float4(v[0] * factor, v[1] * factor, v[2] * factor, v[3] * factor);
      destination[1] = make_float4(v[4] * factor, v[5] * factor, v[6] * factor, v[7] * factor);
    } else {
      x[i] *= factor;
    }
  }
};

unsigned warp_per_item_grid(int64_t items) {
  return device::grid_size((items + kWarps - 1) / kWarps, kBlocksPerSm);
}

}  // namespace

void value_gate_forward(bf16* v, float* gate, const bf16* x_norm, const bf16* value_embed,
                        const float* gate_weight, const ValueGateShape& shape,
                        cudaStream_t stream) {
  ops::check_value_gate_shape(shape);
  check_pointers(shape.tokens, {v, gate, x_norm, value_embed, gate_weight});
  if (shape.tokens == 0) return;
  const unsigned grid = warp_per_item_grid(shape.tokens * shape.kv_heads);
  const auto kernel = shape.head_dim % kBf16Vector == 0 && all_aligned({v, value_embed})
                          ? value_gate_forward_kernel<true>
                          : value_gate_forward_kernel<false>;
  kernel<<<grid, kThreads, 0, stream>>>(v, gate, x_norm, value_embed, gate_weight, shape);
  FP8T_CUDA_CHECK_LAUNCH();
}

void value_gate_backward(bf16* dx_norm, float* dgate_weight, bf16* dvalue_embed, const bf16* dv,
                         const bf16* x_norm, const bf16* value_embed, const float* gate_weight,
                         const float* gate, const ValueGateShape& shape, float* workspace,
                         cudaStream_t stream) {
  ops::check_value_gate_shape(shape);
  FP8T_CHECK(shape.kv_heads * shape.gate_channels <= kValueGateMaxWeights,
             "expected kv_heads * gate_channels <= {}, found {} * {}", kValueGateMaxWeights,
             shape.kv_heads, shape.gate_channels);
  check_pointers(shape.tokens, {dx_norm, dgate_weight, dvalue_embed, dv, x_norm, value_embed,
                                gate_weight, gate, workspace});
  if (shape.tokens == 0) return;
  const int weights = static_cast<int>(shape.kv_heads * shape.gate_channels);
  // The grid depends only on the shape and the GPU, so the order of the sums does too.
  const unsigned grid =
      std::min(device::grid_size((shape.tokens + kGateWarps - 1) / kGateWarps, kGateBlocksPerSm),
               static_cast<unsigned>(kValueGateWorkspaceFloats / weights));
  const size_t shared_bytes = sizeof(float) * kGateWarps * size_t(weights + shape.kv_heads);
  const auto kernel =
      shape.head_dim % kBf16Vector == 0 && all_aligned({dv, value_embed, dvalue_embed})
          ? value_gate_backward_kernel<true>
          : value_gate_backward_kernel<false>;
  kernel<<<grid, kGateThreads, shared_bytes, stream>>>(dx_norm, workspace, dvalue_embed, dv, x_norm,
                                                       value_embed, gate_weight, gate, shape);
  FP8T_CUDA_CHECK_LAUNCH();
  add_block_partials(workspace, grid, weights, {dgate_weight, weights, nullptr}, stream);
}

void smear_forward(bf16* out, float* gate, const bf16* inp, const float* gate_weight,
                   const float* smear_lambda, const SmearShape& shape, cudaStream_t stream) {
  ops::check_smear_shape(shape);
  const int64_t rows = shape.batch * shape.seq_len;
  check_pointers(rows, {out, gate, inp, gate_weight, smear_lambda});
  const int64_t bytes = rows * shape.channels * int64_t{sizeof(bf16)};
  FP8T_CHECK(!overlap(out, inp, bytes),
             "expected out and inp not to overlap (rows are smeared in parallel), found out {} "
             "and inp {} ({} bytes each)",
             static_cast<const void*>(out), static_cast<const void*>(inp), bytes);
  if (rows == 0) return;
  const unsigned grid = warp_per_item_grid(rows);
  const auto kernel = shape.channels % kBf16Vector == 0 && all_aligned({out, inp})
                          ? smear_forward_kernel<true>
                          : smear_forward_kernel<false>;
  kernel<<<grid, kThreads, 0, stream>>>(out, gate, inp, gate_weight, smear_lambda, shape);
  FP8T_CUDA_CHECK_LAUNCH();
}

void smear_backward(bf16* dinp, float* dgate_weight, float* dsmear_lambda, const bf16* dout,
                    const bf16* inp, const float* gate, const float* gate_weight,
                    const float* smear_lambda, const SmearShape& shape, GradStore store,
                    float* workspace, cudaStream_t stream) {
  ops::check_smear_shape(shape);
  FP8T_CHECK(shape.gate_channels <= kSmearMaxGateChannels, "expected gate_channels <= {}, found {}",
             kSmearMaxGateChannels, shape.gate_channels);
  const int64_t rows = shape.batch * shape.seq_len;
  check_pointers(rows, {dinp, dgate_weight, dsmear_lambda, dout, inp, gate, gate_weight,
                        smear_lambda, workspace});
  if (rows == 0) return;
  const int gate_channels = static_cast<int>(shape.gate_channels);
  const int entries = gate_channels + 1;
  const unsigned grid =
      std::min(warp_per_item_grid(rows), static_cast<unsigned>(kSmearWorkspaceFloats / entries));
  const size_t shared_bytes = sizeof(float) * kWarps * size_t(entries);
  const bool add = store == GradStore::Add;
  const auto kernel = shape.channels % kBf16Vector == 0 && all_aligned({dinp, dout, inp})
                          ? smear_backward_kernel<true>
                          : smear_backward_kernel<false>;
  kernel<<<grid, kThreads, shared_bytes, stream>>>(dinp, workspace, dout, inp, gate, gate_weight,
                                                   smear_lambda, shape, add);
  FP8T_CUDA_CHECK_LAUNCH();
  add_block_partials(workspace, grid, entries, {dgate_weight, gate_channels, dsmear_lambda},
                     stream);
}

void backout_forward(bf16* out, const bf16* x, const bf16* x_backout, const float* backout_lambda,
                     int64_t n, cudaStream_t stream) {
  check_pointwise_args(n, {out, x, x_backout, backout_lambda});
  if (n == 0) return;
  BackoutForward op{};
  op.out = out;
  op.x = x;
  op.x_backout = x_backout;
  op.backout_lambda = backout_lambda;
  launch_pointwise(op, n, all_aligned({out, x, x_backout}), stream);
}

void backout_backward(bf16* dx, bf16* dx_backout, float* dbackout_lambda, const bf16* dout,
                      const bf16* x_backout, const float* backout_lambda, int64_t n,
                      GradStore dx_store, GradStore dx_backout_store, float* workspace,
                      cudaStream_t stream) {
  check_pointwise_args(
      n, {dx, dx_backout, dbackout_lambda, dout, x_backout, backout_lambda, workspace});
  if (n == 0) return;
  BackoutBackward op{};
  op.dx = dx;
  op.dx_backout = dx_backout;
  op.block_partials = workspace;
  op.dout = dout;
  op.x_backout = x_backout;
  op.backout_lambda = backout_lambda;
  op.add_dx = dx_store == GradStore::Add;
  op.add_dx_backout = dx_backout_store == GradStore::Add;
  const unsigned grid = launch_pointwise_partials(
      op, n, all_aligned({dx, dx_backout, dout, x_backout}), kBackoutMaxBlocks, stream);
  add_block_partials(workspace, grid, 1, {nullptr, 0, dbackout_lambda}, stream);
}

void scale_f32(float* x, float factor, int64_t n, cudaStream_t stream) {
  check_pointwise_args(n, {x});
  if (n == 0) return;
  ScaleF32 op;
  op.x = x;
  op.factor = factor;
  launch_pointwise(op, n, device::aligned16(x), stream);
}

}  // namespace fp8t::ops::cuda
