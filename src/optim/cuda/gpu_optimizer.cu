// Kernels of the GPT's GPU optimizer (gpu_optimizer.h): AdamW over many tensors at once, the
// elementwise and reduction steps of Muon around its batched GEMMs, the gradient norm and the
// clipping. The fp32 arithmetic is written with the _rn intrinsics, which nvcc never contracts
// into FMAs: every value rounds where the CPU reference (built without contraction) rounds it,
// so AdamW matches adamw_step bit for bit and Muon differs only through its GEMMs' sums.
// Sums of squares accumulate in double (products of two floats are exact in double) and are
// reduced in a fixed order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "core/cuda_check.h"
#include "core/error.h"
#include "ops/cuda/ops_cuda.h"
#include "optim/cuda/gpu_optimizer.h"

namespace fp8t::optim::cuda {
namespace {

namespace device = ops::cuda::device;

constexpr int kThreads = 256;      // elementwise passes and per-matrix reductions
constexpr int kLineThreads = 128;  // one block per row, or one thread per column
constexpr int kBlocksPerSm = 8;
constexpr int64_t kMaxMatrices = 65535;  // the grid's y dimension
// Elements a block of the norm's first pass takes at least, before the grid reaches
// kNormPartials blocks: the grid depends only on the element count, never on the GPU.
constexpr int64_t kNormBlockElements = int64_t{kThreads} * 16;

// torch.lerp in its two forms, as muon.cpp computes it.
__device__ inline float torch_lerp(float start, float end, float weight) {
  const float difference = __fsub_rn(end, start);
  return fabsf(weight) < 0.5f ? __fadd_rn(start, __fmul_rn(weight, difference))
                              : __fsub_rn(end, __fmul_rn(difference, __fsub_rn(1.0f, weight)));
}

// ---- AdamW ----

// AdamW and the Muon passes take vectors of kWidth elements: 8 (one 16-byte access of bf16, two
// of fp32) where the data is whole vectors and every pointer 16-byte aligned, else 1. The bytes
// limit these passes; single bf16 accesses reached about half the copy rate.
template <int kWidth>
__device__ inline void load_floats(const float* source, float (&values)[kWidth]) {
  if constexpr (kWidth == device::kBf16Vector) {
    device::load_f32x8(source, values);
  } else {
    values[0] = *source;
  }
}

template <int kWidth>
__device__ inline void store_floats(float* destination, const float (&values)[kWidth]) {
  if constexpr (kWidth == device::kBf16Vector) {
    *reinterpret_cast<float4*>(destination) =
        make_float4(values[0], values[1], values[2], values[3]);
    *reinterpret_cast<float4*>(destination + 4) =
        make_float4(values[4], values[5], values[6], values[7]);
  } else {
    *destination = values[0];
  }
}

// adamw_step's fp32 arithmetic on one element; returns the new parameter.
__device__ inline float adamw_element(float param, float grad, float& m, float& v,
                                      const AdamWScalars& h) {
  m = __fadd_rn(m, __fmul_rn(h.weight1, __fsub_rn(grad, m)));
  v = __fadd_rn(v, __fmul_rn(h.weight2, __fsub_rn(__fmul_rn(grad, grad), v)));
  const float denominator = __fadd_rn(__fsqrt_rn(__fmul_rn(v, h.inv_bias2)), h.eps);
  return __fsub_rn(__fmul_rn(param, h.decay), __fmul_rn(h.step_size, __fdiv_rn(m, denominator)));
}

// Whether an AdamW chunk takes vectors: whole vectors of 8 elements at 16-byte aligned addresses
// (the layouts align every chunk to 16 bytes; a tensor's last chunk may hold a part vector).
__device__ inline bool takes_chunk_vectors(int32_t count, const void* param, const void* grad,
                                           const void* m, const void* v) {
  const auto address = [](const void* pointer) { return reinterpret_cast<uintptr_t>(pointer); };
  return count % device::kBf16Vector == 0 &&
         ((address(param) | address(grad) | address(m) | address(v)) % 16) == 0;
}

// Eight elements per thread and access (two 16-byte accesses per array) where the chunk takes
// vectors: the bytes limit this kernel. With chunk_amax, each block also stores the amax bits of
// its chunk's new values there, at its own index.
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* params, const float* grads, float* exp_avg, float* exp_avg_sq,
                 const AdamWChunk* chunks, AdamWStep step, uint32_t* chunk_amax) {
  constexpr int kWidth = device::kBf16Vector;
  const AdamWChunk chunk = chunks[blockIdx.x];
  const AdamWScalars h = step.groups[chunk.group];
  float* param = params + chunk.param;
  const float* grad = grads + chunk.grad;
  float* m = exp_avg + chunk.state;
  float* v = exp_avg_sq + chunk.state;
  uint32_t amax_bits = 0;
  if (!takes_chunk_vectors(chunk.count, param, grad, m, v)) {
    for (int i = threadIdx.x; i < chunk.count; i += kThreads) {
      param[i] = adamw_element(param[i], grad[i], m[i], v[i], h);
      amax_bits = max(amax_bits, abs_bits(param[i]));
    }
  } else {
    for (int i = threadIdx.x * kWidth; i < chunk.count; i += kThreads * kWidth) {
      float p8[kWidth], g8[kWidth], m8[kWidth], v8[kWidth];
      load_floats<kWidth>(param + i, p8);
      load_floats<kWidth>(grad + i, g8);
      load_floats<kWidth>(m + i, m8);
      load_floats<kWidth>(v + i, v8);
#pragma unroll
      for (int k = 0; k < kWidth; ++k) {
        p8[k] = adamw_element(p8[k], g8[k], m8[k], v8[k], h);
        amax_bits = max(amax_bits, abs_bits(p8[k]));
      }
      store_floats<kWidth>(param + i, p8);
      store_floats<kWidth>(m + i, m8);
      store_floats<kWidth>(v + i, v8);
    }
  }
  if (chunk_amax == nullptr) return;
  const uint32_t block = block_max_bits(amax_bits);
  if (threadIdx.x == 0) chunk_amax[blockIdx.x] = block;
}

// One block per tensor: the largest of its chunks' amax bits, as the float it is, into its slot.
__global__ void __launch_bounds__(kThreads)
    tensor_amax_kernel(const TensorAmax* tensors, const uint32_t* chunk_amax) {
  const TensorAmax tensor = tensors[blockIdx.x];
  uint32_t amax_bits = 0;
  for (int64_t i = threadIdx.x; i < tensor.chunks; i += kThreads)
    amax_bits = max(amax_bits, chunk_amax[tensor.first_chunk + i]);
  const uint32_t block = block_max_bits(amax_bits);
  if (threadIdx.x == 0) *tensor.amax = bits_to_float(block);
}

// Parameters and moments stored in bf16: the step in fp32 from the values they hold, each result
// rounded once. Eight elements per thread and access where the chunk takes vectors, the bytes
// being what limits this kernel.
__global__ void __launch_bounds__(kThreads)
    adamw_bf16_kernel(bf16* params, const float* grads, bf16* exp_avg, bf16* exp_avg_sq,
                      const AdamWChunk* chunks, AdamWStep step) {
  using device::kBf16Vector;
  const AdamWChunk chunk = chunks[blockIdx.x];
  const AdamWScalars h = step.groups[chunk.group];
  bf16* param = params + chunk.param;
  const float* grad = grads + chunk.grad;
  bf16* m = exp_avg + chunk.state;
  bf16* v = exp_avg_sq + chunk.state;
  if (!takes_chunk_vectors(chunk.count, param, grad, m, v)) {
    for (int i = threadIdx.x; i < chunk.count; i += kThreads) {
      float m_i = to_float(m[i]), v_i = to_float(v[i]);
      param[i] = float_to_bf16(adamw_element(to_float(param[i]), grad[i], m_i, v_i, h));
      m[i] = float_to_bf16(m_i);
      v[i] = float_to_bf16(v_i);
    }
    return;
  }
  for (int i = threadIdx.x * kBf16Vector; i < chunk.count; i += kThreads * kBf16Vector) {
    float p8[kBf16Vector], g8[kBf16Vector], m8[kBf16Vector], v8[kBf16Vector];
    device::load_bf16x8(param + i, p8);
    device::load_f32x8(grad + i, g8);
    device::load_bf16x8(m + i, m8);
    device::load_bf16x8(v + i, v8);
#pragma unroll
    for (int k = 0; k < kBf16Vector; ++k)
      p8[k] = adamw_element(p8[k], g8[k], m8[k], v8[k], h);
    device::store_bf16x8(param + i, p8);
    device::store_bf16x8(m + i, m8);
    device::store_bf16x8(v + i, v8);
  }
}

// ---- Muon ----

// Elementwise passes over `vectors` vectors of each matrix: blockIdx.y is the matrix, the x
// blocks stride over its vectors.
dim3 matrix_grid(int64_t vectors, int64_t count) {
  const int64_t blocks = (vectors + kThreads - 1) / kThreads;
  const int64_t total = device::grid_size(blocks * count, kBlocksPerSm);
  const int64_t per_matrix = std::max<int64_t>(1, std::min(blocks, total / count));
  return dim3(static_cast<unsigned>(per_matrix), static_cast<unsigned>(count));
}

__device__ inline int64_t first_element() {
  return int64_t(blockIdx.x) * kThreads + threadIdx.x;
}
__device__ inline int64_t element_stride() {
  return int64_t(gridDim.x) * kThreads;
}

__device__ inline float factor_of(const float* matrix_factors, int64_t matrix) {
  return matrix_factors != nullptr ? matrix_factors[matrix] : 1.0f;
}

// Grid (rows, count): one block per row. Step 1 and the new rows' sums of squares in one pass.
template <int kWidth>
__global__ void __launch_bounds__(kLineThreads)
    nesterov_kernel(bf16* update, double* row_squares, float* momentum, const float* grads,
                    const int64_t* offsets, MuonShape shape, float mu, float momentum_weight) {
  const int64_t matrix = blockIdx.y, row = blockIdx.x;
  const int64_t first = row * shape.cols;
  const float* grad = grads + offsets[matrix] + first;
  float* buffer = momentum + matrix * shape.rows * shape.cols + first;
  bf16* out = update + matrix * shape.stride + first;
  double sum = 0.0;
  for (int64_t c = threadIdx.x * kWidth; c < shape.cols; c += kLineThreads * kWidth) {
    float g[kWidth], m[kWidth], u[kWidth];
    load_floats<kWidth>(grad + c, g);
    load_floats<kWidth>(buffer + c, m);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      m[k] = torch_lerp(m[k], g[k], momentum_weight);
      u[k] = torch_lerp(g[k], m[k], mu);
      const float stored = round_to_bf16(u[k]);
      sum += double(stored) * double(stored);
    }
    store_floats<kWidth>(buffer + c, m);
    device::store_bf16<kWidth>(out + c, u);
  }
  sum = device::block_sum<kLineThreads>(sum);
  if (threadIdx.x == 0) row_squares[matrix * shape.rows + row] = sum;
}

// Grid (rows, count): one block per row.
template <int kWidth>
__global__ void __launch_bounds__(kLineThreads)
    row_squares_kernel(double* row_squares, const bf16* x, const float* matrix_factors,
                       MuonShape shape) {
  const int64_t matrix = blockIdx.y, row = blockIdx.x;
  const bf16* line = x + matrix * shape.stride + row * shape.cols;
  const float factor = factor_of(matrix_factors, matrix);
  double sum = 0.0;
  for (int64_t c = threadIdx.x * kWidth; c < shape.cols; c += kLineThreads * kWidth) {
    float values[kWidth];
    device::load_bf16<kWidth>(line + c, values);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      const float value = __fmul_rn(values[k], factor);
      sum += double(value) * double(value);
    }
  }
  sum = device::block_sum<kLineThreads>(sum);
  if (threadIdx.x == 0) row_squares[matrix * shape.rows + row] = sum;
}

// Grid (column tiles, count), blocks of kThreads: lane l of every warp takes the kWidth columns
// at tile + l·kWidth, warp w the rows w, w + warps, ...; the warps' sums then add up in warp
// order, so the result does not depend on timing.
template <int kWidth>
__global__ void __launch_bounds__(kThreads)
    column_squares_kernel(double* column_squares, const bf16* x, const float* matrix_factors,
                          MuonShape shape) {
  constexpr int kWarps = kThreads / device::kWarpSize;
  constexpr int kTile = device::kWarpSize * kWidth;
  __shared__ double warp_sums[kWarps][kTile];
  const int64_t matrix = blockIdx.y;
  const int warp = threadIdx.x / device::kWarpSize, lane = threadIdx.x % device::kWarpSize;
  const int64_t column = int64_t(blockIdx.x) * kTile + lane * kWidth;
  const bf16* values = x + matrix * shape.stride + column;
  const float factor = factor_of(matrix_factors, matrix);
  double sums[kWidth] = {};
  if (column < shape.cols) {
    for (int64_t r = warp; r < shape.rows; r += kWarps) {
      float row_values[kWidth];
      device::load_bf16<kWidth>(values + r * shape.cols, row_values);
#pragma unroll
      for (int k = 0; k < kWidth; ++k) {
        const float value = __fmul_rn(row_values[k], factor);
        sums[k] += double(value) * double(value);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kWidth; ++k)
    warp_sums[warp][lane * kWidth + k] = sums[k];
  __syncthreads();
  for (int t = threadIdx.x; t < kTile; t += kThreads) {
    const int64_t out = int64_t(blockIdx.x) * kTile + t;
    if (out >= shape.cols) continue;
    double total = 0.0;
    for (int w = 0; w < kWarps; ++w)
      total += warp_sums[w][t];
    column_squares[matrix * shape.cols + out] = total;
  }
}

// Grid (count): one block per matrix.
__global__ void __launch_bounds__(kThreads)
    matrix_scalars_kernel(float* scalars, const double* row_squares, MuonShape shape,
                          MatrixScalar kind) {
  const int64_t matrix = blockIdx.x;
  double sum = 0.0;
  for (int64_t r = threadIdx.x; r < shape.rows; r += kThreads)
    sum += row_squares[matrix * shape.rows + r];
  sum = device::block_sum<kThreads>(sum);
  if (threadIdx.x != 0) return;
  const auto norm = static_cast<float>(sqrt(sum));  // frobenius_norm: double, then fp32
  switch (kind) {
    case MatrixScalar::MuonEqTarget:
      scalars[matrix] = __fdiv_rn(norm, static_cast<float>(sqrt(double(shape.rows))));
      break;
    case MatrixScalar::PolarExpressDivisor:
      scalars[matrix] =
          round_to_bf16(__fadd_rn(round_to_bf16(__fmul_rn(round_to_bf16(norm), 1.01f)), 1e-6f));
      break;
    case MatrixScalar::MuonPlusFactor: {
      const auto target = static_cast<float>(sqrt(double(std::min(shape.rows, shape.cols))));
      scalars[matrix] = __fmul_rn(__fdiv_rn(1.0f, fmaxf(norm, 1e-6f)), target);
      break;
    }
  }
}

// Grid (rows, count): one block per row.
template <int kWidth>
__global__ void __launch_bounds__(kLineThreads)
    equilibrate_rows_kernel(bf16* x, double* row_squares, const float* targets, MuonShape shape) {
  const int64_t matrix = blockIdx.y, row = blockIdx.x;
  const int64_t index = matrix * shape.rows + row;
  const float row_norm = fmaxf(static_cast<float>(sqrt(row_squares[index])), 1e-6f);
  const float scale = round_to_bf16(__fdiv_rn(targets[matrix], row_norm));
  bf16* line = x + matrix * shape.stride + row * shape.cols;
  double sum = 0.0;
  for (int64_t c = threadIdx.x * kWidth; c < shape.cols; c += kLineThreads * kWidth) {
    float values[kWidth];
    device::load_bf16<kWidth>(line + c, values);
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      values[k] = round_to_bf16(__fmul_rn(values[k], scale));
      sum += double(values[k]) * double(values[k]);
    }
    device::store_bf16<kWidth>(line + c, values);
  }
  sum = device::block_sum<kLineThreads>(sum);  // every thread has read row_squares[index]
  if (threadIdx.x == 0) row_squares[index] = sum;
}

template <int kWidth>
__global__ void __launch_bounds__(kThreads)
    divide_kernel(bf16* x, const float* divisors, MuonShape shape) {
  const int64_t matrix = blockIdx.y;
  const int64_t elements = shape.rows * shape.cols;
  const float divisor = divisors[matrix];
  bf16* matrix_values = x + matrix * shape.stride;
  for (int64_t i = first_element() * kWidth; i < elements; i += element_stride() * kWidth) {
    float values[kWidth];
    device::load_bf16<kWidth>(matrix_values + i, values);
#pragma unroll
    for (int k = 0; k < kWidth; ++k)
      values[k] = __fdiv_rn(values[k], divisor);
    device::store_bf16<kWidth>(matrix_values + i, values);
  }
}

// Grid (count): one block per matrix, as muon.cpp's normuon() for one matrix. Each thread
// rescales the lines it computed, so the only synchronization is inside block_sum.
__global__ void __launch_bounds__(kThreads)
    normuon_scales_kernel(float* scales, float* second_moment, const double* line_squares,
                          MuonShape shape, float beta2) {
  const int64_t matrix = blockIdx.x;
  const bool per_row = shape.rows >= shape.cols;
  const int64_t kept = per_row ? shape.rows : shape.cols;
  const int64_t reduced = per_row ? shape.cols : shape.rows;
  const auto reduced_size = static_cast<float>(reduced);
  const float weight = __fsub_rn(1.0f, beta2);
  const double* sums = line_squares + matrix * kept;
  float* moments = second_moment + matrix * kept;
  float* line_scales = scales + matrix * kept;
  double mean_square_sum = 0.0, scaled_square_sum = 0.0;
  for (int64_t i = threadIdx.x; i < kept; i += kThreads) {
    const auto mean_square = static_cast<float>(sums[i] / double(reduced));
    mean_square_sum += mean_square;
    const float moment = torch_lerp(moments[i], mean_square, weight);
    moments[i] = moment;
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn(fmaxf(moment, 1e-10f)));
    line_scales[i] = scale;
    scaled_square_sum += __fmul_rn(__fmul_rn(mean_square, reduced_size), __fmul_rn(scale, scale));
  }
  mean_square_sum = device::block_sum<kThreads>(mean_square_sum);
  scaled_square_sum = device::block_sum<kThreads>(scaled_square_sum);
  // Rescaled lines keep the norm the update had before.
  const float norm = __fsqrt_rn(__fmul_rn(static_cast<float>(mean_square_sum), reduced_size));
  const float new_norm = __fsqrt_rn(static_cast<float>(scaled_square_sum));
  const float restore = __fdiv_rn(norm, fmaxf(new_norm, 1e-10f));
  for (int64_t i = threadIdx.x; i < kept; i += kThreads)
    line_scales[i] = __fmul_rn(line_scales[i], restore);
}

// A vector lies in one row: kWidth divides the row length. With shares, each matrix's
// parameters are this rank's share of it (shares[matrix]), its update and scales the whole
// matrix's.
template <int kWidth>
__global__ void __launch_bounds__(kThreads)
    cautious_update_kernel(float* params, const int64_t* offsets, const bf16* x,
                           const float* matrix_factors, const float* scales, MuonShape shape,
                           float lr, float decay, const MuonShare* shares, int rank) {
  const int64_t matrix = blockIdx.y;
  const MuonShare share = shares != nullptr ? shares[matrix] : MuonShare{shape.rows, shape.cols, 1};
  // Where this rank's share starts in the whole matrix.
  const int64_t first_row = shares != nullptr && share.by_rows ? rank * share.rows : 0;
  const int64_t first_col = shares != nullptr && !share.by_rows ? rank * share.cols : 0;
  const int64_t elements = share.rows * share.cols;
  const bool per_row = shape.rows >= shape.cols;
  const float factor = matrix_factors[matrix];
  const float* line_scales = scales + matrix * std::max(shape.rows, shape.cols);
  const bf16* updates = x + matrix * shape.stride;
  float* param = params + offsets[matrix];
  // 32-bit division (cheaper): check_shape keeps a matrix below 2^31 elements.
  const auto cols = static_cast<int32_t>(share.cols);
  for (int64_t i = first_element() * kWidth; i < elements; i += element_stride() * kWidth) {
    const int32_t row = static_cast<int32_t>(i) / cols;
    const int64_t col = first_col + (static_cast<int32_t>(i) - row * cols);
    const int64_t whole_row = first_row + row;
    float update[kWidth], p[kWidth], scale[kWidth];
    device::load_bf16<kWidth>(updates + whole_row * shape.cols + col, update);
    load_floats<kWidth>(param + i, p);
    if (per_row) {
#pragma unroll
      for (int k = 0; k < kWidth; ++k)
        scale[k] = line_scales[whole_row];
    } else {
      load_floats<kWidth>(line_scales + col, scale);
    }
#pragma unroll
    for (int k = 0; k < kWidth; ++k) {
      const float u = __fmul_rn(__fmul_rn(update[k], factor), scale[k]);
      const float weight_decay = __fmul_rn(u, p[k]) >= 0.0f ? __fmul_rn(decay, p[k]) : 0.0f;
      p[k] = __fsub_rn(p[k], __fadd_rn(__fmul_rn(lr, u), weight_decay));
    }
    store_floats<kWidth>(param + i, p);
  }
}

// Grid (blocks, ranks · count): blockIdx.y = rank · count + matrix. Rank t's share of matrix i,
// gathered at (t · count + i) · share_stride, into its place in x.
__global__ void __launch_bounds__(kThreads)
    place_shares_kernel(bf16* x, const bf16* gathered, const MuonShare* shares, MuonShape shape,
                        int64_t share_stride) {
  const int64_t matrix = blockIdx.y % shape.count, rank = blockIdx.y / shape.count;
  const MuonShare share = shares[matrix];
  const bf16* from = gathered + int64_t(blockIdx.y) * share_stride;
  bf16* to = x + matrix * shape.stride +
             (share.by_rows ? rank * share.rows * shape.cols : rank * share.cols);
  const int64_t elements = share.rows * share.cols;
  const auto cols = static_cast<int32_t>(share.cols);
  for (int64_t i = first_element(); i < elements; i += element_stride()) {
    const int32_t row = static_cast<int32_t>(i) / cols;
    to[row * shape.cols + (static_cast<int32_t>(i) - row * cols)] = from[i];
  }
}

// ---- Gradient norm and clipping ----

__global__ void __launch_bounds__(kThreads)
    sum_of_squares_kernel(double* partials, const float* values, int64_t count) {
  double sum = 0.0;
  for (int64_t i = first_element(); i < count; i += element_stride())
    sum += double(values[i]) * double(values[i]);
  sum = device::block_sum<kThreads>(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// *out = the sum of `count` partials (double or float), or its square root.
template <bool kRoot, typename Partial>
__global__ void __launch_bounds__(kThreads)
    finish_norm_kernel(float* out, const Partial* partials, int count) {
  double sum = 0.0;
  for (int i = threadIdx.x; i < count; i += kThreads)
    sum += double(partials[i]);
  sum = device::block_sum<kThreads>(sum);
  if (threadIdx.x == 0) *out = static_cast<float>(kRoot ? sqrt(sum) : sum);
}

__global__ void __launch_bounds__(kThreads)
    clip_kernel(float* values, int64_t count, const float* norm, float max_norm) {
  const double total = *norm;
  if (!isfinite(total) || total <= double(max_norm)) return;
  const auto factor = static_cast<float>(double(max_norm) / (total + 1e-6));
  for (int64_t i = first_element(); i < count; i += element_stride())
    values[i] = __fmul_rn(values[i], factor);
}

// ---- Argument checks ----

void check_pointers(std::initializer_list<const void*> pointers, const char* what) {
  for (const void* pointer : pointers)
    FP8T_CHECK(pointer != nullptr, "{}: expected device pointers, found null", what);
}

// AdamW's chunk count, and its pointers when there is work: false when there is none.
bool check_chunks(int64_t chunk_count, std::initializer_list<const void*> pointers) {
  FP8T_CHECK(chunk_count >= 0 && chunk_count <= INT32_MAX,
             "adamw_multi_tensor: expected 0 to 2^31 - 1 chunks, found {}", chunk_count);
  if (chunk_count == 0) return false;
  check_pointers(pointers, "adamw_multi_tensor");
  return true;
}

void check_shape(const MuonShape& shape, const char* what) {
  FP8T_CHECK(shape.count >= 1 && shape.count <= kMaxMatrices,
             "{}: expected 1 to {} matrices, found {}", what, kMaxMatrices, shape.count);
  FP8T_CHECK(shape.rows >= 1 && shape.cols >= 1 && shape.rows * shape.cols <= INT32_MAX,
             "{}: expected a non-empty matrix of fewer than 2^31 elements, found [{}, {}]", what,
             shape.rows, shape.cols);
  FP8T_CHECK(shape.stride >= shape.rows * shape.cols,
             "{}: expected a stride >= rows x cols = {}, found {}", what, shape.rows * shape.cols,
             shape.stride);
}

// Whether the Muon passes over these matrices may take vectors of 8: rows of whole vectors and
// every matrix and pointer 16-byte aligned (the parameters' and gradients' tensors lie at
// 256-byte boundaries of the layout).
bool takes_vectors(const MuonShape& shape, std::initializer_list<const void*> pointers) {
  return shape.cols % device::kBf16Vector == 0 && shape.stride % device::kBf16Vector == 0 &&
         device::all_aligned(pointers);
}

dim3 row_grid(const MuonShape& shape) {
  return {static_cast<unsigned>(shape.rows), static_cast<unsigned>(shape.count)};
}

}  // namespace

void adamw_multi_tensor(float* params, const float* grads, float* exp_avg, float* exp_avg_sq,
                        const AdamWChunk* chunks, int64_t chunk_count, const AdamWStep& step,
                        cudaStream_t stream, uint32_t* chunk_amax) {
  if (!check_chunks(chunk_count, {params, grads, exp_avg, exp_avg_sq, chunks})) return;
  adamw_kernel<<<static_cast<unsigned>(chunk_count), kThreads, 0, stream>>>(
      params, grads, exp_avg, exp_avg_sq, chunks, step, chunk_amax);
  FP8T_CUDA_CHECK_LAUNCH();
}

void tensor_amaxes(const TensorAmax* tensors, int64_t tensor_count, const uint32_t* chunk_amax,
                   cudaStream_t stream) {
  FP8T_CHECK(tensor_count >= 0 && tensor_count <= INT32_MAX,
             "tensor_amaxes: expected 0 to 2^31 - 1 tensors, found {}", tensor_count);
  if (tensor_count == 0) return;
  check_pointers({tensors, chunk_amax}, "tensor_amaxes");
  tensor_amax_kernel<<<static_cast<unsigned>(tensor_count), kThreads, 0, stream>>>(tensors,
                                                                                   chunk_amax);
  FP8T_CUDA_CHECK_LAUNCH();
}

void adamw_multi_tensor(bf16* params, const float* grads, bf16* exp_avg, bf16* exp_avg_sq,
                        const AdamWChunk* chunks, int64_t chunk_count, const AdamWStep& step,
                        cudaStream_t stream) {
  if (!check_chunks(chunk_count, {params, grads, exp_avg, exp_avg_sq, chunks})) return;
  adamw_bf16_kernel<<<static_cast<unsigned>(chunk_count), kThreads, 0, stream>>>(
      params, grads, exp_avg, exp_avg_sq, chunks, step);
  FP8T_CUDA_CHECK_LAUNCH();
}

void muon_nesterov(bf16* update, double* row_squares, float* momentum, const float* grads,
                   const int64_t* offsets, const MuonShape& shape, float mu, cudaStream_t stream) {
  check_shape(shape, "muon_nesterov");
  check_pointers({update, row_squares, momentum, grads, offsets}, "muon_nesterov");
  FP8T_CHECK(mu >= 0.0f && mu <= 1.0f, "muon_nesterov: expected a momentum in [0, 1], found {}",
             mu);
  const auto kernel = takes_vectors(shape, {update, momentum, grads})
                          ? nesterov_kernel<device::kBf16Vector>
                          : nesterov_kernel<1>;
  kernel<<<row_grid(shape), kLineThreads, 0, stream>>>(update, row_squares, momentum, grads,
                                                       offsets, shape, mu, 1.0f - mu);
  FP8T_CUDA_CHECK_LAUNCH();
}

void muon_row_squares(double* row_squares, const bf16* x, const float* matrix_factors,
                      const MuonShape& shape, cudaStream_t stream) {
  check_shape(shape, "muon_row_squares");
  check_pointers({row_squares, x}, "muon_row_squares");
  const auto kernel =
      takes_vectors(shape, {x}) ? row_squares_kernel<device::kBf16Vector> : row_squares_kernel<1>;
  kernel<<<row_grid(shape), kLineThreads, 0, stream>>>(row_squares, x, matrix_factors, shape);
  FP8T_CUDA_CHECK_LAUNCH();
}

void muon_column_squares(double* column_squares, const bf16* x, const float* matrix_factors,
                         const MuonShape& shape, cudaStream_t stream) {
  check_shape(shape, "muon_column_squares");
  check_pointers({column_squares, x}, "muon_column_squares");
  const bool vectors = takes_vectors(shape, {x});
  const int64_t tile = int64_t{device::kWarpSize} * (vectors ? device::kBf16Vector : 1);
  const dim3 grid(static_cast<unsigned>((shape.cols + tile - 1) / tile),
                  static_cast<unsigned>(shape.count));
  const auto kernel =
      vectors ? column_squares_kernel<device::kBf16Vector> : column_squares_kernel<1>;
  kernel<<<grid, kThreads, 0, stream>>>(column_squares, x, matrix_factors, shape);
  FP8T_CUDA_CHECK_LAUNCH();
}

void muon_matrix_scalars(float* scalars, const double* row_squares, const MuonShape& shape,
                         MatrixScalar kind, cudaStream_t stream) {
  check_shape(shape, "muon_matrix_scalars");
  check_pointers({scalars, row_squares}, "muon_matrix_scalars");
  matrix_scalars_kernel<<<static_cast<unsigned>(shape.count), kThreads, 0, stream>>>(
      scalars, row_squares, shape, kind);
  FP8T_CUDA_CHECK_LAUNCH();
}

void muon_equilibrate_rows(bf16* x, double* row_squares, const float* targets,
                           const MuonShape& shape, cudaStream_t stream) {
  check_shape(shape, "muon_equilibrate_rows");
  check_pointers({x, row_squares, targets}, "muon_equilibrate_rows");
  const auto kernel = takes_vectors(shape, {x}) ? equilibrate_rows_kernel<device::kBf16Vector>
                                                : equilibrate_rows_kernel<1>;
  kernel<<<row_grid(shape), kLineThreads, 0, stream>>>(x, row_squares, targets, shape);
  FP8T_CUDA_CHECK_LAUNCH();
}

void muon_divide(bf16* x, const float* divisors, const MuonShape& shape, cudaStream_t stream) {
  check_shape(shape, "muon_divide");
  check_pointers({x, divisors}, "muon_divide");
  const int width = takes_vectors(shape, {x}) ? device::kBf16Vector : 1;
  const auto kernel = width > 1 ? divide_kernel<device::kBf16Vector> : divide_kernel<1>;
  kernel<<<matrix_grid(shape.rows * shape.cols / width, shape.count), kThreads, 0, stream>>>(
      x, divisors, shape);
  FP8T_CUDA_CHECK_LAUNCH();
}

void normuon_scales(float* scales, float* second_moment, const double* line_squares,
                    const MuonShape& shape, float beta2, cudaStream_t stream) {
  check_shape(shape, "normuon_scales");
  check_pointers({scales, second_moment, line_squares}, "normuon_scales");
  FP8T_CHECK(beta2 >= 0.0f && beta2 < 1.0f, "normuon_scales: expected beta2 in [0, 1), found {}",
             beta2);
  normuon_scales_kernel<<<static_cast<unsigned>(shape.count), kThreads, 0, stream>>>(
      scales, second_moment, line_squares, shape, beta2);
  FP8T_CUDA_CHECK_LAUNCH();
}

void muon_cautious_update(float* params, const int64_t* offsets, const bf16* x,
                          const float* matrix_factors, const float* scales, const MuonShape& shape,
                          float lr, float decay, cudaStream_t stream, const MuonShares& shares) {
  check_shape(shape, "muon_cautious_update");
  check_pointers({params, offsets, x, matrix_factors, scales}, "muon_cautious_update");
  FP8T_CHECK(shares.table == nullptr || (shares.rank >= 0 && shares.min_cols >= 1),
             "muon_cautious_update: expected a rank >= 0 and share columns, found {} and {}",
             shares.rank, shares.min_cols);
  const bool vectors = takes_vectors(shape, {params, x, scales}) &&
                       (shares.table == nullptr || shares.min_cols % device::kBf16Vector == 0);
  const int width = vectors ? device::kBf16Vector : 1;
  const int64_t elements = shares.table != nullptr ? shares.elements : shape.rows * shape.cols;
  const auto kernel =
      width > 1 ? cautious_update_kernel<device::kBf16Vector> : cautious_update_kernel<1>;
  kernel<<<matrix_grid(elements / width, shape.count), kThreads, 0, stream>>>(
      params, offsets, x, matrix_factors, scales, shape, lr, decay, shares.table, shares.rank);
  FP8T_CUDA_CHECK_LAUNCH();
}

void muon_place_shares(bf16* x, const bf16* gathered, const MuonShares& shares,
                       const MuonShape& shape, int64_t share_stride, int ranks,
                       cudaStream_t stream) {
  check_shape(shape, "muon_place_shares");
  check_pointers({x, gathered, shares.table}, "muon_place_shares");
  FP8T_CHECK(ranks >= 1 && ranks * shape.count <= kMaxMatrices && share_stride >= shares.elements,
             "muon_place_shares: expected 1 to {} matrices of all ranks and a stride >= {}, found "
             "{} x {} and {}",
             kMaxMatrices, shares.elements, ranks, shape.count, share_stride);
  place_shares_kernel<<<matrix_grid(shares.elements, ranks * shape.count), kThreads, 0, stream>>>(
      x, gathered, shares.table, shape, share_stride);
  FP8T_CUDA_CHECK_LAUNCH();
}

namespace {

template <bool kRoot>
void sum_squares(float* out, const float* values, int64_t count, double* partials,
                 cudaStream_t stream, const char* what) {
  FP8T_CHECK(count >= 0, "{}: expected count >= 0, found {}", what, count);
  check_pointers({out, partials}, what);
  FP8T_CHECK(count == 0 || values != nullptr, "{}: null values for {} elements", what, count);
  const auto blocks = static_cast<int>(
      std::clamp<int64_t>((count + kNormBlockElements - 1) / kNormBlockElements, 1, kNormPartials));
  sum_of_squares_kernel<<<blocks, kThreads, 0, stream>>>(partials, values, count);
  FP8T_CUDA_CHECK_LAUNCH();
  finish_norm_kernel<kRoot><<<1, kThreads, 0, stream>>>(out, partials, blocks);
  FP8T_CUDA_CHECK_LAUNCH();
}

}  // namespace

void sum_of_squares_norm(float* norm, const float* values, int64_t count, double* partials,
                         cudaStream_t stream) {
  sum_squares<true>(norm, values, count, partials, stream, "sum_of_squares_norm");
}

void sum_of_squares(float* squares, const float* values, int64_t count, double* partials,
                    cudaStream_t stream) {
  sum_squares<false>(squares, values, count, partials, stream, "sum_of_squares");
}

void norm_of_squares(float* norm, const float* squares, int count, cudaStream_t stream) {
  FP8T_CHECK(count >= 1, "norm_of_squares: expected at least one sum, found {}", count);
  check_pointers({norm, squares}, "norm_of_squares");
  finish_norm_kernel<true><<<1, kThreads, 0, stream>>>(norm, squares, count);
  FP8T_CUDA_CHECK_LAUNCH();
}

void clip_by_norm(float* values, int64_t count, const float* norm, float max_norm,
                  cudaStream_t stream) {
  FP8T_CHECK(count >= 0, "clip_by_norm: expected count >= 0, found {}", count);
  FP8T_CHECK(max_norm > 0.0f, "clip_by_norm: expected a positive clip norm, found {}", max_norm);
  check_pointers({norm}, "clip_by_norm");
  if (count == 0) return;
  check_pointers({values}, "clip_by_norm");
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  clip_kernel<<<device::grid_size(blocks, kBlocksPerSm), kThreads, 0, stream>>>(values, count, norm,
                                                                                max_norm);
  FP8T_CUDA_CHECK_LAUNCH();
}

}  // namespace fp8t::optim::cuda
