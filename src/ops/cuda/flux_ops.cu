// The Flux kernels of flux_ops.h.
//
// LayerNorm + modulation: a block per row, thread j owning the row's 8-element chunk at 8 j in
// registers (so dim <= 8 · 1024), so that the mean, the variance and the output come from one
// read of x. The backward's block (part, b) walks a strided share of sample b's tokens with the
// same layout, adding its chunk's dshift and dscale terms in registers.
// QK norm + RoPE: a group of threads per head (head_dim / 8 rounded up to a power of two), each
// owning 8 channels, i.e. 4 adjacent pairs; the norm's sum is a shuffle within the group.
// Column sums over tokens (the gated residual's dgate, bias gradients): tiles of 256 columns ×
// 16 rows per block, each block walking a strided share of the rows.
// Pointwise (the gated residual's forward, GELU with row strides, SiLU, the loss): grid-stride
// loops over 16-byte vectors (pointwise.cuh, or its row-strided variant here).
//
// Deterministic sums: a reducing kernel writes one partial per block (a fixed share of the
// rows) into the workspace as [groups][parts][width]; add_partials_kernel then adds each
// entry's partials in a fixed order, in double, into the fp32 gradient. The grids depend only
// on the shape and the GPU (its SM count and the kernels' occupancy), so the bits repeat.
#include "ops/cuda/flux_ops.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <type_traits>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/cuda/pointwise.cuh"
#include "ops/layernorm.h"

namespace fp8t::ops::cuda {
namespace {

using device::all_aligned;
using device::check_pointers;
using device::kBf16Vector;
using device::kFullMask;
using device::kPointwiseThreads;
using device::kWarpSize;
using device::load_bf16x8;
using device::load_f32x8;
using device::store_bf16x8;
using device::to_bf16;
using device::to_f32;

// 8 MiB: the LayerNorm backward's partials (2 dim floats per block) for a full wave of its blocks
// at Flux's dim 3072 and batch 2, far more than the other reductions need; larger batches get
// fewer blocks per sample.
constexpr int64_t kWorkspaceFloats = int64_t{1} << 21;

constexpr float kLayerNormEps = static_cast<float>(kFluxLayerNormEps);
constexpr float kQkNormEps = 1e-6f;  // BFL's QKNorm

constexpr int kChunk = kBf16Vector;  // elements a thread owns: one 16-byte vector of bf16
constexpr int kMaxThreads = 1024;
constexpr int64_t kMaxNormDim = int64_t{kChunk} * kMaxThreads;
constexpr int64_t kMaxHeadDim = int64_t{kChunk} * kWarpSize;
constexpr int64_t kMaxGridY = 65535;  // gridDim.y and gridDim.z

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Blocks of kernel that fit on the whole GPU at once, `threads` threads each.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads) {
  int per_sm = 0;
  FP8T_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  return int64_t{multiprocessor_count()} * std::max(per_sm, 1);
}

// --- Chunks: elements [i, i + 8) of a row of `count` elements ---
// kVector: one 16-byte access (count % 8 == 0 and 16-byte aligned rows, so a chunk that starts
// inside the row lies inside it); otherwise single accesses, reading zeros past the end.

template <bool kVector>
__device__ inline void load_chunk(const bf16* row, int64_t i, int64_t count,
                                  float (&values)[kChunk]) {
  if constexpr (kVector) {
    load_bf16x8(row + i, values);
  } else {
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      values[k] = i + k < count ? to_f32(row[i + k]) : 0.0f;
  }
}

template <bool kVector>
__device__ inline void load_chunk(const float* row, int64_t i, int64_t count,
                                  float (&values)[kChunk]) {
  if constexpr (kVector) {
    load_f32x8(row + i, values);
  } else {
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      values[k] = i + k < count ? row[i + k] : 0.0f;
  }
}

template <bool kVector>
__device__ inline void store_chunk(bf16* row, int64_t i, int64_t count,
                                   const float (&values)[kChunk]) {
  if constexpr (kVector) {
    store_bf16x8(row + i, values);
  } else {
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      if (i + k < count) row[i + k] = to_bf16(values[k]);
  }
}

// The cos or sin of a chunk's 4 pairs: entries [p, p + 4) of a table row of `count` pairs.
template <bool kVector>
__device__ inline void load_pairs(const float* row, int64_t p, int64_t count,
                                  float (&values)[kChunk / 2]) {
  if constexpr (kVector) {
    const float4 v = *reinterpret_cast<const float4*>(row + p);
    values[0] = v.x, values[1] = v.y, values[2] = v.z, values[3] = v.w;
  } else {
#pragma unroll
    for (int k = 0; k < kChunk / 2; ++k)
      values[k] = p + k < count ? row[p + k] : 0.0f;
  }
}

// Sums each of the kCount values over the block (whole warps, any number); every thread gets the
// same bits. Contains __syncthreads(): call from all threads.
template <int kCount>
__device__ inline void block_sums(float (&values)[kCount]) {
  __shared__ float warp_sums[kMaxThreads / kWarpSize][kCount];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
#pragma unroll
  for (int v = 0; v < kCount; ++v)
    values[v] = device::group_sum(values[v]);
  if (lane == 0) {
#pragma unroll
    for (int v = 0; v < kCount; ++v)
      warp_sums[warp][v] = values[v];
  }
  __syncthreads();
#pragma unroll
  for (int v = 0; v < kCount; ++v)
    values[v] = device::group_sum(lane < warps ? warp_sums[lane][v] : 0.0f);
  __syncthreads();  // warp_sums is reused by the next call
}

// --- Deterministic sums: partials [groups][parts][width] -> gradients ---

// Where the entries go: entry j < split of group g is added to first[g · stride + j], an entry
// j >= split to second[g · stride + j − split].
struct SumTargets {
  float* first;
  float* second;
  int64_t split;
  int64_t stride;
};

// A block takes 32 entries (one per lane, consecutive for coalescing) and its 32 warps the parts
// p ≡ warp (mod 32); the warps' sums are then added in warp order. All in double.
constexpr int kFinishEntries = kWarpSize;
constexpr int kFinishWarps = 32;
constexpr int kFinishThreads = kFinishEntries * kFinishWarps;

__global__ void __launch_bounds__(kFinishThreads)
    add_partials_kernel(const float* __restrict__ partials, int64_t groups, int64_t parts,
                        int64_t width, SumTargets targets) {
  __shared__ double warp_sums[kFinishWarps][kFinishEntries];
  const int lane = threadIdx.x % kFinishEntries;
  const int warp = threadIdx.x / kFinishEntries;
  const int64_t entry = int64_t(blockIdx.x) * kFinishEntries + lane;
  const bool valid = entry < groups * width;
  const int64_t group = valid ? entry / width : 0;
  const int64_t j = entry - group * width;
  double sum = 0.0;
  if (valid) {
    const float* column = partials + group * parts * width + j;
#pragma unroll 4
    for (int64_t p = warp; p < parts; p += kFinishWarps)
      sum += column[p * width];
  }
  warp_sums[warp][lane] = sum;
  __syncthreads();
  if (warp == 0 && valid) {
    double total = 0.0;
    for (int w = 0; w < kFinishWarps; ++w)
      total += warp_sums[w][lane];
    float* target = j < targets.split ? targets.first + group * targets.stride + j
                                      : targets.second + group * targets.stride + j - targets.split;
    *target += static_cast<float>(total);
  }
}

void add_partials(const float* partials, int64_t groups, int64_t parts, int64_t width,
                  const SumTargets& targets, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(ceil_div(groups * width, kFinishEntries));
  add_partials_kernel<<<blocks, kFinishThreads, 0, stream>>>(partials, groups, parts, width,
                                                             targets);
  FP8T_CUDA_CHECK_LAUNCH();
}

void check_workspace(const float* workspace, int64_t groups, int64_t width) {
  FP8T_CHECK(workspace != nullptr, "null workspace");
  FP8T_CHECK(groups * width <= kWorkspaceFloats,
             "expected a partial sum of {} x {} floats to fit the workspace of {} floats", groups,
             width, kWorkspaceFloats);
}

// Parts per group: enough blocks for `resident` (one full wave), within the rows and the
// workspace.
int64_t parts_per_group(int64_t resident, int64_t groups, int64_t blocks_per_part,
                        int64_t row_slices, int64_t partial_floats) {
  const int64_t fill = std::max<int64_t>(1, resident / (groups * blocks_per_part));
  const int64_t most = std::min(row_slices, kWorkspaceFloats / partial_floats);
  return std::max<int64_t>(1, std::min(fill, most));
}

// --- LayerNorm + modulation ---

// Threads per row: one per 8-element chunk, in whole warps.
int norm_threads(int64_t dim) {
  return static_cast<int>(ceil_div(ceil_div(dim, kChunk), kWarpSize) * kWarpSize);
}

// kCast: the FusedCast of out (vector path only), from its values as stored; kBlocks: with 1x128
// block scales.
template <bool kVector, bool kCast = false, bool kBlocks = false>
__global__ void __launch_bounds__(kMaxThreads)
    layernorm_modulate_forward_kernel(bf16* __restrict__ out, bf16* __restrict__ normed,
                                      float* __restrict__ rstd, const bf16* __restrict__ x,
                                      const bf16* __restrict__ shift,
                                      const bf16* __restrict__ scale, int64_t mod_stride,
                                      StreamShape shape, FusedCast cast) {
  static_assert(!kCast || kVector, "fused casts take the vector path");
  static_assert(!kBlocks || kCast, "block scales are a fused cast's");
  device::FusedCastState fp8(cast);
  const int64_t dim = shape.dim;
  const int64_t i = int64_t(threadIdx.x) * kChunk;
  const bool owner = i < dim;
  for (int64_t row = blockIdx.x; row < shape.batch * shape.tokens; row += gridDim.x) {
    const int64_t b = row / shape.tokens;
    const int64_t t = row - b * shape.tokens;
    float v[kChunk] = {};
    if (owner) load_chunk<kVector>(x + (b * shape.x_sample_rows + t) * dim, i, dim, v);
    float sum[1] = {0.0f};
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      sum[0] += v[k];
    block_sums(sum);
    const float mean = sum[0] / static_cast<float>(dim);
    // Two passes, as the CPU op: no cancellation for rows far from zero mean.
    float squares[1] = {0.0f};
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      const float d = v[k] - mean;
      if (owner && (kVector || i + k < dim)) squares[0] = fmaf(d, d, squares[0]);
    }
    block_sums(squares);
    const float row_rstd = 1.0f / sqrtf(squares[0] / static_cast<float>(dim) + kLayerNormEps);
    if (threadIdx.x == 0) rstd[row] = row_rstd;
    if (!owner) continue;
    float shift_v[kChunk], scale_v[kChunk];
    load_chunk<kVector>(shift + b * mod_stride, i, dim, shift_v);
    load_chunk<kVector>(scale + b * mod_stride, i, dim, scale_v);
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      v[k] = (v[k] - mean) * row_rstd;
      shift_v[k] = fmaf(v[k], 1.0f + scale_v[k], shift_v[k]);
    }
    store_chunk<kVector>(normed + row * dim, i, dim, v);
    store_chunk<kVector>(out + row * dim, i, dim, shift_v);
    if constexpr (kCast) {
#pragma unroll
      for (int k = 0; k < kChunk; ++k)
        shift_v[k] = to_f32(to_bf16(shift_v[k]));  // the values as stored
      uint8_t codes[kChunk];
      fp8.encode<kBlocks>(shift_v, codes, row, shape.batch * shape.tokens, i);
      if (cast.out != nullptr)
        *reinterpret_cast<uint2*>(cast.out + row * dim + i) = *reinterpret_cast<uint2*>(codes);
    }
  }
  if constexpr (kCast && !kBlocks) {
    if (cast.amax != nullptr) fp8.publish();
  }
}

// Block (part, b): tokens t ≡ part (mod parts) of sample b. Its partial: [2][dim] at
// (b · parts + part) · 2 dim, dshift's terms first.
template <bool kVector>
__global__ void __launch_bounds__(kMaxThreads)
    layernorm_modulate_backward_kernel(bf16* __restrict__ dx, float* __restrict__ partials,
                                       const bf16* __restrict__ dout,
                                       const bf16* __restrict__ normed,
                                       const float* __restrict__ rstd,
                                       const bf16* __restrict__ scale, int64_t mod_stride,
                                       StreamShape shape, bool add) {
  const int64_t dim = shape.dim;
  const int64_t b = blockIdx.y;
  const int64_t part = blockIdx.x;
  const int64_t parts = gridDim.x;
  const int64_t i = int64_t(threadIdx.x) * kChunk;
  const bool owner = i < dim;
  float one_plus_scale[kChunk] = {}, dshift[kChunk] = {}, dscale[kChunk] = {};
  if (owner) load_chunk<kVector>(scale + b * mod_stride, i, dim, one_plus_scale);
#pragma unroll
  for (int k = 0; k < kChunk; ++k)
    one_plus_scale[k] += 1.0f;
  for (int64_t t = part; t < shape.tokens; t += parts) {
    const int64_t row = b * shape.tokens + t;
    float dy[kChunk] = {}, n[kChunk] = {}, d[kChunk];
    if (owner) {
      load_chunk<kVector>(dout + row * dim, i, dim, dy);
      load_chunk<kVector>(normed + row * dim, i, dim, n);
    }
    float sums[2] = {0.0f, 0.0f};  // Σ d, Σ d · normed
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      d[k] = dy[k] * one_plus_scale[k];
      sums[0] += d[k];
      sums[1] = fmaf(d[k], n[k], sums[1]);
      dshift[k] += dy[k];
      dscale[k] = fmaf(dy[k], n[k], dscale[k]);
    }
    block_sums(sums);
    if (!owner) continue;
    const float mean_d = sums[0] / static_cast<float>(dim);
    const float mean_dn = sums[1] / static_cast<float>(dim);
    const float row_rstd = rstd[row];
    bf16* dx_row = dx + (b * shape.x_sample_rows + t) * dim;
    float g[kChunk] = {};
    if (add) load_chunk<kVector>(dx_row, i, dim, g);
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      g[k] += row_rstd * (d[k] - mean_d - n[k] * mean_dn);
    store_chunk<kVector>(dx_row, i, dim, g);
  }
  if (!owner) return;
  float* partial = partials + (b * parts + part) * 2 * dim;
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    if (kVector || i + k < dim) {
      partial[i + k] = dshift[k];
      partial[dim + i + k] = dscale[k];
    }
  }
}

void check_stream_shape(const StreamShape& shape) {
  FP8T_CHECK(shape.batch >= 0 && shape.tokens >= 0,
             "expected batch >= 0 and tokens >= 0, found {} and {}", shape.batch, shape.tokens);
  FP8T_CHECK(shape.dim >= 1, "expected dim >= 1, found {}", shape.dim);
  FP8T_CHECK(shape.x_sample_rows >= shape.tokens, "expected x_sample_rows >= tokens ({}), found {}",
             shape.tokens, shape.x_sample_rows);
}

void check_stride(const char* name, int64_t stride, int64_t dim) {
  FP8T_CHECK(stride >= dim, "expected {} >= dim ({}), found {}", name, dim, stride);
}

void check_norm_dim(int64_t dim) {
  FP8T_CHECK(dim <= kMaxNormDim,
             "expected dim <= {} (a chunk of 8 per thread of one block), found {}", kMaxNormDim,
             dim);
}

// --- Column sums over rows, by tiles of 256 columns × 16 rows ---

constexpr int kTileLanes = kWarpSize;  // threads across a tile, 8 columns each
constexpr int kTileRows = 16;          // threads down a tile
constexpr int kTileThreads = kTileLanes * kTileRows;
constexpr int64_t kTileColumns = int64_t{kTileLanes} * kChunk;

// Ops of the column sums that also take the amax of what they read: a member `float* amax`, the
// target (null: none taken), and apply(..., sums, amax_bits).
template <typename Op, typename = void>
constexpr bool kTakesAmax = false;
template <typename Op>
constexpr bool kTakesAmax<Op, std::void_t<decltype(Op::amax)>> = true;

// Block (tile, part, group): rows part · 16 + r, stepping 16 · parts, of the group's rows; thread
// (r, lane) takes the chunk at column tile · 256 + 8 lane. op.apply<kVector>(group, row, column,
// sums) adds a chunk's terms to sums (and writes the op's pointwise output). The 16 row lanes'
// sums are then added in order into the block's partial, cols floats at (group · parts + part)
// · cols.
template <typename Op, bool kVector>
__global__ void __launch_bounds__(kTileThreads)
    column_sums_kernel(Op op, int64_t rows, int64_t cols, float* __restrict__ partials) {
  __shared__ float row_sums[kTileRows][kTileColumns];
  const int lane = threadIdx.x % kTileLanes;
  const int row_lane = threadIdx.x / kTileLanes;
  const int64_t group = blockIdx.z;
  const int64_t part = blockIdx.y;
  const int64_t parts = gridDim.y;
  const int64_t tile_start = int64_t(blockIdx.x) * kTileColumns;
  const int64_t column = tile_start + lane * kChunk;
  float sums[kChunk] = {};
  FusedCast amax_only;
  if constexpr (kTakesAmax<Op>) amax_only.amax = op.amax;
  device::FusedCastState amax(amax_only);
  if (column < cols) {
    for (int64_t row = part * kTileRows + row_lane; row < rows; row += parts * kTileRows) {
      if constexpr (kTakesAmax<Op>) {
        op.template apply<kVector>(group, row, column, sums, amax.amax_bits);
      } else {
        op.template apply<kVector>(group, row, column, sums);
      }
    }
  }
  if constexpr (kTakesAmax<Op>) {
    if (op.amax != nullptr) amax.publish();  // the same for every thread of the block
  }
#pragma unroll
  for (int k = 0; k < kChunk; ++k)
    row_sums[row_lane][lane * kChunk + k] = sums[k];
  __syncthreads();
  const int64_t c = tile_start + threadIdx.x;
  if (threadIdx.x < kTileColumns && c < cols) {
    float total = 0.0f;
    for (int r = 0; r < kTileRows; ++r)
      total += row_sums[r][threadIdx.x];
    partials[(group * parts + part) * cols + c] = total;
  }
}

// Runs op over groups × [rows, cols] and adds the column sums into targets (width cols).
template <typename Op>
void launch_column_sums(const Op& op, bool vectorized, int64_t groups, int64_t rows, int64_t cols,
                        float* workspace, const SumTargets& targets, cudaStream_t stream) {
  check_workspace(workspace, groups, cols);
  FP8T_CHECK(groups <= kMaxGridY, "expected at most {} samples, found {}", kMaxGridY, groups);
  const auto kernel = vectorized ? column_sums_kernel<Op, true> : column_sums_kernel<Op, false>;
  const int64_t tiles = ceil_div(cols, kTileColumns);
  const int64_t parts = parts_per_group(resident_blocks(kernel, kTileThreads), groups, tiles,
                                        ceil_div(rows, kTileRows), groups * cols);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(parts),
                  static_cast<unsigned>(groups));
  kernel<<<grid, kTileThreads, 0, stream>>>(op, rows, cols, workspace);
  FP8T_CUDA_CHECK_LAUNCH();
  add_partials(workspace, groups, parts, cols, targets, stream);
}

// dbranch = gate · dx; the sums: dx · branch.
struct GatedResidualTerms {
  bf16* dbranch;
  const bf16* dx;
  const bf16* branch;
  const bf16* gate;
  int64_t mod_stride;
  StreamShape shape;

  template <bool kVector>
  __device__ void apply(int64_t b, int64_t t, int64_t column, float (&sums)[kChunk]) const {
    const int64_t dim = shape.dim;
    const int64_t row = b * shape.tokens + t;
    float g[kChunk], dy[kChunk], branch_v[kChunk];
    load_chunk<kVector>(gate + b * mod_stride, column, dim, g);
    load_chunk<kVector>(dx + (b * shape.x_sample_rows + t) * dim, column, dim, dy);
    load_chunk<kVector>(branch + row * dim, column, dim, branch_v);
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      sums[k] = fmaf(dy[k], branch_v[k], sums[k]);
      g[k] *= dy[k];
    }
    store_chunk<kVector>(dbranch + row * dim, column, dim, g);
  }
};

struct BiasTerms {
  const bf16* dy;
  int64_t cols;
  float* amax;

  template <bool kVector>
  __device__ void apply(int64_t, int64_t row, int64_t column, float (&sums)[kChunk],
                        uint32_t& amax_bits) const {
    float v[kChunk];
    load_chunk<kVector>(dy + row * cols, column, cols, v);
#pragma unroll
    for (int k = 0; k < kChunk; ++k) {
      sums[k] += v[k];
      amax_bits = max(amax_bits, abs_bits(v[k]));
    }
  }
};

// --- Pointwise over rows with row strides ---

// Grid-stride over [rows, cols]: each row's 16-byte vectors (vectorized: every row of every
// tensor 16-byte aligned), then its cols % 8 last elements one by one; op.apply<kWidth>(row,
// column) handles [column, column + kWidth). Ops with a member `float* amax` (kTakesAmax) also
// fold the magnitudes of what they store into apply's amax_bits, published to *amax (one atomic
// per block) when it is not null.
template <typename Op>
__global__ void __launch_bounds__(kPointwiseThreads)
    rows_pointwise_kernel(Op op, int64_t rows, int64_t cols, bool vectorized) {
  const int64_t vectors = vectorized ? cols / kBf16Vector : 0;
  const int64_t per_row = vectors + (cols - vectors * kBf16Vector);
  const int64_t items = rows * per_row;
  const int64_t stride = int64_t(gridDim.x) * kPointwiseThreads;
  FusedCast amax_only;
  if constexpr (kTakesAmax<Op>) amax_only.amax = op.amax;
  device::FusedCastState amax(amax_only);
  for (int64_t item = int64_t(blockIdx.x) * kPointwiseThreads + threadIdx.x; item < items;
       item += stride) {
    const int64_t row = item / per_row;
    const int64_t j = item - row * per_row;
    const bool vector = j < vectors;
    const int64_t column = vector ? j * kBf16Vector : vectors * kBf16Vector + (j - vectors);
    if constexpr (kTakesAmax<Op>) {
      if (vector) {
        op.template apply<kBf16Vector>(row, column, amax.amax_bits);
      } else {
        op.template apply<1>(row, column, amax.amax_bits);
      }
    } else if (vector) {
      op.template apply<kBf16Vector>(row, column);
    } else {
      op.template apply<1>(row, column);
    }
  }
  if constexpr (kTakesAmax<Op>) {
    if (op.amax != nullptr) amax.publish();  // the same for every thread of the block
  }
}

template <typename Op>
void launch_rows_pointwise(const Op& op, int64_t rows, int64_t cols, bool vectorized,
                           cudaStream_t stream) {
  const int64_t per_row = vectorized ? cols / kBf16Vector + cols % kBf16Vector : cols;
  const unsigned grid =
      device::grid_size(ceil_div(rows * per_row, kPointwiseThreads), device::kPointwiseBlocksPerSm);
  rows_pointwise_kernel<<<grid, kPointwiseThreads, 0, stream>>>(op, rows, cols, vectorized);
  FP8T_CUDA_CHECK_LAUNCH();
}

struct GatedResidualForward {
  bf16* x;
  const bf16* branch;
  const bf16* gate;
  int64_t mod_stride;
  StreamShape shape;

  template <int kWidth>
  __device__ void apply(int64_t row, int64_t column) const {
    const int64_t b = row / shape.tokens;
    const int64_t t = row - b * shape.tokens;
    bf16* x_at = x + (b * shape.x_sample_rows + t) * shape.dim + column;
    float x_v[kWidth], branch_v[kWidth], gate_v[kWidth];
    device::load_bf16(x_at, x_v);
    device::load_bf16(branch + row * shape.dim + column, branch_v);
    device::load_bf16(gate + b * mod_stride + column, gate_v);
#pragma unroll
    for (int k = 0; k < kWidth; ++k)
      x_v[k] = fmaf(gate_v[k], branch_v[k], x_v[k]);
    device::store_bf16(x_at, x_v);
  }
};

// tanh-GELU: gelu(x) = x/2 · (1 + tanh(u)), u = √(2/π) · (x + 0.044715 x³).
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluCubic = 0.044715f;

__device__ inline float gelu_tanh_of(float x) {
  return tanhf(kSqrt2OverPi * fmaf(kGeluCubic * x, x * x, x));
}

struct GeluForward {
  bf16* out;
  int64_t out_ld;
  const bf16* in;
  int64_t in_ld;
  float* amax;  // of the stored outputs; null: none taken

  template <int kWidth>
  __device__ void apply(int64_t row, int64_t column, uint32_t& amax_bits) const {
    float v[kWidth];
    device::load_bf16(in + row * in_ld + column, v);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      v[k] = 0.5f * v[k] * (1.0f + gelu_tanh_of(v[k]));
      amax_bits = max(amax_bits, abs_bits(round_to_bf16(v[k])));
    }
    device::store_bf16(out + row * out_ld + column, v);
  }
};

struct GeluBackward {
  bf16* din;
  int64_t din_ld;
  const bf16* dout;
  int64_t dout_ld;
  const bf16* in;
  int64_t in_ld;

  template <int kWidth>
  __device__ void apply(int64_t row, int64_t column) const {
    float x[kWidth], dy[kWidth];
    device::load_bf16(in + row * in_ld + column, x);
    device::load_bf16(dout + row * dout_ld + column, dy);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      const float t = gelu_tanh_of(x[k]);
      const float inner = kSqrt2OverPi * fmaf(3.0f * kGeluCubic * x[k], x[k], 1.0f);
      const float derivative = 0.5f * (1.0f + t) + 0.5f * x[k] * (1.0f - t * t) * inner;
      x[k] = derivative * dy[k];
    }
    device::store_bf16(din + row * din_ld + column, x);
  }
};

// Row r of the [samples · rows, width] copy: sample r / rows, its row r % rows, in each tensor.
struct RowCopy {
  SampleRows<bf16> dst;
  SampleRows<const bf16> src;
  int64_t rows;
  float* amax;  // of the copied values; null: none taken

  // |value| as fp32 bits (abs_bits) of a bf16's bits: the fp32's upper half without its sign.
  __device__ static uint32_t abs_bits_of(uint32_t bf16_bits) { return (bf16_bits & 0x7FFFu) << 16; }

  template <int kWidth>
  __device__ void apply(int64_t row, int64_t column, uint32_t& amax_bits) const {
    const int64_t sample = row / rows;
    const int64_t r = row - sample * rows;
    bf16* to = dst.data + (sample * dst.sample_rows + r) * dst.ld + column;
    const bf16* from = src.data + (sample * src.sample_rows + r) * src.ld + column;
    if constexpr (kWidth == kBf16Vector) {
      const uint4 values = *reinterpret_cast<const uint4*>(from);
      *reinterpret_cast<uint4*>(to) = values;
      const uint32_t pairs[4] = {values.x, values.y, values.z, values.w};
      for (const uint32_t pair : pairs)
        amax_bits = max(amax_bits, max(abs_bits_of(pair & 0xFFFFu), abs_bits_of(pair >> 16)));
    } else {
#pragma unroll
      for (int k = 0; k < kWidth; ++k) {
        to[k] = from[k];
        amax_bits = max(amax_bits, abs_bits_of(from[k].bits));
      }
    }
  }
};

// --- SiLU and the loss: pointwise over n contiguous elements (pointwise.cuh) ---

__device__ inline float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

struct SiluForward : device::PlainOp {
  bf16* out;
  const bf16* in;

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float v[kWidth];
    device::load_bf16(in + i, v);
#pragma unroll
    for (int k = 0; k < kWidth; ++k)
      v[k] *= sigmoid(v[k]);
    device::store_bf16(out + i, v);
  }
};

struct SiluBackward : device::PlainOp {
  bf16* din;
  const bf16* dout;
  const bf16* in;
  bool add;

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float x[kWidth], dy[kWidth], dx[kWidth] = {};
    device::load_bf16(in + i, x);
    device::load_bf16(dout + i, dy);
    if (add) device::load_bf16(din + i, dx);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      const float s = sigmoid(x[k]);
      dx[k] += dy[k] * s * fmaf(x[k], 1.0f - s, 1.0f);
    }
    device::store_bf16(din + i, dx);
  }
};

// The loss's partials: one double per block, kept as two floats (hi + lo) so that the fp32
// workspace needs no 8-byte alignment.
constexpr int64_t kLossMaxBlocks = 1024;

struct FlowMse {
  bf16* dpred;
  float* block_partials;  // [gridDim.x][2]
  const bf16* pred;
  const float* target;
  float factor;  // dloss · 2 / n
  double sum;

  __device__ void begin() { sum = 0.0; }

  template <int kWidth>
  __device__ void apply(int64_t i) {
    float p[kWidth], q[kWidth];
    device::load_bf16(pred + i, p);
    if constexpr (kWidth == kBf16Vector) {
      load_f32x8(target + i, q);
    } else {
      q[0] = target[i];
    }
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      const float difference = p[k] - q[k];
      sum += double(difference) * double(difference);
      p[k] = factor * difference;
    }
    device::store_bf16(dpred + i, p);
  }

  __device__ void end() {
    const double block = device::block_sum<kPointwiseThreads>(sum);
    if (threadIdx.x == 0) {
      const float high = static_cast<float>(block);
      block_partials[2 * blockIdx.x] = high;
      block_partials[2 * blockIdx.x + 1] = static_cast<float>(block - double(high));
    }
  }
};

constexpr int kLossFinishThreads = 256;

__global__ void __launch_bounds__(kLossFinishThreads)
    write_mean_loss_kernel(float* loss, const float* block_partials, int blocks, double n) {
  double sum = 0.0;
  for (int b = threadIdx.x; b < blocks; b += kLossFinishThreads)
    sum += double(block_partials[2 * b]) + double(block_partials[2 * b + 1]);
  sum = device::block_sum<kLossFinishThreads>(sum);
  if (threadIdx.x == 0) *loss = static_cast<float>(sum / n);
}

// --- QK norm + RoPE ---

constexpr int kQkThreads = 256;
constexpr int kQkWarps = kQkThreads / kWarpSize;

// Where a head of the stream is: item = (b · tokens + t) · heads + h.
struct QkHead {
  int64_t token_row;  // b · tokens + t: the raw row
  int64_t head;
  int64_t position;    // first + t: the table row
  int64_t joint_item;  // its head in the joint [batch, joint_tokens, heads]
};

__device__ inline QkHead qk_head(int64_t item, const JointRows& rows, int64_t heads) {
  QkHead where;
  where.token_row = item / heads;
  where.head = item - where.token_row * heads;
  const int64_t b = where.token_row / rows.tokens;
  where.position = rows.first + where.token_row - b * rows.tokens;
  where.joint_item = (b * rows.joint_tokens + where.position) * heads + where.head;
  return where;
}

// kGroup threads per head (a power of two, 8 kGroup >= head_dim); member m owns channels
// [8 m, 8 m + 8) when 8 m < head_dim. A warp takes 32 / kGroup heads at a time and loops while
// any of them exists, so that the group shuffles always see the whole warp.
template <int kGroup, bool kVector>
__global__ void __launch_bounds__(kQkThreads)
    qk_norm_rope_forward_kernel(bf16* __restrict__ out, bf16* __restrict__ normed,
                                float* __restrict__ rstd, const bf16* __restrict__ raw,
                                int64_t raw_ld, const float* __restrict__ scale,
                                const float* __restrict__ cos, const float* __restrict__ sin,
                                JointRows rows, int64_t heads, int64_t head_dim) {
  constexpr int kHeadsPerWarp = kWarpSize / kGroup;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t i = int64_t(lane % kGroup) * kChunk;
  const int64_t half = head_dim / 2;
  const int64_t items = rows.batch * rows.tokens * heads;
  const int64_t stride = int64_t(gridDim.x) * kQkWarps * kHeadsPerWarp;
  for (int64_t first_item =
           (int64_t(blockIdx.x) * kQkWarps + threadIdx.x / kWarpSize) * kHeadsPerWarp;
       first_item < items; first_item += stride) {
    const int64_t item = first_item + lane / kGroup;
    const bool active = item < items && i < head_dim;
    const QkHead where = qk_head(item, rows, heads);
    float x[kChunk] = {};
    if (active)
      load_chunk<kVector>(raw + where.token_row * raw_ld + where.head * head_dim, i, head_dim, x);
    float squares = 0.0f;
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      squares = fmaf(x[k], x[k], squares);
    squares = device::group_sum<kGroup>(squares);
    const float head_rstd = 1.0f / sqrtf(squares / static_cast<float>(head_dim) + kQkNormEps);
    if (!active) continue;
    float scale_v[kChunk], c[kChunk / 2], s[kChunk / 2], y[kChunk];
    load_chunk<kVector>(scale, i, head_dim, scale_v);
    load_pairs<kVector>(cos + where.position * half, i / 2, half, c);
    load_pairs<kVector>(sin + where.position * half, i / 2, half, s);
#pragma unroll
    for (int p = 0; p < kChunk / 2; ++p) {
      x[2 * p] *= head_rstd;
      x[2 * p + 1] *= head_rstd;
      const float a = x[2 * p] * scale_v[2 * p];
      const float b = x[2 * p + 1] * scale_v[2 * p + 1];
      y[2 * p] = fmaf(a, c[p], -b * s[p]);
      y[2 * p + 1] = fmaf(a, s[p], b * c[p]);
    }
    store_chunk<kVector>(normed + where.joint_item * head_dim, i, head_dim, x);
    store_chunk<kVector>(out + where.joint_item * head_dim, i, head_dim, y);
    if (i == 0) rstd[where.joint_item] = head_rstd;
  }
}

// As the forward; each thread adds its channels' dscale terms in registers, and the block's
// partial (head_dim floats at blockIdx.x · head_dim) adds its groups in a fixed order.
template <int kGroup, bool kVector>
__global__ void __launch_bounds__(kQkThreads)
    qk_norm_rope_backward_kernel(bf16* __restrict__ draw, int64_t draw_ld,
                                 float* __restrict__ partials, const bf16* __restrict__ dout,
                                 const bf16* __restrict__ normed, const float* __restrict__ rstd,
                                 const float* __restrict__ scale, const float* __restrict__ cos,
                                 const float* __restrict__ sin, JointRows rows, int64_t heads,
                                 int64_t head_dim) {
  constexpr int kHeadsPerWarp = kWarpSize / kGroup;
  __shared__ float warp_sums[kQkWarps][kMaxHeadDim];
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t i = int64_t(lane % kGroup) * kChunk;
  const int64_t half = head_dim / 2;
  const int64_t items = rows.batch * rows.tokens * heads;
  const int64_t stride = int64_t(gridDim.x) * kQkWarps * kHeadsPerWarp;
  float scale_v[kChunk] = {}, dscale[kChunk] = {};
  if (i < head_dim) load_chunk<kVector>(scale, i, head_dim, scale_v);
  for (int64_t first_item = (int64_t(blockIdx.x) * kQkWarps + warp) * kHeadsPerWarp;
       first_item < items; first_item += stride) {
    const int64_t item = first_item + lane / kGroup;
    const bool active = item < items && i < head_dim;
    const QkHead where = qk_head(item, rows, heads);
    float g[kChunk] = {}, n[kChunk] = {}, c[kChunk / 2] = {}, s[kChunk / 2] = {};
    if (active) {
      load_chunk<kVector>(dout + where.joint_item * head_dim, i, head_dim, g);
      load_chunk<kVector>(normed + where.joint_item * head_dim, i, head_dim, n);
      load_pairs<kVector>(cos + where.position * half, i / 2, half, c);
      load_pairs<kVector>(sin + where.position * half, i / 2, half, s);
    }
    // The inverse rotation, then dscale's terms and the gradient of normed.
    float dn[kChunk];
    float dot = 0.0f;
#pragma unroll
    for (int p = 0; p < kChunk / 2; ++p) {
      const float d0 = fmaf(g[2 * p], c[p], g[2 * p + 1] * s[p]);
      const float d1 = fmaf(-g[2 * p], s[p], g[2 * p + 1] * c[p]);
      dscale[2 * p] = fmaf(d0, n[2 * p], dscale[2 * p]);
      dscale[2 * p + 1] = fmaf(d1, n[2 * p + 1], dscale[2 * p + 1]);
      dn[2 * p] = d0 * scale_v[2 * p];
      dn[2 * p + 1] = d1 * scale_v[2 * p + 1];
      dot = fmaf(dn[2 * p], n[2 * p], fmaf(dn[2 * p + 1], n[2 * p + 1], dot));
    }
    const float mean = device::group_sum<kGroup>(dot) / static_cast<float>(head_dim);
    if (!active) continue;
    const float head_rstd = rstd[where.joint_item];
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      dn[k] = head_rstd * fmaf(-n[k], mean, dn[k]);
    store_chunk<kVector>(draw + where.token_row * draw_ld + where.head * head_dim, i, head_dim, dn);
  }
  // The groups of a warp own the same channels: a butterfly over them (the same bits in each),
  // then the warps in order.
#pragma unroll
  for (int offset = kGroup; offset < kWarpSize; offset *= 2) {
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      dscale[k] += __shfl_xor_sync(kFullMask, dscale[k], offset);
  }
  if (lane < kGroup && i < head_dim) {
#pragma unroll
    for (int k = 0; k < kChunk; ++k)
      warp_sums[warp][i + k] = dscale[k];
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < head_dim; j += kQkThreads) {
    float total = 0.0f;
    for (int w = 0; w < kQkWarps; ++w)
      total += warp_sums[w][j];
    partials[int64_t(blockIdx.x) * head_dim + j] = total;
  }
}

void check_joint_rows(const JointRows& rows, int64_t heads, int64_t head_dim, int64_t ld,
                      const char* ld_name) {
  FP8T_CHECK(rows.batch >= 0 && rows.tokens >= 0,
             "expected batch >= 0 and tokens >= 0, found {} and {}", rows.batch, rows.tokens);
  FP8T_CHECK(rows.first >= 0 && rows.first + rows.tokens <= rows.joint_tokens,
             "expected the stream's rows [{}, {}) inside the joint sequence's {} rows", rows.first,
             rows.first + rows.tokens, rows.joint_tokens);
  FP8T_CHECK(heads >= 1, "expected heads >= 1, found {}", heads);
  FP8T_CHECK(head_dim >= 2 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim,
             "expected an even head_dim in [2, {}], found {}", kMaxHeadDim, head_dim);
  FP8T_CHECK(ld >= heads * head_dim, "expected {} >= heads * head_dim ({}), found {}", ld_name,
             heads * head_dim, ld);
}

// Calls launch(std::integral_constant<int, kGroup>{}) with the group size for head_dim.
template <typename Launch>
void with_head_group(int64_t head_dim, Launch&& launch) {
  const int64_t chunks = ceil_div(head_dim, kChunk);
  if (chunks <= 1) {
    launch(std::integral_constant<int, 1>{});
  } else if (chunks <= 2) {
    launch(std::integral_constant<int, 2>{});
  } else if (chunks <= 4) {
    launch(std::integral_constant<int, 4>{});
  } else if (chunks <= 8) {
    launch(std::integral_constant<int, 8>{});
  } else if (chunks <= 16) {
    launch(std::integral_constant<int, 16>{});
  } else {
    launch(std::integral_constant<int, 32>{});
  }
}

}  // namespace

int64_t flux_reduction_workspace_floats() {
  return kWorkspaceFloats;
}

int64_t flux_max_batch(int64_t dim) {
  FP8T_CHECK(dim >= 1, "expected a hidden size >= 1, found {}", dim);
  return std::min(kMaxGridY, kWorkspaceFloats / (2 * dim));
}

void layernorm_modulate_forward(bf16* out, bf16* normed, float* rstd, const bf16* x,
                                const bf16* shift, const bf16* scale, int64_t mod_stride,
                                const StreamShape& shape, cudaStream_t stream,
                                const FusedCast& cast) {
  check_stream_shape(shape);
  check_norm_dim(shape.dim);
  check_stride("mod_stride", mod_stride, shape.dim);
  const int64_t rows = shape.batch * shape.tokens;
  check_pointers(rows, {out, normed, rstd, x, shift, scale});
  const bool fused = cast.out != nullptr || cast.amax != nullptr;
  const bool blocks = cast.block_scales != nullptr;
  const bool vectorized = shape.dim % kChunk == 0 && mod_stride % kChunk == 0 &&
                          all_aligned({out, normed, x, shift, scale}) &&
                          reinterpret_cast<uintptr_t>(cast.out) % kChunk == 0;
  device::check_fused_cast(cast, shape.dim, vectorized);
  FP8T_CHECK(!fused || vectorized,
             "a fused cast needs a dim that is a multiple of {} and 16-byte aligned rows, found "
             "dim {}",
             kChunk, shape.dim);
  if (rows == 0) return;
  const int threads = norm_threads(shape.dim);
  const auto kernel = blocks       ? layernorm_modulate_forward_kernel<true, true, true>
                      : fused      ? layernorm_modulate_forward_kernel<true, true>
                      : vectorized ? layernorm_modulate_forward_kernel<true>
                                   : layernorm_modulate_forward_kernel<false>;
  // A block per row, up to the 32 blocks an SM can hold at once.
  const unsigned grid = device::grid_size(rows, 32);
  kernel<<<grid, threads, 0, stream>>>(out, normed, rstd, x, shift, scale, mod_stride, shape, cast);
  FP8T_CUDA_CHECK_LAUNCH();
}

void layernorm_modulate_backward(bf16* dx, float* dshift, float* dscale, int64_t dmod_stride,
                                 const bf16* dout, const bf16* normed, const float* rstd,
                                 const bf16* scale, int64_t mod_stride, const StreamShape& shape,
                                 GradStore store, float* workspace, cudaStream_t stream) {
  check_stream_shape(shape);
  check_norm_dim(shape.dim);
  check_stride("mod_stride", mod_stride, shape.dim);
  check_stride("dmod_stride", dmod_stride, shape.dim);
  const int64_t rows = shape.batch * shape.tokens;
  check_pointers(rows, {dx, dshift, dscale, dout, normed, rstd, scale, workspace});
  if (rows == 0) return;
  const int64_t width = 2 * shape.dim;
  check_workspace(workspace, shape.batch, width);
  FP8T_CHECK(shape.batch <= kMaxGridY, "expected at most {} samples, found {}", kMaxGridY,
             shape.batch);
  const int threads = norm_threads(shape.dim);
  const bool vectorized =
      shape.dim % kChunk == 0 && mod_stride % kChunk == 0 && all_aligned({dx, dout, normed, scale});
  const auto kernel = vectorized ? layernorm_modulate_backward_kernel<true>
                                 : layernorm_modulate_backward_kernel<false>;
  const int64_t parts = parts_per_group(resident_blocks(kernel, threads), shape.batch, 1,
                                        shape.tokens, shape.batch * width);
  const dim3 grid(static_cast<unsigned>(parts), static_cast<unsigned>(shape.batch));
  kernel<<<grid, threads, 0, stream>>>(dx, workspace, dout, normed, rstd, scale, mod_stride, shape,
                                       store == GradStore::Add);
  FP8T_CUDA_CHECK_LAUNCH();
  add_partials(workspace, shape.batch, parts, width, {dshift, dscale, shape.dim, dmod_stride},
               stream);
}

void gated_residual_forward(bf16* x, const bf16* branch, const bf16* gate, int64_t mod_stride,
                            const StreamShape& shape, cudaStream_t stream) {
  check_stream_shape(shape);
  check_stride("mod_stride", mod_stride, shape.dim);
  const int64_t rows = shape.batch * shape.tokens;
  check_pointers(rows, {x, branch, gate});
  if (rows == 0) return;
  GatedResidualForward op{x, branch, gate, mod_stride, shape};
  const bool vectorized =
      shape.dim % kChunk == 0 && mod_stride % kChunk == 0 && all_aligned({x, branch, gate});
  launch_rows_pointwise(op, rows, shape.dim, vectorized, stream);
}

void gated_residual_backward(bf16* dbranch, float* dgate, int64_t dmod_stride, const bf16* dx,
                             const bf16* branch, const bf16* gate, int64_t mod_stride,
                             const StreamShape& shape, float* workspace, cudaStream_t stream) {
  check_stream_shape(shape);
  check_stride("mod_stride", mod_stride, shape.dim);
  check_stride("dmod_stride", dmod_stride, shape.dim);
  const int64_t rows = shape.batch * shape.tokens;
  check_pointers(rows, {dbranch, dgate, dx, branch, gate, workspace});
  if (rows == 0) return;
  GatedResidualTerms op{dbranch, dx, branch, gate, mod_stride, shape};
  const bool vectorized = shape.dim % kChunk == 0 && mod_stride % kChunk == 0 &&
                          all_aligned({dbranch, dx, branch, gate});
  launch_column_sums(op, vectorized, shape.batch, shape.tokens, shape.dim, workspace,
                     {dgate, nullptr, shape.dim, dmod_stride}, stream);
}

namespace {

void check_rows_cols(int64_t rows, int64_t cols) {
  FP8T_CHECK(rows >= 0 && cols >= 0, "expected rows >= 0 and cols >= 0, found {} and {}", rows,
             cols);
}

// The row-strided vector path's condition: every row of every tensor 16-byte aligned.
bool rows_aligned(int64_t rows, std::initializer_list<const void*> pointers,
                  std::initializer_list<int64_t> lds) {
  if (!all_aligned(pointers)) return false;
  return rows == 1 ||
         std::all_of(lds.begin(), lds.end(), [](int64_t ld) { return ld % kBf16Vector == 0; });
}

}  // namespace

void copy_rows(const SampleRows<bf16>& dst, const SampleRows<const bf16>& src, int64_t samples,
               int64_t rows, int64_t width, cudaStream_t stream, float* amax) {
  FP8T_CHECK(samples >= 0, "expected samples >= 0, found {}", samples);
  check_rows_cols(rows, width);
  check_stride("dst.ld", dst.ld, width);
  check_stride("src.ld", src.ld, width);
  FP8T_CHECK(samples <= 1 || (dst.sample_rows >= rows && src.sample_rows >= rows),
             "expected sample strides of at least {} rows, found {} (dst) and {} (src)", rows,
             dst.sample_rows, src.sample_rows);
  check_pointers(samples * rows * width, {dst.data, src.data});
  if (samples * rows * width == 0) return;
  const bool vectorized = rows_aligned(samples * rows, {dst.data, src.data}, {dst.ld, src.ld});
  launch_rows_pointwise(RowCopy{dst, src, rows, amax}, samples * rows, width, vectorized, stream);
}

void gelu_tanh_forward(bf16* out, int64_t out_ld, const bf16* in, int64_t in_ld, int64_t rows,
                       int64_t cols, cudaStream_t stream, float* amax) {
  check_rows_cols(rows, cols);
  check_stride("out_ld", out_ld, cols);
  check_stride("in_ld", in_ld, cols);
  check_pointers(rows * cols, {out, in});
  if (rows * cols == 0) return;
  // Contiguous rows are one long row: vectors run across the row ends.
  if (out_ld == cols && in_ld == cols) {
    cols *= rows;
    rows = 1;
  }
  const bool vectorized = rows_aligned(rows, {out, in}, {out_ld, in_ld});
  launch_rows_pointwise(GeluForward{out, out_ld, in, in_ld, amax}, rows, cols, vectorized, stream);
}

void gelu_tanh_backward(bf16* din, int64_t din_ld, const bf16* dout, int64_t dout_ld,
                        const bf16* in, int64_t in_ld, int64_t rows, int64_t cols,
                        cudaStream_t stream) {
  check_rows_cols(rows, cols);
  check_stride("din_ld", din_ld, cols);
  check_stride("dout_ld", dout_ld, cols);
  check_stride("in_ld", in_ld, cols);
  check_pointers(rows * cols, {din, dout, in});
  if (rows * cols == 0) return;
  if (din_ld == cols && dout_ld == cols && in_ld == cols) {
    cols *= rows;
    rows = 1;
  }
  const bool vectorized = rows_aligned(rows, {din, dout, in}, {din_ld, dout_ld, in_ld});
  launch_rows_pointwise(GeluBackward{din, din_ld, dout, dout_ld, in, in_ld}, rows, cols, vectorized,
                        stream);
}

void silu_forward(bf16* out, const bf16* in, int64_t n, cudaStream_t stream) {
  device::check_pointwise_args(n, {out, in});
  if (n == 0) return;
  SiluForward op;
  op.out = out;
  op.in = in;
  device::launch_pointwise(op, n, all_aligned({out, in}), stream);
}

void silu_backward(bf16* din, const bf16* dout, const bf16* in, int64_t n, GradStore store,
                   cudaStream_t stream) {
  device::check_pointwise_args(n, {din, dout, in});
  if (n == 0) return;
  SiluBackward op;
  op.din = din;
  op.dout = dout;
  op.in = in;
  op.add = store == GradStore::Add;
  device::launch_pointwise(op, n, all_aligned({din, dout, in}), stream);
}

void qk_norm_rope_forward(bf16* out, bf16* normed, float* rstd, const bf16* raw, int64_t raw_ld,
                          const float* scale, const float* cos, const float* sin,
                          const JointRows& rows, int64_t heads, int64_t head_dim,
                          cudaStream_t stream) {
  check_joint_rows(rows, heads, head_dim, raw_ld, "raw_ld");
  const int64_t items = rows.batch * rows.tokens * heads;
  check_pointers(items, {out, normed, rstd, raw, scale, cos, sin});
  if (items == 0) return;
  const bool vectorized = head_dim % kChunk == 0 && raw_ld % kChunk == 0 &&
                          all_aligned({out, normed, raw, scale, cos, sin});
  with_head_group(head_dim, [&](auto group) {
    constexpr int kGroup = decltype(group)::value;
    const auto kernel = vectorized ? qk_norm_rope_forward_kernel<kGroup, true>
                                   : qk_norm_rope_forward_kernel<kGroup, false>;
    const int64_t heads_per_block = kQkThreads / kGroup;
    const unsigned grid =
        device::grid_size(ceil_div(items, heads_per_block), device::kPointwiseBlocksPerSm);
    kernel<<<grid, kQkThreads, 0, stream>>>(out, normed, rstd, raw, raw_ld, scale, cos, sin, rows,
                                            heads, head_dim);
  });
  FP8T_CUDA_CHECK_LAUNCH();
}

void qk_norm_rope_backward(bf16* draw, int64_t draw_ld, float* dscale, const bf16* dout,
                           const bf16* normed, const float* rstd, const float* scale,
                           const float* cos, const float* sin, const JointRows& rows, int64_t heads,
                           int64_t head_dim, float* workspace, cudaStream_t stream) {
  check_joint_rows(rows, heads, head_dim, draw_ld, "draw_ld");
  const int64_t items = rows.batch * rows.tokens * heads;
  check_pointers(items, {draw, dscale, dout, normed, rstd, scale, cos, sin, workspace});
  if (items == 0) return;
  check_workspace(workspace, 1, head_dim);
  const bool vectorized = head_dim % kChunk == 0 && draw_ld % kChunk == 0 &&
                          all_aligned({draw, dout, normed, scale, cos, sin});
  int64_t parts = 0;
  with_head_group(head_dim, [&](auto group) {
    constexpr int kGroup = decltype(group)::value;
    const auto kernel = vectorized ? qk_norm_rope_backward_kernel<kGroup, true>
                                   : qk_norm_rope_backward_kernel<kGroup, false>;
    const int64_t heads_per_block = kQkThreads / kGroup;
    parts = std::min({ceil_div(items, heads_per_block), resident_blocks(kernel, kQkThreads),
                      kWorkspaceFloats / head_dim});
    kernel<<<static_cast<unsigned>(parts), kQkThreads, 0, stream>>>(
        draw, draw_ld, workspace, dout, normed, rstd, scale, cos, sin, rows, heads, head_dim);
  });
  FP8T_CUDA_CHECK_LAUNCH();
  add_partials(workspace, 1, parts, head_dim, {dscale, nullptr, head_dim, 0}, stream);
}

void bias_backward(float* dbias, const bf16* dy, int64_t rows, int64_t cols, float* workspace,
                   cudaStream_t stream, float* amax) {
  check_rows_cols(rows, cols);
  FP8T_CHECK(cols >= 1, "expected cols >= 1, found {}", cols);
  check_pointers(rows, {dbias, dy, workspace});
  if (rows == 0) return;
  const bool vectorized = cols % kChunk == 0 && device::aligned16(dy);
  launch_column_sums(BiasTerms{dy, cols, amax}, vectorized, 1, rows, cols, workspace,
                     {dbias, nullptr, cols, 0}, stream);
}

void flow_mse_forward_backward(float* loss, bf16* dpred, const bf16* pred, const float* target,
                               int64_t n, float dloss, float* workspace, cudaStream_t stream) {
  FP8T_CHECK(n >= 1, "expected n >= 1, found {}", n);
  check_pointers(n, {loss, dpred, pred, target, workspace});
  FlowMse op{};
  op.dpred = dpred;
  op.block_partials = workspace;
  op.pred = pred;
  op.target = target;
  op.factor = static_cast<float>(2.0 * double(dloss) / static_cast<double>(n));
  const unsigned blocks = device::launch_pointwise_partials(
      op, n, all_aligned({dpred, pred, target}), kLossMaxBlocks, stream);
  write_mean_loss_kernel<<<1, kLossFinishThreads, 0, stream>>>(
      loss, workspace, static_cast<int>(blocks), static_cast<double>(n));
  FP8T_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8t::ops::cuda
