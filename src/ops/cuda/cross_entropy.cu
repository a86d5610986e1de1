// Soft-capped cross-entropy with its gradient in place of the bf16 logits.
//
// Three launches: one block counts the rows that are not ignored (the gradient's 1/valid_rows
// needs them all before any row's gradient is written); one block per row makes an
// online-softmax pass over the row's logits (max and sum of exp of the capped logits) and,
// with the gradient, a second pass that overwrites the row, from L2 (at 4 blocks of 512
// threads per SM the rows in flight take ~34 MB on 132 SMs at a 32768 vocab, under the L2's
// 50 MB); and with mean_loss one block sums the row losses in a fixed order.
#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::ops::cuda {
namespace {

using device::kBf16Vector;
using device::kWarpSize;

constexpr int32_t kIgnoreTarget = -1;  // as ops::kIgnoreTarget
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kBlocksPerSm = 2;  // 64 registers per thread at most
// Chunks loaded before the first is used; more spills registers in the gradient kernel.
constexpr int kBatch = 2;
constexpr int kReduceThreads = 1024;

// softcap * tanh(x / softcap) and its slope 1 - tanh^2, from e = exp(-2|x| / softcap) in
// (0, 1]: tanh = sign(x) (1 - e) / (1 + e), 1 - tanh^2 = 4 e / (1 + e)^2. No overflow for any
// x; NaN stays NaN.
struct SoftCap {
  float softcap;
  float minus_two_over_softcap;

  __device__ float capped(float x, float& slope) const {
    const float e = __expf(fabsf(x) * minus_two_over_softcap);
    const float inverse = __frcp_rn(1.0f + e);
    slope = 4.0f * e * inverse * inverse;
    return softcap * copysignf((1.0f - e) * inverse, x);
  }
  __device__ float capped(float x) const {
    float unused;
    return capped(x, unused);
  }
};

// The running (max, sum of exp(value - max)) of an online softmax.
struct SoftmaxState {
  float max = -INFINITY;
  float sum = 0.0f;

  __device__ void merge(float other_max, float other_sum) {
    const float new_max = fmaxf(max, other_max);
    if (new_max == -INFINITY) return;  // both empty
    sum = sum * __expf(max - new_max) + other_sum * __expf(other_max - new_max);
    max = new_max;
  }
};

// Every thread gets the block's state, merged in the same order by each.
__device__ SoftmaxState block_softmax_state(SoftmaxState state) {
  __shared__ float warp_max[kWarps];
  __shared__ float warp_sum[kWarps];
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    state.merge(__shfl_xor_sync(device::kFullMask, state.max, offset),
                __shfl_xor_sync(device::kFullMask, state.sum, offset));
  }
  if (threadIdx.x % kWarpSize == 0) {
    warp_max[threadIdx.x / kWarpSize] = state.max;
    warp_sum[threadIdx.x / kWarpSize] = state.sum;
  }
  __syncthreads();
  SoftmaxState block;
  for (int w = 0; w < kWarps; ++w)
    block.merge(warp_max[w], warp_sum[w]);
  __syncthreads();  // the next row reuses the arrays
  return block;
}

__global__ void __launch_bounds__(kReduceThreads)
    count_valid_rows_kernel(const int32_t* targets, int64_t rows, int32_t* valid_rows) {
  int count = 0;
  for (int64_t r = threadIdx.x; r < rows; r += kReduceThreads)
    count += targets[r] != kIgnoreTarget ? 1 : 0;
  count = device::block_sum<kReduceThreads>(count);
  if (threadIdx.x == 0) *valid_rows = count;
}

__global__ void __launch_bounds__(kReduceThreads)
    mean_loss_kernel(const float* row_losses, int64_t rows, const int32_t* valid_rows,
                     float* mean_loss) {
  double sum = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += kReduceThreads)
    sum += row_losses[r];
  sum = device::block_sum<kReduceThreads>(sum);
  if (threadIdx.x == 0) {
    const int32_t valid = *valid_rows;
    *mean_loss = valid > 0 ? static_cast<float>(sum / valid) : 0.0f;
  }
}

// One block per row (grid-stride over rows). kWidth: 8 (16-byte vectors; padded_vocab % 8 == 0
// and aligned logits) or 1. Columns at or past vocab are never read as logits. Column indices
// are 32-bit (padded_vocab < 2^31), which keeps the gradient pass within 64 registers.
template <bool kGradient, int kWidth>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    softcap_cross_entropy_kernel(bf16* logits, const int32_t* __restrict__ targets, int64_t rows,
                                 int vocab, int padded_vocab, SoftCap cap, float dloss,
                                 float* __restrict__ row_losses,
                                 const int32_t* __restrict__ valid_rows) {
  const int vocab_chunks = (vocab + kWidth - 1) / kWidth;  // chunks with real columns
  const int row_chunks = padded_vocab / kWidth;
  float row_weight = 0.0f;
  if constexpr (kGradient) {
    const int32_t valid = *valid_rows;
    row_weight = valid > 0 ? dloss / static_cast<float>(valid) : 0.0f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    bf16* x = logits + row * padded_vocab;
    const int32_t target = targets[row];
    if (target == kIgnoreTarget) {
      if (threadIdx.x == 0) row_losses[row] = 0.0f;
      if constexpr (kGradient) {
        const float zeros[kWidth] = {};
        for (int chunk = threadIdx.x; chunk < row_chunks; chunk += kThreads)
          device::store_bf16(x + chunk * kWidth, zeros);
      }
      continue;
    }
    const bool bad_target = target < 0 || target >= vocab;

    // Pass 1: the online softmax of the capped logits, kBatch chunks loaded at a time.
    SoftmaxState state;
    for (int chunk0 = threadIdx.x; chunk0 < vocab_chunks; chunk0 += kBatch * kThreads) {
      float values[kBatch][kWidth];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int chunk = chunk0 + b * kThreads;
        if (chunk < vocab_chunks) device::load_bf16(x + chunk * kWidth, values[b]);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int chunk = chunk0 + b * kThreads;
        if (chunk >= vocab_chunks) break;
        float chunk_max = -INFINITY;
#pragma unroll
        for (int k = 0; k < kWidth; ++k) {
          const bool real = chunk * kWidth + k < vocab;
          values[b][k] = real ? cap.capped(values[b][k]) : -INFINITY;
          chunk_max = fmaxf(chunk_max, values[b][k]);
        }
        if (chunk_max > state.max) {
          state.sum *= __expf(state.max - chunk_max);
          state.max = chunk_max;
        }
#pragma unroll
        for (int k = 0; k < kWidth; ++k)
          state.sum += __expf(values[b][k] - state.max);
      }
    }
    const SoftmaxState block = block_softmax_state(state);
    const float log_sum_exp = block.max + logf(block.sum);
    if (threadIdx.x == 0) {
      row_losses[row] = bad_target ? NAN : log_sum_exp - cap.capped(device::to_f32(x[target]));
    }
    if constexpr (kGradient) {
      __syncthreads();  // thread 0's read of x[target] happens before any write
      // Pass 2: (softmax - onehot) * row_weight * slope on real columns, 0 on padding.
      const float nan_or_zero = bad_target ? NAN : 0.0f;
      for (int chunk0 = threadIdx.x; chunk0 < row_chunks; chunk0 += kBatch * kThreads) {
        float values[kBatch][kWidth];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int chunk = chunk0 + b * kThreads;
          if (chunk < vocab_chunks) device::load_bf16(x + chunk * kWidth, values[b]);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int chunk = chunk0 + b * kThreads;
          if (chunk >= row_chunks) break;
#pragma unroll
          for (int k = 0; k < kWidth; ++k) {
            const int column = chunk * kWidth + k;
            float slope;
            const float capped = cap.capped(values[b][k], slope);
            const float probability = __expf(capped - log_sum_exp);
            const float gradient =
                (column == target ? probability - 1.0f : probability) * row_weight * slope;
            values[b][k] = (column < vocab ? gradient : 0.0f) + nan_or_zero;
          }
          device::store_bf16(x + chunk * kWidth, values[b]);
        }
      }
    }
  }
}

template <bool kGradient>
void launch_cross_entropy(bf16* logits, const int32_t* targets, int64_t rows, int64_t vocab,
                          int64_t padded_vocab, float softcap, float dloss, float* row_losses,
                          float* mean_loss, int32_t* valid_rows, cudaStream_t stream) {
  FP8T_CHECK(rows >= 0, "expected rows >= 0, found {}", rows);
  FP8T_CHECK(vocab > 0, "expected vocab > 0, found {}", vocab);
  FP8T_CHECK(padded_vocab >= vocab, "expected padded_vocab >= vocab ({}), found {}", vocab,
             padded_vocab);
  FP8T_CHECK(padded_vocab < (int64_t{1} << 31), "expected padded_vocab < 2^31, found {}",
             padded_vocab);
  FP8T_CHECK(softcap > 0.0f, "expected softcap > 0, found {}", softcap);
  FP8T_CHECK(valid_rows != nullptr, "null valid_rows");
  FP8T_CHECK(rows == 0 || (logits != nullptr && targets != nullptr && row_losses != nullptr),
             "null device pointer for {} rows", rows);
  count_valid_rows_kernel<<<1, kReduceThreads, 0, stream>>>(targets, rows, valid_rows);
  FP8T_CUDA_CHECK_LAUNCH();
  if (rows > 0) {
    const SoftCap cap{softcap, -2.0f / softcap};
    // A row per block; 2^31 - 1 blocks at most, the kernel strides over the rest.
    const auto grid = static_cast<unsigned>(std::min<int64_t>(rows, (int64_t{1} << 31) - 1));
    if (padded_vocab % kBf16Vector == 0 && device::aligned16(logits)) {
      softcap_cross_entropy_kernel<kGradient, kBf16Vector><<<grid, kThreads, 0, stream>>>(
          logits, targets, rows, static_cast<int>(vocab), static_cast<int>(padded_vocab), cap,
          dloss, row_losses, valid_rows);
    } else {
      softcap_cross_entropy_kernel<kGradient, 1><<<grid, kThreads, 0, stream>>>(
          logits, targets, rows, static_cast<int>(vocab), static_cast<int>(padded_vocab), cap,
          dloss, row_losses, valid_rows);
    }
    FP8T_CUDA_CHECK_LAUNCH();
  }
  if (mean_loss != nullptr) {
    mean_loss_kernel<<<1, kReduceThreads, 0, stream>>>(row_losses, rows, valid_rows, mean_loss);
    FP8T_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace

void softcap_cross_entropy_forward(const bf16* logits, const int32_t* targets, int64_t rows,
                                   int64_t vocab, int64_t padded_vocab, float softcap,
                                   float* row_losses, float* mean_loss, int32_t* valid_rows,
                                   cudaStream_t stream) {
  // The forward kernel only reads the logits.
  launch_cross_entropy<false>(const_cast<bf16*>(logits), targets, rows, vocab, padded_vocab,
                              softcap, 0.0f, row_losses, mean_loss, valid_rows, stream);
}

void softcap_cross_entropy_with_gradient(bf16* logits, const int32_t* targets, int64_t rows,
                                         int64_t vocab, int64_t padded_vocab, float softcap,
                                         float dloss, float* row_losses, float* mean_loss,
                                         int32_t* valid_rows, cudaStream_t stream) {
  launch_cross_entropy<true>(logits, targets, rows, vocab, padded_vocab, softcap, dloss, row_losses,
                             mean_loss, valid_rows, stream);
}

}  // namespace fp8t::ops::cuda
