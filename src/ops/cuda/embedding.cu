// Embedding lookup (fp32 or bf16 table -> bf16 rows) and its gradient (bf16 rows summed into the
// fp32 table gradient): with atomics, or reproducibly after a stable sort of the tokens by id.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include <cub/device/device_radix_sort.cuh>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::ops::cuda {
namespace {

using device::kBf16Vector;
using device::to_bf16;
using device::to_f32;

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

__device__ inline bool valid_id(int32_t id, int64_t vocab) {
  return id >= 0 && id < vocab;
}

// One thread per chunk of kWidth columns of one token (8: 32 bytes of an fp32 table or 16 of a
// bf16 one in, 16 bytes out).
template <int kWidth, typename Table>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(bf16* __restrict__ out, const int32_t* __restrict__ ids,
                             const Table* __restrict__ table, int64_t num_tokens, int64_t vocab,
                             int64_t dim) {
  const int64_t chunks = dim / kWidth;
  const int64_t items = num_tokens * chunks;
  for (int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * kThreads) {
    const int64_t token = item / chunks;
    const int64_t column = (item % chunks) * kWidth;
    const int32_t id = ids[token];
    float values[kWidth];
    if (valid_id(id, vocab)) {
      const Table* row = table + id * dim + column;
      if constexpr (kWidth == kBf16Vector && std::is_same_v<Table, float>) {
        device::load_f32x8(row, values);
      } else if constexpr (kWidth == kBf16Vector) {
        device::load_bf16x8(row, values);
      } else {
        values[0] = to_float(row[0]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kWidth; ++k)
        values[k] = __int_as_float(0x7FC00000);  // a visible failure: a NaN row
    }
    if constexpr (kWidth == kBf16Vector) {
      device::store_bf16x8(out + token * dim + column, values);
    } else {
      out[token * dim + column] = to_bf16(values[0]);
    }
  }
}

// One thread per chunk of kWidth columns of one token, fp32 atomics into the table gradient
// (one 16-byte vector atomic on sm_90).
template <int kWidth>
__global__ void __launch_bounds__(kThreads)
    embedding_backward_atomic_kernel(float* __restrict__ dtable, const bf16* __restrict__ dout,
                                     const int32_t* __restrict__ ids, int64_t num_tokens,
                                     int64_t vocab, int64_t dim) {
  const int64_t chunks = dim / kWidth;
  const int64_t items = num_tokens * chunks;
  for (int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * kThreads) {
    const int64_t token = item / chunks;
    const int64_t column = (item % chunks) * kWidth;
    const int32_t id = ids[token];
    if (!valid_id(id, vocab)) continue;
    const bf16* source = dout + token * dim + column;
    float* destination = dtable + id * dim + column;
    if constexpr (kWidth == 4) {
      const uint2 raw = *reinterpret_cast<const uint2*>(source);
      const float4 values =
          make_float4(__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xFFFF0000u),
                      __uint_as_float(raw.y << 16), __uint_as_float(raw.y & 0xFFFF0000u));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float4*>(destination), values);
#else
      atomicAdd(destination, values.x);
      atomicAdd(destination + 1, values.y);
      atomicAdd(destination + 2, values.z);
      atomicAdd(destination + 3, values.w);
#endif
    } else {
      static_assert(kWidth == 1, "chunks of 4 or single columns");
      atomicAdd(destination, to_f32(*source));
    }
  }
}

// Sort keys: the id, or vocab (sorted last, then skipped) for an id outside [0, vocab); sort
// values: the token's position.
__global__ void __launch_bounds__(kThreads)
    sort_inputs_kernel(int32_t* __restrict__ keys, int32_t* __restrict__ positions,
                       const int32_t* __restrict__ ids, int32_t num_tokens, int32_t vocab) {
  for (int32_t n = blockIdx.x * kThreads + threadIdx.x; n < num_tokens; n += gridDim.x * kThreads) {
    const int32_t id = ids[n];
    keys[n] = valid_id(id, vocab) ? id : vocab;
    positions[n] = n;
  }
}

// After the sort: one thread per (sorted token, chunk of kWidth columns), chunks fastest so a
// warp reads contiguous columns. The thread at the first token of an id's run sums the run's
// rows in token order (the sort is stable) and adds the sum to the id's row of dtable, which
// no other thread touches. Four tokens of the run are loaded at a time.
template <int kWidth>
__global__ void __launch_bounds__(kThreads)
    embedding_backward_sorted_kernel(float* __restrict__ dtable, const bf16* __restrict__ dout,
                                     const int32_t* __restrict__ sorted_ids,
                                     const int32_t* __restrict__ sorted_positions,
                                     int64_t num_tokens, int64_t vocab, int64_t dim) {
  constexpr int kTokensAtOnce = 4;
  const int64_t chunks = dim / kWidth;
  const int64_t items = num_tokens * chunks;
  for (int64_t item = int64_t(blockIdx.x) * kThreads + threadIdx.x; item < items;
       item += int64_t(gridDim.x) * kThreads) {
    const int64_t start = item / chunks;
    const int64_t column = (item % chunks) * kWidth;
    const int32_t id = sorted_ids[start];
    if (id >= vocab || (start > 0 && sorted_ids[start - 1] == id)) continue;
    float sum[kWidth] = {};
    for (int64_t k0 = start; k0 < num_tokens; k0 += kTokensAtOnce) {
      bool in_run[kTokensAtOnce];
      float row[kTokensAtOnce][kWidth];
#pragma unroll
      for (int u = 0; u < kTokensAtOnce; ++u) {
        in_run[u] = k0 + u < num_tokens && sorted_ids[k0 + u] == id;
        if (!in_run[u]) continue;
        const bf16* source = dout + sorted_positions[k0 + u] * dim + column;
        if constexpr (kWidth == kBf16Vector) {
          device::load_bf16x8(source, row[u]);
        } else {
          row[u][0] = to_f32(*source);
        }
      }
      bool run_goes_on = true;
#pragma unroll
      for (int u = 0; u < kTokensAtOnce; ++u) {
        run_goes_on = run_goes_on && in_run[u];
        if (!run_goes_on) break;
#pragma unroll
        for (int k = 0; k < kWidth; ++k)
          sum[k] += row[u][k];
      }
      if (!run_goes_on) break;
    }
    float* destination = dtable + id * dim + column;
    if constexpr (kWidth == kBf16Vector) {
      float4* pair = reinterpret_cast<float4*>(destination);
      const float4 low = pair[0], high = pair[1];
      pair[0] = make_float4(low.x + sum[0], low.y + sum[1], low.z + sum[2], low.w + sum[3]);
      pair[1] = make_float4(high.x + sum[4], high.y + sum[5], high.z + sum[6], high.w + sum[7]);
    } else {
      destination[0] += sum[0];
    }
  }
}

void check_embedding_args(int64_t num_tokens, int64_t vocab, int64_t dim, const void* a,
                          const void* b, const void* c) {
  FP8T_CHECK(num_tokens >= 0, "expected num_tokens >= 0, found {}", num_tokens);
  FP8T_CHECK(vocab > 0, "expected vocab > 0, found {}", vocab);
  FP8T_CHECK(dim > 0, "expected dim > 0, found {}", dim);
  FP8T_CHECK(num_tokens == 0 || (a != nullptr && b != nullptr && c != nullptr),
             "null device pointer for {} tokens", num_tokens);
}

unsigned grid_for(int64_t items) {
  return device::grid_size((items + kThreads - 1) / kThreads, kBlocksPerSm);
}

// The sort's key bits: enough for vocab itself (the key of a bad id).
int sort_end_bit(int64_t vocab) {
  int bits = 1;
  while ((int64_t{1} << bits) <= vocab)
    ++bits;
  return bits;
}

size_t round_up_256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

size_t radix_sort_bytes(int64_t num_tokens, int64_t vocab) {
  size_t bytes = 0;
  FP8T_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<int>(num_tokens), 0, sort_end_bit(vocab)));
  return bytes;
}

void check_sortable(int64_t num_tokens, int64_t vocab) {
  // int32 keys and positions: vocab itself (a bad id's key) and every position must fit.
  FP8T_CHECK(num_tokens < (int64_t{1} << 31) && vocab < (int64_t{1} << 31) - 1,
             "expected num_tokens and vocab below 2^31, found {} and {}", num_tokens, vocab);
}

template <typename Table>
void launch_embedding_forward(bf16* out, const int32_t* ids, const Table* table, int64_t num_tokens,
                              int64_t vocab, int64_t dim, cudaStream_t stream) {
  check_embedding_args(num_tokens, vocab, dim, out, ids, table);
  if (num_tokens == 0) return;
  if (dim % kBf16Vector == 0 && device::aligned16(out) && device::aligned16(table)) {
    embedding_forward_kernel<kBf16Vector>
        <<<grid_for(num_tokens * (dim / kBf16Vector)), kThreads, 0, stream>>>(
            out, ids, table, num_tokens, vocab, dim);
  } else {
    embedding_forward_kernel<1><<<grid_for(num_tokens * dim), kThreads, 0, stream>>>(
        out, ids, table, num_tokens, vocab, dim);
  }
  FP8T_CUDA_CHECK_LAUNCH();
}

}  // namespace

void embedding_forward(bf16* out, const int32_t* ids, const float* table, int64_t num_tokens,
                       int64_t vocab, int64_t dim, cudaStream_t stream) {
  launch_embedding_forward(out, ids, table, num_tokens, vocab, dim, stream);
}

void embedding_forward(bf16* out, const int32_t* ids, const bf16* table, int64_t num_tokens,
                       int64_t vocab, int64_t dim, cudaStream_t stream) {
  launch_embedding_forward(out, ids, table, num_tokens, vocab, dim, stream);
}

void embedding_backward(float* dtable, const bf16* dout, const int32_t* ids, int64_t num_tokens,
                        int64_t vocab, int64_t dim, cudaStream_t stream) {
  check_embedding_args(num_tokens, vocab, dim, dtable, dout, ids);
  if (num_tokens == 0) return;
  if (dim % 4 == 0 && device::aligned16(dtable) && reinterpret_cast<uintptr_t>(dout) % 8 == 0) {
    embedding_backward_atomic_kernel<4><<<grid_for(num_tokens * (dim / 4)), kThreads, 0, stream>>>(
        dtable, dout, ids, num_tokens, vocab, dim);
  } else {
    embedding_backward_atomic_kernel<1><<<grid_for(num_tokens * dim), kThreads, 0, stream>>>(
        dtable, dout, ids, num_tokens, vocab, dim);
  }
  FP8T_CUDA_CHECK_LAUNCH();
}

size_t embedding_backward_deterministic_workspace_bytes(int64_t num_tokens, int64_t vocab) {
  FP8T_CHECK(num_tokens >= 0 && vocab > 0, "expected num_tokens >= 0 and vocab > 0, found {}, {}",
             num_tokens, vocab);
  check_sortable(num_tokens, vocab);
  // Keys and positions, before and after the sort, then CUB's scratch.
  const size_t array = round_up_256(static_cast<size_t>(num_tokens) * sizeof(int32_t));
  return 4 * array + radix_sort_bytes(num_tokens, vocab);
}

void embedding_backward_deterministic(float* dtable, const bf16* dout, const int32_t* ids,
                                      int64_t num_tokens, int64_t vocab, int64_t dim,
                                      void* workspace, size_t workspace_bytes,
                                      cudaStream_t stream) {
  check_embedding_args(num_tokens, vocab, dim, dtable, dout, ids);
  if (num_tokens == 0) return;
  const size_t needed = embedding_backward_deterministic_workspace_bytes(num_tokens, vocab);
  FP8T_CHECK(workspace != nullptr && workspace_bytes >= needed,
             "expected a workspace of at least {} bytes, found {}", needed, workspace_bytes);
  const size_t array = round_up_256(static_cast<size_t>(num_tokens) * sizeof(int32_t));
  char* bytes = static_cast<char*>(workspace);
  int32_t* keys = reinterpret_cast<int32_t*>(bytes);
  int32_t* sorted_keys = reinterpret_cast<int32_t*>(bytes + array);
  int32_t* positions = reinterpret_cast<int32_t*>(bytes + 2 * array);
  int32_t* sorted_positions = reinterpret_cast<int32_t*>(bytes + 3 * array);
  void* sort_scratch = bytes + 4 * array;
  size_t sort_scratch_bytes = workspace_bytes - 4 * array;

  const auto tokens = static_cast<int32_t>(num_tokens);
  sort_inputs_kernel<<<grid_for(num_tokens), kThreads, 0, stream>>>(keys, positions, ids, tokens,
                                                                    static_cast<int32_t>(vocab));
  FP8T_CUDA_CHECK_LAUNCH();
  FP8T_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort_scratch, sort_scratch_bytes, keys,
                                                  sorted_keys, positions, sorted_positions, tokens,
                                                  0, sort_end_bit(vocab), stream));
  if (dim % kBf16Vector == 0 && device::aligned16(dtable) && device::aligned16(dout)) {
    embedding_backward_sorted_kernel<kBf16Vector>
        <<<grid_for(num_tokens * (dim / kBf16Vector)), kThreads, 0, stream>>>(
            dtable, dout, sorted_keys, sorted_positions, num_tokens, vocab, dim);
  } else {
    embedding_backward_sorted_kernel<1><<<grid_for(num_tokens * dim), kThreads, 0, stream>>>(
        dtable, dout, sorted_keys, sorted_positions, num_tokens, vocab, dim);
  }
  FP8T_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8t::ops::cuda
