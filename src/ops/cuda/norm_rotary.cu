// RMSNorm and rotary kernels: bf16 in and out, fp32 math and statistics.
//
// RMSNorm: one warp per row, two passes over the row (the sum of squares, then the scaled
// output), the second one from L1/L2. Rotary: a head row of head_dim channels belongs to a group
// of head_dim / 16 threads, each owning 8 channel pairs (two 16-byte loads of x, the matching
// cos and sin from the L2-resident tables), so the per-head RMSNorm of q and k is a shuffle
// within the group; other head sizes and unaligned pointers take a warp-per-head path.
#include <cmath>
#include <initializer_list>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/error.h"
#include "numerics/quantize_cuda.h"
#include "numerics/rotary_norm_math.cuh"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::ops::cuda {
namespace {

using device::kBf16Vector;
using device::kWarpSize;
using device::load_bf16x8;
using device::load_f32x8;
using device::store_bf16x8;
using device::to_bf16;
using device::to_f32;
using fp8t::cuda::rotary::add_pair_dot;
using fp8t::cuda::rotary::norm_input_gradient;
using fp8t::cuda::rotary::rotate_pair;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kBlocksPerSm = 8;  // 2048 resident threads per SM

// --- RMSNorm: a warp per row; the vector path needs dim % 8 == 0 and 16-byte aligned rows. ---

// kCast: the FusedCast of out, from the values as stored (rounded to bf16); kBlocks: with 1x128
// block scales (vector path only, dim a multiple of 128).
template <bool kVector, bool kCast, bool kBlocks = false>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_kernel(bf16* out, float* rstd, const bf16* inp, int64_t rows, int64_t dim,
                           float eps, FusedCast cast) {
  static_assert(!kBlocks || (kVector && kCast), "block scales take the vector path's casts");
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row_stride = int64_t(gridDim.x) * kWarps;
  device::FusedCastState fp8(cast);
  // Not __restrict__: out may be inp. Each lane reads an element before writing it.
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; row < rows;
       row += row_stride) {
    const bf16* x = inp + row * dim;
    bf16* y = out + row * dim;
    float sum_squares = 0.0f;
    if constexpr (kVector) {
      for (int64_t i = lane * kBf16Vector; i < dim; i += kWarpSize * kBf16Vector) {
        float v[kBf16Vector];
        load_bf16x8(x + i, v);
#pragma unroll
        for (int k = 0; k < kBf16Vector; ++k)
          sum_squares = fmaf(v[k], v[k], sum_squares);
      }
    } else {
      for (int64_t i = lane; i < dim; i += kWarpSize) {
        const float v = to_f32(x[i]);
        sum_squares = fmaf(v, v, sum_squares);
      }
    }
    sum_squares = device::group_sum(sum_squares);
    const float row_rstd = 1.0f / sqrtf(sum_squares / static_cast<float>(dim) + eps);
    if constexpr (kVector) {
      for (int64_t i = lane * kBf16Vector; i < dim; i += kWarpSize * kBf16Vector) {
        float v[kBf16Vector];
        load_bf16x8(x + i, v);
#pragma unroll
        for (int k = 0; k < kBf16Vector; ++k)
          v[k] *= row_rstd;
        store_bf16x8(y + i, v);
        if constexpr (kCast) {
#pragma unroll
          for (int k = 0; k < kBf16Vector; ++k)
            v[k] = to_f32(to_bf16(v[k]));  // the values as stored
          uint8_t codes[kBf16Vector];
          fp8.encode<kBlocks>(v, codes, row, rows, i);
          if (cast.out != nullptr)
            *reinterpret_cast<uint2*>(cast.out + row * dim + i) = *reinterpret_cast<uint2*>(codes);
        }
      }
    } else {
      for (int64_t i = lane; i < dim; i += kWarpSize) {
        const bf16 stored = to_bf16(to_f32(x[i]) * row_rstd);
        y[i] = stored;
        if constexpr (kCast) {
          const float rounded[1] = {to_f32(stored)};
          uint8_t codes[1];
          fp8.encode(rounded, codes);
          if (cast.out != nullptr) cast.out[row * dim + i] = codes[0];
        }
      }
    }
    if (lane == 0) rstd[row] = row_rstd;
  }
  if constexpr (kCast && !kBlocks) {
    if (cast.amax != nullptr) fp8.publish();
  }
}

template <bool kVector>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_kernel(bf16* __restrict__ dinp, const bf16* __restrict__ dout,
                            const bf16* __restrict__ out, const float* __restrict__ rstd,
                            int64_t rows, int64_t dim, bool add) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row_stride = int64_t(gridDim.x) * kWarps;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; row < rows;
       row += row_stride) {
    const bf16* dy = dout + row * dim;
    const bf16* y = out + row * dim;
    bf16* dx = dinp + row * dim;
    const float mean_dy_y = device::warp_dot<kVector>(dy, y, dim) / static_cast<float>(dim);
    const float row_rstd = rstd[row];
    if constexpr (kVector) {
      for (int64_t i = lane * kBf16Vector; i < dim; i += kWarpSize * kBf16Vector) {
        float dy_v[kBf16Vector], y_v[kBf16Vector], dx_v[kBf16Vector] = {};
        load_bf16x8(dy + i, dy_v);
        load_bf16x8(y + i, y_v);
        if (add) load_bf16x8(dx + i, dx_v);
#pragma unroll
        for (int k = 0; k < kBf16Vector; ++k) {
          const float g = norm_input_gradient(dy_v[k], y_v[k], mean_dy_y, row_rstd);
          dx_v[k] = add ? dx_v[k] + g : g;
        }
        store_bf16x8(dx + i, dx_v);
      }
    } else {
      for (int64_t i = lane; i < dim; i += kWarpSize) {
        const float g = norm_input_gradient(to_f32(dy[i]), to_f32(y[i]), mean_dy_y, row_rstd);
        dx[i] = to_bf16(add ? to_f32(dx[i]) + g : g);
      }
    }
  }
}

void check_rmsnorm_args(int64_t rows, int64_t dim, const void* a, const void* b, const void* c) {
  FP8T_CHECK(rows >= 0, "expected rows >= 0, found {}", rows);
  FP8T_CHECK(dim > 0, "expected dim > 0, found {}", dim);
  FP8T_CHECK(rows == 0 || (a != nullptr && b != nullptr && c != nullptr),
             "null device pointer for {} rows", rows);
}

unsigned warp_per_row_grid(int64_t rows) {
  return device::grid_size((rows + kWarps - 1) / kWarps, kBlocksPerSm);
}

// --- Rotary ---

// Where a head row lives: row = (b * seq_len + t) * heads + h.
struct HeadRows {
  int64_t count;  // batch * seq_len * heads
  int64_t seq_len;
  int64_t heads;
  __device__ int64_t position(int64_t row) const { return (row / heads) % seq_len; }
};

// Forward (optionally + RMSNorm) with kGroup threads per head row of head_dim = 16 kGroup.
// A warp holds 32 / kGroup head rows and iterates while any of them exists, so that the group
// shuffles always see the whole warp.
template <int kGroup, bool kNorm>
__global__ void __launch_bounds__(kThreads)
    rotary_forward_vector_kernel(bf16* out, float* rstd, const bf16* inp, const float* cos,
                                 const float* sin, HeadRows head_rows, float eps) {
  constexpr int kHalf = kGroup * kBf16Vector;
  constexpr int kDim = 2 * kHalf;
  constexpr int kRowsPerWarp = kWarpSize / kGroup;
  const int lane = threadIdx.x % kWarpSize;
  const int member = lane % kGroup;
  const int64_t stride = int64_t(gridDim.x) * kWarps * kRowsPerWarp;
  for (int64_t first_row = (int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize) * kRowsPerWarp;
       first_row < head_rows.count; first_row += stride) {
    const int64_t row = first_row + lane / kGroup;
    const bool valid = row < head_rows.count;
    float x1[kBf16Vector] = {}, x2[kBf16Vector] = {}, c[kBf16Vector] = {}, s[kBf16Vector] = {};
    const int64_t offset = row * kDim + member * kBf16Vector;
    if (valid) {
      load_bf16x8(inp + offset, x1);
      load_bf16x8(inp + offset + kHalf, x2);
      const int64_t table_offset = head_rows.position(row) * kHalf + member * kBf16Vector;
      load_f32x8(cos + table_offset, c);
      load_f32x8(sin + table_offset, s);
    }
    float y1[kBf16Vector], y2[kBf16Vector];
    float sum_squares = 0.0f;
#pragma unroll
    for (int k = 0; k < kBf16Vector; ++k) {
      rotate_pair<false>(x1[k], x2[k], c[k], s[k], y1[k], y2[k]);
      sum_squares = fmaf(y1[k], y1[k], fmaf(y2[k], y2[k], sum_squares));
    }
    if constexpr (kNorm) {
      sum_squares = device::group_sum<kGroup>(sum_squares);
      const float row_rstd = 1.0f / sqrtf(sum_squares / static_cast<float>(kDim) + eps);
#pragma unroll
      for (int k = 0; k < kBf16Vector; ++k) {
        y1[k] *= row_rstd;
        y2[k] *= row_rstd;
      }
      if (valid && member == 0) rstd[row] = row_rstd;
    }
    if (valid) {
      store_bf16x8(out + offset, y1);
      store_bf16x8(out + offset + kHalf, y2);
    }
  }
}

template <int kGroup, bool kNorm>
__global__ void __launch_bounds__(kThreads)
    rotary_backward_vector_kernel(bf16* __restrict__ dinp, const bf16* __restrict__ dout,
                                  const bf16* __restrict__ out, const float* __restrict__ rstd,
                                  const float* __restrict__ cos, const float* __restrict__ sin,
                                  HeadRows head_rows, bool add) {
  constexpr int kHalf = kGroup * kBf16Vector;
  constexpr int kDim = 2 * kHalf;
  constexpr int kRowsPerWarp = kWarpSize / kGroup;
  const int lane = threadIdx.x % kWarpSize;
  const int member = lane % kGroup;
  const int64_t stride = int64_t(gridDim.x) * kWarps * kRowsPerWarp;
  for (int64_t first_row = (int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize) * kRowsPerWarp;
       first_row < head_rows.count; first_row += stride) {
    const int64_t row = first_row + lane / kGroup;
    const bool valid = row < head_rows.count;
    const int64_t offset = row * kDim + member * kBf16Vector;
    float g1[kBf16Vector] = {}, g2[kBf16Vector] = {}, c[kBf16Vector] = {}, s[kBf16Vector] = {};
    float y1[kBf16Vector] = {}, y2[kBf16Vector] = {};
    float row_rstd = 0.0f;
    if (valid) {
      load_bf16x8(dout + offset, g1);
      load_bf16x8(dout + offset + kHalf, g2);
      if constexpr (kNorm) {
        load_bf16x8(out + offset, y1);
        load_bf16x8(out + offset + kHalf, y2);
        row_rstd = rstd[row];
      }
      const int64_t table_offset = head_rows.position(row) * kHalf + member * kBf16Vector;
      load_f32x8(cos + table_offset, c);
      load_f32x8(sin + table_offset, s);
    }
    if constexpr (kNorm) {
      // The gradient before the norm.
      float dy_dot_y = 0.0f;
#pragma unroll
      for (int k = 0; k < kBf16Vector; ++k)
        dy_dot_y = add_pair_dot(g1[k], y1[k], g2[k], y2[k], dy_dot_y);
      const float mean_dy_y = device::group_sum<kGroup>(dy_dot_y) / static_cast<float>(kDim);
#pragma unroll
      for (int k = 0; k < kBf16Vector; ++k) {
        g1[k] = norm_input_gradient(g1[k], y1[k], mean_dy_y, row_rstd);
        g2[k] = norm_input_gradient(g2[k], y2[k], mean_dy_y, row_rstd);
      }
    }
    if (!valid) continue;
    float dx1[kBf16Vector], dx2[kBf16Vector];
#pragma unroll
    for (int k = 0; k < kBf16Vector; ++k)
      rotate_pair<true>(g1[k], g2[k], c[k], s[k], dx1[k], dx2[k]);
    if (add) {
      float old1[kBf16Vector], old2[kBf16Vector];
      load_bf16x8(dinp + offset, old1);
      load_bf16x8(dinp + offset + kHalf, old2);
#pragma unroll
      for (int k = 0; k < kBf16Vector; ++k) {
        dx1[k] += old1[k];
        dx2[k] += old2[k];
      }
    }
    store_bf16x8(dinp + offset, dx1);
    store_bf16x8(dinp + offset + kHalf, dx2);
  }
}

// Any even head_dim, any alignment: a warp per head row, lane j owns the pairs j, j + 32, ...
template <bool kNorm>
__global__ void __launch_bounds__(kThreads)
    rotary_forward_warp_kernel(bf16* out, float* rstd, const bf16* inp, const float* cos,
                               const float* sin, HeadRows head_rows, int64_t head_dim, float eps) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t half = head_dim / 2;
  const int64_t row_stride = int64_t(gridDim.x) * kWarps;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; row < head_rows.count;
       row += row_stride) {
    const bf16* x = inp + row * head_dim;
    bf16* y = out + row * head_dim;
    const float* cos_row = cos + head_rows.position(row) * half;
    const float* sin_row = sin + head_rows.position(row) * half;
    float row_rstd = 1.0f;
    if constexpr (kNorm) {
      float sum_squares = 0.0f;
      for (int64_t j = lane; j < half; j += kWarpSize) {
        float y1, y2;
        rotate_pair<false>(to_f32(x[j]), to_f32(x[j + half]), cos_row[j], sin_row[j], y1, y2);
        sum_squares = fmaf(y1, y1, fmaf(y2, y2, sum_squares));
      }
      sum_squares = device::group_sum(sum_squares);
      row_rstd = 1.0f / sqrtf(sum_squares / static_cast<float>(head_dim) + eps);
      if (lane == 0) rstd[row] = row_rstd;
    }
    // In place is safe: each lane reads its pair before writing it.
    for (int64_t j = lane; j < half; j += kWarpSize) {
      float y1, y2;
      rotate_pair<false>(to_f32(x[j]), to_f32(x[j + half]), cos_row[j], sin_row[j], y1, y2);
      y[j] = to_bf16(y1 * row_rstd);
      y[j + half] = to_bf16(y2 * row_rstd);
    }
  }
}

template <bool kNorm>
__global__ void __launch_bounds__(kThreads)
    rotary_backward_warp_kernel(bf16* __restrict__ dinp, const bf16* __restrict__ dout,
                                const bf16* __restrict__ out, const float* __restrict__ rstd,
                                const float* __restrict__ cos, const float* __restrict__ sin,
                                HeadRows head_rows, int64_t head_dim, bool add) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t half = head_dim / 2;
  const int64_t row_stride = int64_t(gridDim.x) * kWarps;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; row < head_rows.count;
       row += row_stride) {
    const bf16* dy = dout + row * head_dim;
    const bf16* y = out + row * head_dim;
    bf16* dx = dinp + row * head_dim;
    const float* cos_row = cos + head_rows.position(row) * half;
    const float* sin_row = sin + head_rows.position(row) * half;
    float row_rstd = 1.0f;
    float mean_dy_y = 0.0f;
    if constexpr (kNorm) {
      float dy_dot_y = 0.0f;
      for (int64_t i = lane; i < head_dim; i += kWarpSize)
        dy_dot_y = fmaf(to_f32(dy[i]), to_f32(y[i]), dy_dot_y);
      mean_dy_y = device::group_sum(dy_dot_y) / static_cast<float>(head_dim);
      row_rstd = rstd[row];
    }
    for (int64_t j = lane; j < half; j += kWarpSize) {
      float g1 = to_f32(dy[j]);
      float g2 = to_f32(dy[j + half]);
      if constexpr (kNorm) {
        g1 = norm_input_gradient(g1, to_f32(y[j]), mean_dy_y, row_rstd);
        g2 = norm_input_gradient(g2, to_f32(y[j + half]), mean_dy_y, row_rstd);
      }
      float dx1, dx2;
      rotate_pair<true>(g1, g2, cos_row[j], sin_row[j], dx1, dx2);
      if (add) {
        dx1 += to_f32(dx[j]);
        dx2 += to_f32(dx[j + half]);
      }
      dx[j] = to_bf16(dx1);
      dx[j + half] = to_bf16(dx2);
    }
  }
}

void check_rotary_args(const RotaryShape& shape, const float* cos, const float* sin) {
  FP8T_CHECK(shape.batch >= 0, "expected batch >= 0, found {}", shape.batch);
  FP8T_CHECK(shape.seq_len >= 0, "expected seq_len >= 0, found {}", shape.seq_len);
  FP8T_CHECK(shape.heads > 0, "expected heads > 0, found {}", shape.heads);
  FP8T_CHECK(shape.head_dim > 0 && shape.head_dim % 2 == 0,
             "expected an even head_dim > 0, found {}", shape.head_dim);
  FP8T_CHECK(cos != nullptr && sin != nullptr, "null rotary table");
}

// Calls launch(std::integral_constant<int, kGroup>{}) when head_dim has a vector kernel
// (64, 128, 256: groups of 4, 8, 16 threads) and every pointer is 16-byte aligned; returns
// whether it did.
template <typename Launch>
bool launch_vector_rotary(int64_t head_dim, std::initializer_list<const void*> pointers,
                          Launch&& launch) {
  for (const void* pointer : pointers)
    if (!device::aligned16(pointer)) return false;
  switch (head_dim) {
    case 64:
      launch(std::integral_constant<int, 4>{});
      return true;
    case 128:
      launch(std::integral_constant<int, 8>{});
      return true;
    case 256:
      launch(std::integral_constant<int, 16>{});
      return true;
    default:
      return false;
  }
}

template <bool kNorm>
void launch_rotary_forward(bf16* out, float* rstd, const bf16* inp, const float* cos,
                           const float* sin, const RotaryShape& shape, float eps,
                           cudaStream_t stream) {
  check_rotary_args(shape, cos, sin);
  const HeadRows head_rows{shape.batch * shape.seq_len * shape.heads, shape.seq_len, shape.heads};
  if (head_rows.count == 0) return;
  FP8T_CHECK(out != nullptr && inp != nullptr && (!kNorm || rstd != nullptr),
             "null device pointer for {} head rows", head_rows.count);
  const bool vectorized =
      launch_vector_rotary(shape.head_dim, {out, inp, cos, sin}, [&](auto group) {
        constexpr int kGroup = decltype(group)::value;
        constexpr int kRowsPerBlock = kThreads / kGroup;
        const unsigned grid =
            device::grid_size((head_rows.count + kRowsPerBlock - 1) / kRowsPerBlock, kBlocksPerSm);
        rotary_forward_vector_kernel<kGroup, kNorm>
            <<<grid, kThreads, 0, stream>>>(out, rstd, inp, cos, sin, head_rows, eps);
      });
  if (!vectorized) {
    rotary_forward_warp_kernel<kNorm><<<warp_per_row_grid(head_rows.count), kThreads, 0, stream>>>(
        out, rstd, inp, cos, sin, head_rows, shape.head_dim, eps);
  }
  FP8T_CUDA_CHECK_LAUNCH();
}

template <bool kNorm>
void launch_rotary_backward(bf16* dinp, const bf16* dout, const bf16* out, const float* rstd,
                            const float* cos, const float* sin, const RotaryShape& shape,
                            GradStore store, cudaStream_t stream) {
  check_rotary_args(shape, cos, sin);
  const HeadRows head_rows{shape.batch * shape.seq_len * shape.heads, shape.seq_len, shape.heads};
  if (head_rows.count == 0) return;
  FP8T_CHECK(dinp != nullptr && dout != nullptr && (!kNorm || (out != nullptr && rstd != nullptr)),
             "null device pointer for {} head rows", head_rows.count);
  const bool add = store == GradStore::Add;
  const bool vectorized = launch_vector_rotary(
      shape.head_dim, {dinp, dout, kNorm ? out : dout, cos, sin}, [&](auto group) {
        constexpr int kGroup = decltype(group)::value;
        constexpr int kRowsPerBlock = kThreads / kGroup;
        const unsigned grid =
            device::grid_size((head_rows.count + kRowsPerBlock - 1) / kRowsPerBlock, kBlocksPerSm);
        rotary_backward_vector_kernel<kGroup, kNorm>
            <<<grid, kThreads, 0, stream>>>(dinp, dout, out, rstd, cos, sin, head_rows, add);
      });
  if (!vectorized) {
    rotary_backward_warp_kernel<kNorm><<<warp_per_row_grid(head_rows.count), kThreads, 0, stream>>>(
        dinp, dout, out, rstd, cos, sin, head_rows, shape.head_dim, add);
  }
  FP8T_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, int64_t rows, int64_t dim, float eps,
                     cudaStream_t stream, const FusedCast& cast) {
  check_rmsnorm_args(rows, dim, out, rstd, inp);
  FP8T_CHECK(eps >= 0.0f, "expected eps >= 0, found {}", eps);
  const bool blocks = cast.block_scales != nullptr;
  // The vector path stores 8 codes at once.
  const bool vector = dim % kBf16Vector == 0 && device::aligned16(out) && device::aligned16(inp) &&
                      reinterpret_cast<uintptr_t>(cast.out) % kBf16Vector == 0;
  device::check_fused_cast(cast, dim, vector);
  if (rows == 0) return;
  const unsigned grid = warp_per_row_grid(rows);
  const bool fused = cast.out != nullptr || cast.amax != nullptr;
  const auto launch = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, stream>>>(out, rstd, inp, rows, dim, eps, cast);
  };
  if (blocks) {
    launch(rmsnorm_forward_kernel<true, true, true>);
  } else if (vector) {
    fused ? launch(rmsnorm_forward_kernel<true, true>)
          : launch(rmsnorm_forward_kernel<true, false>);
  } else {
    fused ? launch(rmsnorm_forward_kernel<false, true>)
          : launch(rmsnorm_forward_kernel<false, false>);
  }
  FP8T_CUDA_CHECK_LAUNCH();
}

void rmsnorm_backward(bf16* dinp, const bf16* dout, const bf16* out, const float* rstd,
                      int64_t rows, int64_t dim, GradStore store, cudaStream_t stream) {
  check_rmsnorm_args(rows, dim, dinp, dout, out);
  FP8T_CHECK(rows == 0 || rstd != nullptr, "null rstd for {} rows", rows);
  if (rows == 0) return;
  const unsigned grid = warp_per_row_grid(rows);
  const bool add = store == GradStore::Add;
  if (dim % kBf16Vector == 0 && device::aligned16(dinp) && device::aligned16(dout) &&
      device::aligned16(out)) {
    rmsnorm_backward_kernel<true>
        <<<grid, kThreads, 0, stream>>>(dinp, dout, out, rstd, rows, dim, add);
  } else {
    rmsnorm_backward_kernel<false>
        <<<grid, kThreads, 0, stream>>>(dinp, dout, out, rstd, rows, dim, add);
  }
  FP8T_CUDA_CHECK_LAUNCH();
}

void rotary_forward(bf16* out, const bf16* inp, const float* cos, const float* sin,
                    const RotaryShape& shape, cudaStream_t stream) {
  launch_rotary_forward<false>(out, nullptr, inp, cos, sin, shape, 0.0f, stream);
}

void rotary_backward(bf16* dinp, const bf16* dout, const float* cos, const float* sin,
                     const RotaryShape& shape, GradStore store, cudaStream_t stream) {
  launch_rotary_backward<false>(dinp, dout, nullptr, nullptr, cos, sin, shape, store, stream);
}

void rotary_rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const float* cos,
                            const float* sin, const RotaryShape& shape, float eps,
                            cudaStream_t stream) {
  FP8T_CHECK(eps >= 0.0f, "expected eps >= 0, found {}", eps);
  launch_rotary_forward<true>(out, rstd, inp, cos, sin, shape, eps, stream);
}

void rotary_rmsnorm_backward(bf16* dinp, const bf16* dout, const bf16* out, const float* rstd,
                             const float* cos, const float* sin, const RotaryShape& shape,
                             GradStore store, cudaStream_t stream) {
  launch_rotary_backward<true>(dinp, dout, out, rstd, cos, sin, shape, store, stream);
}

void rotary_rmsnorm_backward_cast(const bf16* dout, const bf16* out, const float* rstd,
                                  const float* cos, const float* sin, const RotaryShape& shape,
                                  const fp8t::cuda::BlockCastOutput& cast, cudaStream_t stream) {
  check_rotary_args(shape, cos, sin);
  FP8T_CHECK(shape.head_dim == kRotaryCastHeadDim,
             "the rotary norm's gradient is cast for heads of {} channels, found {}",
             kRotaryCastHeadDim, shape.head_dim);
  FP8T_CHECK(dout != nullptr && out != nullptr && rstd != nullptr,
             "null device pointer for the rotary norm's backward cast (dout {}, out {}, rstd {})",
             static_cast<const void*>(dout), static_cast<const void*>(out),
             static_cast<const void*>(rstd));
  fp8t::cuda::quantize_blocks_rotary_norm_gradient(
      dout, shape.batch * shape.seq_len, shape.heads * shape.head_dim,
      {out, rstd, cos, sin, shape.seq_len}, cast, stream);
}

}  // namespace fp8t::ops::cuda
