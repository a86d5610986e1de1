// Quantization kernels. Every conversion goes through fp8t::encode() (or encode_pair(), the same
// instruction on two values) and every scale through the functions of scaling.h, so the bytes match
// the CPU reference of quantize.cpp exactly.
#include "numerics/quantize_cuda.h"

#include <algorithm>
#include <limits>
#include <mutex>
#include <set>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "numerics/rotary_norm_math.cuh"
#include "numerics/scaling.h"

namespace fp8t::cuda {

namespace {

constexpr int kThreads = 256;

// A persistent grid: enough blocks to fill the GPU, few enough that the one atomic per block
// that publishes the amax stays cheap.
unsigned grid_for(int64_t work_items, int blocks_per_sm = 8) {
  const int64_t wanted = std::max<int64_t>(1, work_items);
  return static_cast<unsigned>(
      std::min<int64_t>(wanted, int64_t(multiprocessor_count()) * blocks_per_sm));
}

void check_data_format(Fp8Format format) {
  FP8T_CHECK(format != Fp8Format::E8M0, "expected an FP8 data format, found e8m0 (a scale format)");
}

void check_pointers(int64_t count, const void* a, const void* b) {
  FP8T_CHECK(count >= 0, "expected a non-negative element count, found {}", count);
  FP8T_CHECK(count == 0 || (a != nullptr && b != nullptr), "null device pointer for {} elements",
             count);
}

bool aligned16(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

// Block-wide max of amax bit patterns; one atomic per block.
__device__ void publish_amax(uint32_t local, float* amax_inout) {
  const uint32_t block = block_max_bits(local);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(amax_inout), block);
}

// One thread's CastHealth counts (quantize.h), added to the device's once per warp. Kernels
// take kHealth as a template parameter, so that casts without statistics do no counting.
struct HealthCounts {
  uint32_t saturated = 0;
  uint32_t underflow = 0;
};

template <Fp8Format kFormat>
__device__ void count_cast(float value, float scaled, uint8_t code, HealthCounts& counts) {
  counts.saturated += cast_saturates(scaled, format_max(kFormat)) ? 1u : 0u;
  counts.underflow += cast_underflows(value, code) ? 1u : 0u;
}

// Every thread of the block calls this (full-warp reductions).
__device__ void publish_health(const HealthCounts& counts, CastHealth* health) {
  const uint32_t saturated = __reduce_add_sync(0xFFFFFFFFu, counts.saturated);
  const uint32_t underflow = __reduce_add_sync(0xFFFFFFFFu, counts.underflow);
  if (threadIdx.x % 32 == 0 && (saturated | underflow) != 0) {
    atomicAdd(&health->saturated, static_cast<unsigned long long>(saturated));
    atomicAdd(&health->underflow, static_cast<unsigned long long>(underflow));
  }
}

// Calls launch(std::integral_constant<bool, B>{}) with B = (health != nullptr).
template <typename Launch>
void dispatch_health(const CastHealth* health, Launch&& launch) {
  if (health != nullptr) return launch(std::true_type{});
  launch(std::false_type{});
}

// 16 bytes of input: 8 bf16 or 4 float.
template <typename T>
struct alignas(16) InputVector {
  static constexpr int kSize = 16 / sizeof(T);
  T values[kSize];
};

template <int N>
struct alignas(N) ByteVector {
  uint8_t values[N];
};

__global__ void encode_kernel(const float* x, int64_t count, Fp8Format format,
                              Saturation saturation, uint8_t* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = fp8t::encode(x[i], format, saturation);
  }
}

__global__ void decode_kernel(const uint8_t* codes, int64_t count, Fp8Format format, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = fp8t::decode(codes[i], format);
  }
}

__global__ void scale_from_amax_kernel(const float* amax, float format_max, bool power_of_2,
                                       float epsilon, float* scale, float* scale_inv) {
  const float value = fp8t::scale_from_amax(*amax, format_max, power_of_2, epsilon);
  *scale = value;
  if (scale_inv != nullptr) *scale_inv = 1.0f / value;
}

// round_to_bf16 through the hardware's conversion: the same bits for every value but NaN,
// whose payload float_to_bf16 keeps (and the amax then holds). Fewer instructions per element
// in the relu² casts, whose arithmetic per byte limits them.
__device__ inline float round_to_bf16_by_hardware(float value) {
  return isnan(value) ? round_to_bf16(value) : __bfloat162float(__float2bfloat16_rn(value));
}

// A relu² form of cast_input() (below) before its rounding to bf16.
template <CastInput kInput>
__device__ float unrounded_relu2_input(bf16 x, bf16 relu2_input) {
  const float value = to_float(x);
  if constexpr (kInput == CastInput::Relu2) {
    const float positive = fmaxf(value, 0.0f);  // NaN -> 0, as relu2_forward
    return positive * positive;
  } else {
    static_assert(kInput == CastInput::Relu2Gradient, "a relu² form");
    const float input = to_float(relu2_input);  // relu2_backward's arithmetic
    return input > 0.0f ? 2.0f * input * value : 0.0f;
  }
}

// The value a cast reads from one element of x (CastInput); relu2_input is relu²'s input at
// the same position (read by Relu2Gradient only).
template <CastInput kInput, typename T>
__device__ float cast_input(T x, bf16 relu2_input) {
  if constexpr (kInput == CastInput::Value) {
    return to_float(x);
  } else {
    return round_to_bf16_by_hardware(unrounded_relu2_input<kInput>(x, relu2_input));
  }
}

// cast_input() of relu²'s gradient as the bf16 that a block cast stages: the hardware's rounding
// straight to bf16 (NaN aside, float_to_bf16's bits), without widening and narrowing again.
__device__ bf16 staged_relu2_gradient(bf16 gradient, bf16 relu2_input) {
  const float value = unrounded_relu2_input<CastInput::Relu2Gradient>(gradient, relu2_input);
  if (isnan(value)) return float_to_bf16(value);
  return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(value))};
}

// cast_input() of relu² for two bf16 at once, as a block cast stages them, in bf16 arithmetic:
// the max returns 0 for a NaN, as relu2_forward, and the product of two bf16 is rounded once from
// its exact value, as the float square (exact) is rounded to bf16. No NaN can come out.
__device__ uint32_t staged_relu2_pair(uint32_t pair) {
  const __nv_bfloat162 values = *reinterpret_cast<const __nv_bfloat162*>(&pair);
  const __nv_bfloat162 positive = __hmax2(values, __float2bfloat162_rn(0.0f));
  const __nv_bfloat162 square = __hmul2_rn(positive, positive);
  return *reinterpret_cast<const uint32_t*>(&square);
}

// staged_relu2_pair() over a vector of bf16, in place.
__device__ void stage_relu2(InputVector<bf16>& vector) {
  auto* pairs = reinterpret_cast<uint32_t*>(vector.values);
#pragma unroll
  for (int w = 0; w < InputVector<bf16>::kSize / 2; ++w)
    pairs[w] = staged_relu2_pair(pairs[w]);
}

// The 8 bf16 of a vector as fp32, by their place in it.
__device__ void widen_bf16x8(const uint32_t (&words)[4], float (&values)[8]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    values[2 * w] = __uint_as_float(words[w] << 16);
    values[2 * w + 1] = __uint_as_float(words[w] & 0xFFFF0000u);
  }
}

// What a thread needs of the rotary norm besides the two vectors: its head row's rstd and one of
// the rotary tables at its 8 columns, cos in the first half's lanes and sin in the second's
// (stage_rotary_norm_gradient trades them), so that each table value is read once per head row.
struct RotaryRowInputs {
  float rstd;
  float table[8];
};

constexpr int kRotaryHalfLanes = 8;  // the lanes of a head's first 64 columns

// The RotaryRowInputs of one thread's row, loaded with its vectors. `valid`: the row lies inside
// the tensor (else rstd reads as 0).
__device__ RotaryRowInputs load_rotary_row(const RotaryNormGradient& rotary, int64_t row,
                                           int64_t head, int64_t heads, int row_lane, bool valid) {
  RotaryRowInputs inputs;
  inputs.rstd = valid ? rotary.rstd[row * heads + head] : 0.0f;
  // Rows fit 32 bits (at most 65535 tiles of 128), so the position takes a 32-bit remainder.
  const uint32_t position = static_cast<uint32_t>(row) % static_cast<uint32_t>(rotary.seq_len);
  const float* table = (row_lane >= kRotaryHalfLanes ? rotary.sin : rotary.cos) +
                       position * (kRotaryHalfLanes * 8) + (row_lane % kRotaryHalfLanes) * 8;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float4 values = reinterpret_cast<const float4*>(table)[half];
    inputs.table[4 * half] = values.x;
    inputs.table[4 * half + 1] = values.y;
    inputs.table[4 * half + 2] = values.z;
    inputs.table[4 * half + 3] = values.w;
  }
  return inputs;
}

// rotary_rmsnorm_backward's gradient (ops/cuda/norm_rotary.cu) at one thread's 8 columns of a
// head row, rounded to bf16 as that kernel stores it, in place of `gradient`. A tile row is one
// head row over 16 lanes: lane l < 8 holds the columns 8 l .. 8 l + 7 of the first half, lane
// l + 8 their rotary partners 64 columns on. Partners trade their vectors and tables by shuffles
// and both compute the pair in the rotary kernel's order, so the bits are its own. Every lane of
// the warp calls this (shuffles).
__device__ void stage_rotary_norm_gradient(InputVector<bf16>& gradient,
                                           const InputVector<bf16>& output,
                                           const RotaryRowInputs& inputs, int row_lane) {
  constexpr int kDim = 2 * kRotaryHalfLanes * 8;
  const bool second_half = row_lane >= kRotaryHalfLanes;
  const auto* own_gradient = reinterpret_cast<const uint32_t*>(gradient.values);
  const auto* own_output = reinterpret_cast<const uint32_t*>(output.values);
  uint32_t first_words[2][4], second_words[2][4];  // [gradient, output][word] of each half
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint32_t words[2] = {own_gradient[w], own_output[w]};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t partner = __shfl_xor_sync(0xFFFFFFFFu, words[i], kRotaryHalfLanes);
      first_words[i][w] = second_half ? partner : words[i];
      second_words[i][w] = second_half ? words[i] : partner;
    }
  }
  float g1[8], g2[8], y1[8], y2[8], c[8], s[8];
  widen_bf16x8(first_words[0], g1);
  widen_bf16x8(second_words[0], g2);
  widen_bf16x8(first_words[1], y1);
  widen_bf16x8(second_words[1], y2);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float partner = __shfl_xor_sync(0xFFFFFFFFu, inputs.table[k], kRotaryHalfLanes);
    c[k] = second_half ? partner : inputs.table[k];
    s[k] = second_half ? inputs.table[k] : partner;
  }
  // The gradient before the norm, rstd (dy - y mean(dy y)), then the transposed rotation.
  float dy_dot_y = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k)
    dy_dot_y = rotary::add_pair_dot(g1[k], y1[k], g2[k], y2[k], dy_dot_y);
#pragma unroll
  for (int offset = kRotaryHalfLanes / 2; offset > 0; offset /= 2)
    dy_dot_y += __shfl_xor_sync(0xFFFFFFFFu, dy_dot_y, offset);
  const float mean_dy_y = dy_dot_y / static_cast<float>(kDim);
  auto* words = reinterpret_cast<uint32_t*>(gradient.values);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    float values[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int k = 2 * w + i;
      const float a = rotary::norm_input_gradient(g1[k], y1[k], mean_dy_y, inputs.rstd);
      const float b = rotary::norm_input_gradient(g2[k], y2[k], mean_dy_y, inputs.rstd);
      values[i] = second_half ? rotary::rotated_second<true>(a, b, c[k], s[k])
                              : rotary::rotated_first<true>(a, b, c[k], s[k]);
    }
    const __nv_bfloat162 pair = __floats2bfloat162_rn(values[0], values[1]);
    words[w] = *reinterpret_cast<const uint32_t*>(&pair);
  }
}

// Scales and encodes one input vector, and folds the inputs into the amax (and, with kHealth,
// the counts).
template <Fp8Format kFormat, CastInput kInput, bool kHealth, typename T>
__device__ ByteVector<InputVector<T>::kSize> scale_and_encode(const InputVector<T>& in,
                                                              const InputVector<bf16>& relu2_in,
                                                              float scale, uint32_t& amax_bits,
                                                              HealthCounts& counts) {
  constexpr int kVec = InputVector<T>::kSize;
  ByteVector<kVec> bytes;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const float value = cast_input<kInput>(in.values[k], relu2_in.values[k]);
    amax_bits = max(amax_bits, abs_bits(value));
    const float scaled = __fmul_rn(value, scale);
    bytes.values[k] = fp8t::encode(scaled, kFormat, Saturation::Saturate);
    if constexpr (kHealth) count_cast<kFormat>(value, scaled, bytes.values[k], counts);
  }
  return bytes;
}

// Calls launch(std::integral_constant<Fp8Format, F>{}) for the data format F: kernels take the
// format as a template parameter, so that the per-element conversion compiles to its own path.
template <typename Launch>
void dispatch_data_format(Fp8Format format, Launch&& launch) {
  switch (format) {
    case Fp8Format::E4M3:
      return launch(std::integral_constant<Fp8Format, Fp8Format::E4M3>{});
    case Fp8Format::E5M2:
      return launch(std::integral_constant<Fp8Format, Fp8Format::E5M2>{});
    case Fp8Format::E4M3FNUZ:
      return launch(std::integral_constant<Fp8Format, Fp8Format::E4M3FNUZ>{});
    case Fp8Format::E5M2FNUZ:
      return launch(std::integral_constant<Fp8Format, Fp8Format::E5M2FNUZ>{});
    case Fp8Format::E8M0:
      break;
  }
  check_data_format(format);
}

// Calls launch(std::integral_constant<CastInput, I>{}) for the cast input I, after checking
// that relu2_input is given exactly for Relu2Gradient; the relu² forms read bf16.
template <typename T, typename Launch>
void dispatch_cast_input(CastInput input, const bf16* relu2_input, Launch&& launch) {
  FP8T_CHECK((input == CastInput::Relu2Gradient) == (relu2_input != nullptr),
             "a relu² gradient cast takes relu²'s input, and only it");
  FP8T_CHECK(input != CastInput::RotaryNormGradient,
             "the rotary norm's gradient is cast by quantize_blocks_rotary_norm_gradient alone");
  if (input == CastInput::Value)
    return launch(std::integral_constant<CastInput, CastInput::Value>{});
  if constexpr (std::is_same_v<T, bf16>) {
    if (input == CastInput::Relu2)
      return launch(std::integral_constant<CastInput, CastInput::Relu2>{});
    return launch(std::integral_constant<CastInput, CastInput::Relu2Gradient>{});
  } else {
    FP8T_CHECK(false, "a relu² cast reads bf16 input, found fp32");
  }
}

// Elementwise cast (with kQuantize) or amax only. Vector path for aligned full vectors,
// scalar path for the tail.
template <typename T, bool kQuantize, Fp8Format kFormat, CastInput kInput, bool kHealth = false>
__global__ void __launch_bounds__(kThreads)
    cast_amax_kernel(const T* __restrict__ x, const bf16* __restrict__ relu2_input, int64_t count,
                     const float* __restrict__ scale_ptr, uint8_t* __restrict__ out,
                     float* amax_inout, bool vectorized, CastHealth* health = nullptr) {
  constexpr bool kTwoInputs = kInput == CastInput::Relu2Gradient;
  constexpr int kVec = InputVector<T>::kSize;
  const float scale = kQuantize ? *scale_ptr : 1.0f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  uint32_t local_amax = 0;
  HealthCounts counts;
  int64_t scalar_begin = 0;
  if (vectorized) {
    // Two independent 16-byte loads in flight per thread before their first use.
    constexpr int kUnroll = 2;
    const int64_t vectors = count / kVec;
    for (int64_t v0 = first; v0 < vectors; v0 += kUnroll * stride) {
      InputVector<T> in[kUnroll];
      InputVector<bf16> relu2_in[kUnroll] = {};
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * stride;
        if (v >= vectors) continue;
        in[u] = reinterpret_cast<const InputVector<T>*>(x)[v];
        if constexpr (kTwoInputs)
          relu2_in[u] = reinterpret_cast<const InputVector<bf16>*>(relu2_input)[v];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * stride;
        if (v >= vectors) break;
        if constexpr (kQuantize) {
          reinterpret_cast<ByteVector<kVec>*>(out)[v] = scale_and_encode<kFormat, kInput, kHealth>(
              in[u], relu2_in[u], scale, local_amax, counts);
        } else {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const float value = cast_input<kInput>(in[u].values[k], relu2_in[u].values[k]);
            local_amax = max(local_amax, abs_bits(value));
          }
        }
      }
    }
    scalar_begin = vectors * kVec;
  }
  for (int64_t i = scalar_begin + first; i < count; i += stride) {
    const float value = cast_input<kInput>(x[i], kTwoInputs ? relu2_input[i] : bf16{});
    local_amax = max(local_amax, abs_bits(value));
    if constexpr (kQuantize) {
      const float scaled = __fmul_rn(value, scale);
      out[i] = fp8t::encode(scaled, kFormat, Saturation::Saturate);
      if constexpr (kHealth) count_cast<kFormat>(value, scaled, out[i], counts);
    }
  }
  if constexpr (kHealth) publish_health(counts, health);
  if (amax_inout != nullptr) publish_amax(local_amax, amax_inout);
}

// Cast + transpose + amax with one per-tensor scale. A block walks tiles of 128 rows x 8
// vectors (64 bf16 or 32 fp32 columns). Each thread owns a patch of 4 rows x one vector: four
// 16-byte loads, four row-major stores, and per column one 32-bit word holding its 4 rows'
// bytes, i.e. a 4x4 byte transpose in registers. A full tile's loads are asynchronous copies
// into shared memory, issued one tile ahead: they run while the tile before is stored (the
// W-GPT24 step's casts went from 3.15 to 3.45 TB/s, those reading two inputs from 2.8 to 3.4). The
// words go to a shared tile kept as [column][128 bytes], whose 16-byte chunks are XOR-swizzled by
// the patch column so that both the word stores and the 16-byte reads are free of bank conflicts;
// each transposed row segment then leaves as eight 16-byte stores covering 128 contiguous bytes.
constexpr int kTransposeRows = 128;
constexpr int kPatchRows = 4;
constexpr int kPatchColumns = 8;  // vectors per tile row
constexpr int kChunksPerColumn = kTransposeRows / 16;
static_assert((kTransposeRows / kPatchRows) * kPatchColumns == kThreads, "one patch per thread");
static_assert(kPatchRows == 4, "a column word holds the 4 rows of a patch");
// Measured on an H200 (16384 x 6144 bf16), before the loads were staged: at 4 resident blocks
// per SM (64 registers, a few bytes spilled) the kernel ran 126 us against 136 us at the 3
// blocks its 80 registers allowed.
constexpr int kTransposeBlocksPerSm = 4;
static_assert(kChunksPerColumn == kPatchColumns,
              "the swizzle maps chunk ^ patch column onto chunks");

__device__ int swizzled_word(int column, int patch_column, int row_word) {
  const int chunk = (row_word / 4) ^ patch_column;
  return column * (kTransposeRows / 4) + chunk * 4 + row_word % 4;
}

// The tiling of the input, and the loads of one thread's patch: four 16-byte asynchronous
// copies when the tile is full, element loads with bounds checks at the edges (zeros outside).
template <typename T>
struct TransposeTile {
  static constexpr int kVec = InputVector<T>::kSize;
  static constexpr int kColumns = kPatchColumns * kVec;

  const T* x;
  const bf16* relu2_input;  // Relu2Gradient: relu²'s input, the same layout as x; else null
  int64_t rows, cols, tile_cols, row_bands;
  bool vector_io;

  __device__ int64_t row0(int64_t tile) const { return (tile / tile_cols) * kTransposeRows; }
  __device__ int64_t col0(int64_t tile) const { return (tile % tile_cols) * kColumns; }
  __device__ bool full(int64_t tile) const {
    return vector_io && row0(tile) + kTransposeRows <= rows && col0(tile) + kColumns <= cols;
  }
  // Starts copying a full tile's patch of `source` into this thread's slots of `staged`
  // ([kPatchRows][kThreads] vectors), to be read by the same thread after
  // __pipeline_wait_prior: no other thread reads them, so no barrier is needed.
  template <typename U>
  __device__ void stage(const U* source, int64_t tile, int patch_row, int patch_column,
                        InputVector<U> (*staged)[kThreads]) const {
    const int64_t patch_row0 = row0(tile) + patch_row * kPatchRows;
    const int64_t patch_col0 = col0(tile) + patch_column * kVec;
#pragma unroll
    for (int i = 0; i < kPatchRows; ++i) {
      __pipeline_memcpy_async(&staged[i][threadIdx.x],
                              source + (patch_row0 + i) * cols + patch_col0,
                              sizeof(InputVector<U>));
    }
  }

  // Row i of a patch of `source` (x, or relu2_input: U = bf16 = T) at the edge of the input:
  // element loads, zeros outside.
  template <typename U>
  __device__ void load_edge_row(const U* source, int64_t tile, int patch_row, int patch_column,
                                int i, InputVector<U>& row) const {
    static_assert(InputVector<U>::kSize == kVec, "x's vectors");
    const int64_t patch_row0 = row0(tile) + patch_row * kPatchRows;
    const int64_t patch_col0 = col0(tile) + patch_column * kVec;
    const int64_t offset = (patch_row0 + i) * cols + patch_col0;
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      row.values[k] = patch_row0 + i < rows && patch_col0 + k < cols ? source[offset + k] : U{};
  }
};

template <typename T, Fp8Format kFormat, CastInput kInput, bool kHealth>
__global__ void __launch_bounds__(kThreads, kTransposeBlocksPerSm)
    cast_transpose_kernel(TransposeTile<T> source, const float* __restrict__ scale_ptr,
                          uint8_t* __restrict__ out, uint8_t* __restrict__ out_t, float* amax_inout,
                          CastHealth* health) {
  constexpr int kVec = TransposeTile<T>::kVec;
  constexpr int kTileColumns = TransposeTile<T>::kColumns;
  __shared__ alignas(16) uint32_t tile_t[kTileColumns * kTransposeRows / 4];
  const int64_t rows = source.rows;
  const int64_t cols = source.cols;
  const float scale = *scale_ptr;
  const int64_t tiles = source.tile_cols * source.row_bands;
  const int patch_column = threadIdx.x % kPatchColumns;
  const int patch_row = threadIdx.x / kPatchColumns;  // = the 32-bit word of a transposed column
  uint32_t local_amax = 0;
  HealthCounts counts;

  // The next full tile's input is copied into shared memory while this one is converted and
  // stored: the loads of a tile no longer wait for the stores of the one before.
  constexpr bool kTwoInputs = kInput == CastInput::Relu2Gradient;
  __shared__ InputVector<T> staged[kPatchRows][kThreads];
  __shared__ InputVector<bf16> staged_relu2[kTwoInputs ? kPatchRows : 1][kThreads];
  const auto stage = [&](int64_t tile) {
    if (tile >= tiles || !source.full(tile)) return;
    source.stage(source.x, tile, patch_row, patch_column, staged);
    if constexpr (kTwoInputs)
      source.stage(source.relu2_input, tile, patch_row, patch_column, staged_relu2);
    __pipeline_commit();
  };
  stage(blockIdx.x);

  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t row0 = source.row0(t);
    const int64_t col0 = source.col0(t);
    const bool full = source.full(t);
    const int64_t patch_col0 = col0 + patch_column * kVec;
    const int64_t patch_row0 = row0 + patch_row * kPatchRows;
    if (full) __pipeline_wait_prior(0);  // staged by the previous iteration, or before the loop

    // Column k's word holds the patch's 4 rows of that column: a 4x4 byte transpose.
    uint32_t column_words[kVec] = {};
#pragma unroll
    for (int i = 0; i < kPatchRows; ++i) {
      InputVector<T> in;
      InputVector<bf16> relu2_in = {};
      if (full) {
        in = staged[i][threadIdx.x];
        if constexpr (kTwoInputs) relu2_in = staged_relu2[i][threadIdx.x];
      } else {
        source.load_edge_row(source.x, t, patch_row, patch_column, i, in);
        if constexpr (kTwoInputs)
          source.load_edge_row(source.relu2_input, t, patch_row, patch_column, i, relu2_in);
      }
      // Edge patches hold zeros beyond the tensor, which count as neither saturated nor
      // underflowed.
      const ByteVector<kVec> bytes =
          scale_and_encode<kFormat, kInput, kHealth>(in, relu2_in, scale, local_amax, counts);
#pragma unroll
      for (int k = 0; k < kVec; ++k)
        column_words[k] |= uint32_t(bytes.values[k]) << (8 * i);
      const int64_t offset = (patch_row0 + i) * cols + patch_col0;
      if (out == nullptr) {
        continue;
      } else if (full) {
        *reinterpret_cast<ByteVector<kVec>*>(out + offset) = bytes;
      } else if (patch_row0 + i < rows) {
        for (int k = 0; k < kVec && patch_col0 + k < cols; ++k)
          out[offset + k] = bytes.values[k];
      }
    }
    // The staged vectors have been read and used: their slots take the next tile's.
    stage(t + gridDim.x);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      tile_t[swizzled_word(patch_column * kVec + k, patch_column, patch_row)] = column_words[k];
    }
    __syncthreads();

    for (int i = threadIdx.x; i < kTileColumns * kChunksPerColumn; i += kThreads) {
      const int column = i / kChunksPerColumn;
      const int chunk = i % kChunksPerColumn;
      const uint4 bytes =
          *reinterpret_cast<const uint4*>(&tile_t[swizzled_word(column, column / kVec, chunk * 4)]);
      const int64_t offset_t = (col0 + column) * rows + row0 + chunk * 16;
      if (full) {
        *reinterpret_cast<uint4*>(out_t + offset_t) = bytes;
      } else if (col0 + column < cols) {
        const uint8_t* chunk_bytes = reinterpret_cast<const uint8_t*>(&bytes);
        for (int k = 0; k < 16 && row0 + chunk * 16 + k < rows; ++k)
          out_t[offset_t + k] = chunk_bytes[k];
      }
    }
    __syncthreads();  // the tile is rewritten by the next iteration
  }
  if constexpr (kHealth) publish_health(counts, health);
  if (amax_inout != nullptr) publish_amax(local_amax, amax_inout);
}

// The product in fp32, stored as float or rounded to bf16.
FP8T_HD inline void store_as(float* out, float value) {
  *out = value;
}
FP8T_HD inline void store_as(bf16* out, float value) {
  *out = float_to_bf16(value);
}

template <typename Out>
__global__ void dequantize_kernel(const uint8_t* q, int64_t count, const float* scale_inv,
                                  Fp8Format format, Out* out) {
  const float multiplier = *scale_inv;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    store_as(out + i, __fmul_rn(fp8t::decode(q[i], format), multiplier));
  }
}

// The OCP formats eight codes at a time: one 8-byte load, the hardware's FP8 → half conversions
// (exact: every E4M3 and E5M2 value is a half, NaN stays NaN), the same fp32 product, and
// 16-byte stores. The byte-at-a-time kernel above runs at a fraction of the copy rate.
constexpr int kCodesPerThread = 8;

template <typename Out>
__global__ void dequantize_vector_kernel(const uint2* q, int64_t groups, const float* scale_inv,
                                         __nv_fp8_interpretation_t kind, Out* out) {
  const float multiplier = *scale_inv;
  for (int64_t g = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; g < groups;
       g += int64_t(gridDim.x) * blockDim.x) {
    const uint2 word = q[g];
    alignas(16) Out values[kCodesPerThread];
    const uint32_t halves[2] = {word.x, word.y};
#pragma unroll
    for (int pair = 0; pair < kCodesPerThread / 2; ++pair) {
      const auto codes =
          static_cast<__nv_fp8x2_storage_t>(halves[pair / 2] >> (16 * (pair % 2)) & 0xFFFFu);
      const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(codes, kind);
      const float2 decoded = __half22float2(__half2(raw));
      store_as(&values[2 * pair], __fmul_rn(decoded.x, multiplier));
      store_as(&values[2 * pair + 1], __fmul_rn(decoded.y, multiplier));
    }
    auto* destination = reinterpret_cast<uint4*>(out + g * kCodesPerThread);
#pragma unroll
    for (size_t part = 0; part < sizeof(values) / sizeof(uint4); ++part)
      destination[part] = reinterpret_cast<const uint4*>(values)[part];
  }
}

// Block scalings. A block of 256 threads owns a 128x128 tile: one 128x128 block, or 128 (or
// 512) blocks of 1x128 (or 1x32) along its rows and as many along its columns. The tile is
// loaded as 16-byte vectors, half of a thread's in flight at a time (a quarter with two inputs),
// and staged in shared memory as T; a barrier later the tile's amax is known.
//  - Rows: a tile row is kRowLanes consecutive lanes holding one vector each, so a 1xB block's
//    amax is a shuffle reduction over B / kVec lanes and its codes leave as kVec-byte stores
//    that cover the row's 128 bytes.
//  - Columns (the transposed copy): a thread reads one 32-bit word (2 bf16 or 1 float columns)
//    from each of 32 consecutive rows, the lanes of a warp reading consecutive words (no bank
//    conflicts), keeps them in registers, and casts each column's 32 codes into two 16-byte
//    pieces; a full tile's pieces meet in shared memory and leave as whole 128-byte lines. A
//    1x128 column block is four such threads: their amaxes meet in shared memory.
// With the transposed copy the kernel is partly bound by its instructions, so amaxes fold two
// bf16 per integer max and codes are converted in pairs. The first version staged the tile as
// fp32 and cast element by element with byte stores: 418 us for 16384 x 6144 bf16 with the 1x128
// transposed copy, against 184 us now (block-major scales) and 131 us for the per-tensor
// cast + transpose (docs/benchmarks.md).
constexpr int kBlockTile = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kSegmentRows = 32;  // rows of the column segment one thread casts
constexpr int kSegments = kBlockTile / kSegmentRows;
constexpr int kMxBlock = 32;  // the columns of an MX block

template <typename T>
struct BlockTileShape {
  static constexpr int kVec = InputVector<T>::kSize;
  static constexpr int kRowLanes = kBlockTile / kVec;
  static constexpr int kRowsPerPass = kThreads / kRowLanes;
  static constexpr int kPasses = kBlockTile / kRowsPerPass;  // vectors per thread
  static constexpr int kColumnsPerWord = 4 / int(sizeof(T));
  static constexpr int kWords = kBlockTile / kColumnsPerWord;  // 32-bit words per tile row
  static constexpr int kSegmentsPerThread = kWords * kSegments / kThreads;
  static constexpr size_t kSharedBytes = sizeof(T) * kBlockTile * kBlockTile;
  static_assert(kRowLanes <= 32 && 32 % kRowLanes == 0, "a tile row within a warp");
  static_assert(kWords % 32 == 0 && kSegmentsPerThread >= 1, "a warp's words in one segment");
};

struct BlockScaleResult {
  float multiplier;
  float scale_inv;  // fp32 scales
  uint8_t code;     // E8M0 scales
};

__device__ BlockScaleResult block_scale(uint32_t amax_bits_value, const BlockQuantization& spec,
                                        float format_maximum) {
  const float amax_value = bits_to_float(amax_bits_value);
  if (spec.scaling == BlockScaling::Mx1x32) {
    const uint8_t code = mx_scale_from_amax(amax_value, format_maximum);
    return {mx_inverse_scale(code), 0.0f, code};
  }
  const float scale =
      fp8t::scale_from_amax(amax_value, format_maximum, spec.power_of_2_scales, spec.amax_epsilon);
  return {scale, 1.0f / scale, 0};
}

// Where the kernel writes the codes and scales of each orientation.
struct BlockCastTargets {
  uint8_t* out;  // null: no row-wise copy
  void* scales;
  uint8_t* out_t;  // null: no transposed copy
  void* scales_t;
  BlockScaleOrder order;
  int64_t scale_lines_t;  // BlockMajor: the lines the transposed copy's scales are strided by
  bool vector_loads;      // full tiles load 16-byte vectors
  bool vector_stores;     // full tiles store kVec-byte row vectors
  bool vector_stores_t;   // full tiles store 16-byte column pieces
  // Relu2Gradient only (ActivationTCast): relu(relu2_input)²'s transposed copy, e4m3, its scales
  // in `order` over `cols` lines.
  uint8_t* activation_t;
  void* activation_scales_t;
};

// Where a block's tile lies in the tensor.
struct TileSpot {
  int64_t rows, cols, row0, col0;
  int valid_rows, valid_cols;
  bool full;
  // The tile's row and column in the grid of 128x128 tiles.
  __device__ int64_t tile_row() const { return row0 / kBlockTile; }
  __device__ int64_t tile_col() const { return col0 / kBlockTile; }
};

// The scale of block `block` along line `line` (a row of the tensor or of its transpose) of a
// tensor with `lines` lines, `grid` its scale grid; a 128x128 tile's line is the tile row
// `tile_line` of the grid's.
__device__ void store_block_scale(void* scales, const BlockShape& grid, int64_t lines, int64_t line,
                                  int64_t tile_line, int64_t block, BlockScaleOrder order,
                                  const BlockScaleResult& result, const BlockQuantization& spec) {
  if (spec.scaling == BlockScaling::Tile128x128) {
    line = tile_line;
    lines = grid.rows;
  }
  const int64_t line_blocks =
      order == BlockScaleOrder::PaddedLineMajor ? padded_tile_scale_row(grid.cols) : grid.cols;
  const int64_t index =
      order == BlockScaleOrder::BlockMajor ? block * lines + line : line * line_blocks + block;
  if (spec.scaling == BlockScaling::Mx1x32) {
    static_cast<uint8_t*>(scales)[index] = result.code;
  } else {
    static_cast<float*>(scales)[index] = result.scale_inv;
  }
}

// The max of v over aligned groups of `kLanes` lanes.
template <int kLanes>
__device__ uint32_t group_max(uint32_t v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

// Column k of a 32-bit word of a bf16 or float tile row.
template <typename T>
__device__ float word_column(uint32_t word, int k) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(word);
  } else {
    return bf16_to_float(bf16{static_cast<uint16_t>(word >> (16 * k))});
  }
}

// The bits of |value| folded into `folded`, a word of T's layout (two bf16 or one float) whose
// columns each keep their largest: one integer max for two bf16 (max.u16x2 on sm_90).
template <typename T>
__device__ uint32_t fold_abs_max(uint32_t folded, uint32_t word) {
  if constexpr (std::is_same_v<T, float>) {
    return max(folded, word & 0x7FFFFFFFu);
  } else {
    const uint32_t magnitudes = word & 0x7FFF7FFFu;
#if __CUDA_ARCH__ >= 900
    uint32_t result;
    asm("max.u16x2 %0, %1, %2;" : "=r"(result) : "r"(folded), "r"(magnitudes));
    return result;
#else
    return max(folded & 0xFFFFu, magnitudes & 0xFFFFu) |
           max(folded & 0xFFFF0000u, magnitudes & 0xFFFF0000u);
#endif
  }
}

// Column k's amax of a folded word, as abs_bits() of the float it stands for: the same ordering,
// NaN above inf.
template <typename T>
__device__ uint32_t folded_column_amax(uint32_t folded, int k) {
  if constexpr (std::is_same_v<T, float>) {
    return folded;
  } else {
    return (folded >> (16 * k)) << 16;
  }
}

// The amax over every column of a folded word.
template <typename T>
__device__ uint32_t folded_amax(uint32_t folded) {
  if constexpr (std::is_same_v<T, float>) {
    return folded;
  } else {
    return max(folded_column_amax<T>(folded, 0), folded_column_amax<T>(folded, 1));
  }
}

// encode() of two values, a's code in the low byte: one conversion instruction for both where
// the hardware has it (the OCP formats), the same bits.
template <Fp8Format kFormat>
__device__ uint32_t encode_pair(float a, float b) {
#if __CUDA_ARCH__ >= 890
  if constexpr (kFormat == Fp8Format::E4M3 || kFormat == Fp8Format::E5M2) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE,
                                    kFormat == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2);
  }
#endif
  return uint32_t(fp8t::encode(a, kFormat, Saturation::Saturate)) |
         uint32_t(fp8t::encode(b, kFormat, Saturation::Saturate)) << 8;
}

// A transposed tile line's 128 codes are kCodePieces 16-byte pieces. Staged in shared memory,
// piece p of column c sits at p ^ (c's word % 8) in its line, so that the eight columns of
// consecutive words that a quarter warp stages, and the eight pieces of one line that it reads
// back, fall in distinct banks.
constexpr int kCodePieces = kBlockTile / 16;

template <typename T>
__device__ int code_piece_index(int column, int piece) {
  const int word = column / BlockTileShape<T>::kColumnsPerWord;
  return column * kCodePieces + (piece ^ (word % kCodePieces));
}

// The transposed copy of the tile staged in shared memory (T, [kBlockTile][kBlockTile]) into
// out_t and scales_t: each thread reads its column segments once and folds their amaxes (a
// 128x128 tile's scale takes tile_amax); a 1x128 block's four segments first publish theirs in
// segment_amax. Full tiles stage their codes over the tile's own memory.
template <typename T, Fp8Format kFormat>
__device__ void cast_tile_columns(uint4* shared_tile, uint32_t (*segment_amax)[kBlockTile],
                                  uint32_t tile_amax, const BlockQuantization& spec,
                                  const TileSpot& spot, uint8_t* out_t, void* scales_t,
                                  int64_t scale_lines_t, BlockScaleOrder order,
                                  bool vector_stores_t) {
  using Shape = BlockTileShape<T>;
  const float format_maximum = format_max(kFormat);
  const bool tile_scaling = spec.scaling == BlockScaling::Tile128x128;
  const BlockShape col_grid = scale_grid(spec.scaling, spot.cols, spot.rows);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(shared_tile);
  uint32_t segment_words[Shape::kSegmentsPerThread][kSegmentRows];
  uint32_t segment_folded[Shape::kSegmentsPerThread];
#pragma unroll
  for (int s = 0; s < Shape::kSegmentsPerThread; ++s) {
    const int item = threadIdx.x + s * kThreads;
    const int word = item % Shape::kWords;
    const int segment = item / Shape::kWords;
    segment_folded[s] = 0;
#pragma unroll
    for (int j = 0; j < kSegmentRows; ++j) {
      segment_words[s][j] = words[(segment * kSegmentRows + j) * Shape::kWords + word];
      if (!tile_scaling)
        segment_folded[s] = fold_abs_max<T>(segment_folded[s], segment_words[s][j]);
    }
    if (spec.scaling == BlockScaling::Rows1x128) {
#pragma unroll
      for (int k = 0; k < Shape::kColumnsPerWord; ++k)
        segment_amax[segment][word * Shape::kColumnsPerWord + k] =
            folded_column_amax<T>(segment_folded[s], k);
    }
  }
  // A full tile's transposed codes are staged in shared memory over the input tile (every thread
  // has read its words by the barrier) and leave as whole 128-byte lines: stored from registers,
  // each 16-byte piece went to a line of its own, and those scattered writes bound the kernel at
  // the L2 (Nsight Compute: L2 at 85 % of its peak, DRAM at 58 %).
  const bool stage_codes_t = spot.full && vector_stores_t;
  if (spec.scaling == BlockScaling::Rows1x128 || stage_codes_t) __syncthreads();
  uint4* codes_t = shared_tile;  // [kBlockTile columns][kCodePieces] 16-byte pieces, swizzled
#pragma unroll
  for (int s = 0; s < Shape::kSegmentsPerThread; ++s) {
    const int item = threadIdx.x + s * kThreads;
    const int word = item % Shape::kWords;
    const int segment = item / Shape::kWords;
#pragma unroll
    for (int k = 0; k < Shape::kColumnsPerWord; ++k) {
      const int c = word * Shape::kColumnsPerWord + k;
      uint32_t amax_bits_value = tile_amax;
      if (spec.scaling == BlockScaling::Rows1x128) {
        amax_bits_value = max(max(segment_amax[0][c], segment_amax[1][c]),
                              max(segment_amax[2][c], segment_amax[3][c]));
      } else if (spec.scaling == BlockScaling::Mx1x32) {
        amax_bits_value = folded_column_amax<T>(segment_folded[s], k);
      }
      const BlockScaleResult result = block_scale(amax_bits_value, spec, format_maximum);
      uint32_t packed[kSegmentRows / 4] = {};
#pragma unroll
      for (int j = 0; j < kSegmentRows; j += 2) {
        const uint32_t pair = encode_pair<kFormat>(
            __fmul_rn(word_column<T>(segment_words[s][j], k), result.multiplier),
            __fmul_rn(word_column<T>(segment_words[s][j + 1], k), result.multiplier));
        packed[j / 4] |= pair << (8 * (j % 4));
      }
      if (c >= spot.valid_cols) continue;
      const int first = segment * kSegmentRows;
      uint8_t* line = out_t + (spot.col0 + c) * spot.rows + spot.row0 + first;
      if (stage_codes_t) {
        const int piece = first / 16;
        codes_t[code_piece_index<T>(c, piece)] =
            make_uint4(packed[0], packed[1], packed[2], packed[3]);
        codes_t[code_piece_index<T>(c, piece + 1)] =
            make_uint4(packed[4], packed[5], packed[6], packed[7]);
      } else {
        for (int j = 0; j < kSegmentRows && first + j < spot.valid_rows; ++j)
          line[j] = static_cast<uint8_t>(packed[j / 4] >> (8 * (j % 4)));
      }
      bool writes_scale = false;
      int64_t block = spot.tile_row();
      if (spec.scaling == BlockScaling::Rows1x128) {
        writes_scale = segment == 0;
      } else if (spec.scaling == BlockScaling::Mx1x32) {
        writes_scale = first < spot.valid_rows;
        block = (spot.row0 + first) / kMxBlock;
      } else {
        writes_scale = segment == 0 && c == 0;
      }
      if (writes_scale) {
        store_block_scale(scales_t, col_grid, scale_lines_t, spot.col0 + c, spot.tile_col(), block,
                          order, result, spec);
      }
    }
  }
  if (!stage_codes_t) return;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kBlockTile * kCodePieces / kThreads; ++i) {
    const int item = threadIdx.x + i * kThreads;
    const int c = item / kCodePieces;
    const int piece = item % kCodePieces;
    reinterpret_cast<uint4*>(out_t + (spot.col0 + c) * spot.rows + spot.row0)[piece] =
        codes_t[code_piece_index<T>(c, piece)];
  }
}

// Resident blocks: four (64 registers; 6-9 % faster than three at 80) for bf16 tiles, the relu²
// and rotary norm gradients' two inputs included; three for fp32's 64 KiB tiles and for the
// relu² gradient's cast that stages relu² as a second tile.
template <typename T, bool kActivationT>
constexpr int kBlockCastBlocksPerSm = sizeof(T) == 2 && !kActivationT ? 4 : 3;

// Casts the tile at (tile_row, tile_col) of the grid of 128x128 tiles, one block's work. With
// kHealth, the counts of `out`'s codes (not out_t's) are added to *health. The relu² and
// rotary norm cast inputs (bf16 only) are staged as the bf16 values they round to, so the
// passes after the staging read a plain bf16 tile. second_input: relu²'s input
// (Relu2Gradient) or the rotary norm's output (RotaryNormGradient, whose other inputs `rotary`
// holds), in x's layout. kActivationT (Relu2Gradient only): relu²'s transposed copy too, into
// targets.activation_t, from relu² of second_input staged as a second tile as it is loaded
// (twice the shared memory).
template <typename T, Fp8Format kFormat, CastInput kInput, bool kHealth, bool kActivationT>
__device__ __forceinline__ void cast_block_tile(const T* __restrict__ x,
                                                const bf16* __restrict__ second_input, int64_t rows,
                                                int64_t cols, const BlockQuantization& spec,
                                                const BlockCastTargets& targets, CastHealth* health,
                                                const RotaryNormGradient& rotary, int64_t tile_row,
                                                int64_t tile_col) {
  static_assert(!kActivationT || kInput == CastInput::Relu2Gradient,
                "relu²'s transposed copy comes with its gradient's cast");
  static_assert(kInput != CastInput::RotaryNormGradient || std::is_same_v<T, bf16>,
                "the rotary norm's gradient is bf16");
  using Shape = BlockTileShape<T>;
  constexpr int kVec = Shape::kVec;
  constexpr bool kTwoInputs =
      kInput == CastInput::Relu2Gradient || kInput == CastInput::RotaryNormGradient;
  // Half the rows' loads in flight at a time (a quarter with two inputs, one row with the rotary
  // norm's rstd and table too): all of them would not fit the 64 registers of four resident
  // blocks. (The rotary norm's gradient at two rows and three blocks ran 7 % slower.)
  constexpr int kLoadGroup = Shape::kPasses / (kInput == CastInput::RotaryNormGradient ? 8
                                               : kTwoInputs                            ? 4
                                                                                       : 2);
  extern __shared__ uint4 shared_tile[];  // [kBlockTile][kBlockTile] of T (kActivationT: two)
  T* tile = reinterpret_cast<T*>(shared_tile);
  uint4* activation_shared = shared_tile + BlockTileShape<T>::kSharedBytes / sizeof(uint4);
  [[maybe_unused]] auto* activation_tile = reinterpret_cast<bf16*>(activation_shared);
  __shared__ uint32_t warp_amax[kWarps];
  __shared__ uint32_t segment_amax[kSegments][kBlockTile];

  const int64_t row0 = tile_row * kBlockTile;
  const int64_t col0 = tile_col * kBlockTile;
  const int valid_rows = static_cast<int>(min(int64_t{kBlockTile}, rows - row0));
  const int valid_cols = static_cast<int>(min(int64_t{kBlockTile}, cols - col0));
  const bool full = valid_rows == kBlockTile && valid_cols == kBlockTile;
  const TileSpot spot{rows, cols, row0, col0, valid_rows, valid_cols, full};
  const float format_maximum = format_max(kFormat);
  const int row_lane = threadIdx.x % Shape::kRowLanes;
  const int first_row = threadIdx.x / Shape::kRowLanes;
  const int column = row_lane * kVec;  // the tile column of this thread's vectors

  // A group's loads are all issued before any is used (zeros outside the tensor), and staged in
  // shared memory: the row and column passes read them from there. Only a 128x128 tile's scale
  // needs the tile's amax.
  const bool tile_scaling = spec.scaling == BlockScaling::Tile128x128;
  uint32_t local_amax = 0;
#pragma unroll
  for (int group = 0; group < Shape::kPasses; group += kLoadGroup) {
    InputVector<T> vectors[kLoadGroup];
    InputVector<bf16> second_vectors[kTwoInputs ? kLoadGroup : 1];
    [[maybe_unused]] RotaryRowInputs
        rotary_rows[kInput == CastInput::RotaryNormGradient ? kLoadGroup : 1];
#pragma unroll
    for (int p = 0; p < kLoadGroup; ++p) {
      const int r = first_row + (group + p) * Shape::kRowsPerPass;
      const int64_t offset = (row0 + r) * cols + col0 + column;
      if (full && targets.vector_loads) {
        vectors[p] = *reinterpret_cast<const InputVector<T>*>(x + offset);
        if constexpr (kTwoInputs)
          second_vectors[p] = *reinterpret_cast<const InputVector<bf16>*>(second_input + offset);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const bool inside = r < valid_rows && column + k < valid_cols;
          vectors[p].values[k] = inside ? x[offset + k] : T{};
          if constexpr (kTwoInputs)
            second_vectors[p].values[k] = inside ? second_input[offset + k] : bf16{};
        }
      }
      if constexpr (kInput == CastInput::RotaryNormGradient) {
        rotary_rows[p] = load_rotary_row(rotary, row0 + r, spot.tile_col(), cols / kBlockTile,
                                         row_lane, r < valid_rows);
      }
    }
#pragma unroll
    for (int p = 0; p < kLoadGroup; ++p) {
      const int r = first_row + (group + p) * Shape::kRowsPerPass;
      if constexpr (kInput == CastInput::Relu2) stage_relu2(vectors[p]);
      if constexpr (kInput == CastInput::RotaryNormGradient) {
        stage_rotary_norm_gradient(vectors[p], second_vectors[p], rotary_rows[p], row_lane);
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if constexpr (kInput == CastInput::Relu2Gradient)
          vectors[p].values[k] =
              staged_relu2_gradient(vectors[p].values[k], second_vectors[p].values[k]);
        if (tile_scaling) local_amax = max(local_amax, abs_bits(to_float(vectors[p].values[k])));
      }
      *reinterpret_cast<InputVector<T>*>(tile + r * kBlockTile + column) = vectors[p];
      if constexpr (kActivationT) {
        stage_relu2(second_vectors[p]);
        *reinterpret_cast<InputVector<bf16>*>(activation_tile + r * kBlockTile + column) =
            second_vectors[p];
      }
    }
  }
  local_amax = __reduce_max_sync(0xFFFFFFFFu, local_amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = local_amax;
  __syncthreads();
  uint32_t tile_amax = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w)
    tile_amax = max(tile_amax, warp_amax[w]);

  const BlockShape row_grid = scale_grid(spec.scaling, rows, cols);
  if (targets.out != nullptr) {
    constexpr int kMxLanes = kMxBlock / kVec;  // the lanes of one 1x32 block
    HealthCounts counts;
#pragma unroll 1
    for (int p = 0; p < Shape::kPasses; ++p) {
      const int r = first_row + p * Shape::kRowsPerPass;
      const InputVector<T> vector =
          *reinterpret_cast<const InputVector<T>*>(tile + r * kBlockTile + column);
      const auto* vector_words = reinterpret_cast<const uint32_t*>(vector.values);
      uint32_t folded = 0;
#pragma unroll
      for (int w = 0; w < kVec / Shape::kColumnsPerWord; ++w)
        folded = fold_abs_max<T>(folded, vector_words[w]);
      uint32_t amax_bits_value = folded_amax<T>(folded);
      if (spec.scaling == BlockScaling::Rows1x128) {
        amax_bits_value = group_max<Shape::kRowLanes>(amax_bits_value);
      } else if (spec.scaling == BlockScaling::Mx1x32) {
        amax_bits_value = group_max<kMxLanes>(amax_bits_value);
      } else {
        amax_bits_value = tile_amax;
      }
      const BlockScaleResult result = block_scale(amax_bits_value, spec, format_maximum);
      ByteVector<kVec> codes;
#pragma unroll
      for (int k = 0; k < kVec; k += 2) {
        const float values[2] = {to_float(vector.values[k]), to_float(vector.values[k + 1])};
        const float scaled[2] = {__fmul_rn(values[0], result.multiplier),
                                 __fmul_rn(values[1], result.multiplier)};
        const uint32_t pair = encode_pair<kFormat>(scaled[0], scaled[1]);
        codes.values[k] = static_cast<uint8_t>(pair);
        codes.values[k + 1] = static_cast<uint8_t>(pair >> 8);
        // A NaN multiplier (an MX block holding a NaN) makes every code NaN: nothing to count.
        if constexpr (kHealth) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            if (r < valid_rows && column + k + i < valid_cols && !isnan(result.multiplier))
              count_cast<kFormat>(values[i], scaled[i], codes.values[k + i], counts);
          }
        }
      }
      if (r >= valid_rows) continue;
      uint8_t* line = targets.out + (row0 + r) * cols + col0 + column;
      if (full && targets.vector_stores) {
        *reinterpret_cast<ByteVector<kVec>*>(line) = codes;
      } else {
        for (int k = 0; k < kVec && column + k < valid_cols; ++k)
          line[k] = codes.values[k];
      }
      bool writes_scale = false;
      int64_t block = 0;
      if (spec.scaling == BlockScaling::Rows1x128) {
        writes_scale = row_lane == 0;
        block = spot.tile_col();
      } else if (spec.scaling == BlockScaling::Mx1x32) {
        writes_scale = row_lane % kMxLanes == 0 && column < valid_cols;
        block = (col0 + column) / kMxBlock;
      } else {
        writes_scale = r == 0 && row_lane == 0;
        block = spot.tile_col();
      }
      if (writes_scale) {
        store_block_scale(targets.scales, row_grid, rows, row0 + r, spot.tile_row(), block,
                          targets.order, result, spec);
      }
    }
    if constexpr (kHealth) publish_health(counts, health);
  }
  if (targets.out_t != nullptr) {
    cast_tile_columns<T, kFormat>(shared_tile, segment_amax, tile_amax, spec, spot, targets.out_t,
                                  targets.scales_t, targets.scale_lines_t, targets.order,
                                  targets.vector_stores_t);
  }
  if constexpr (kActivationT) {
    __syncthreads();  // every thread is done with segment_amax
    cast_tile_columns<bf16, Fp8Format::E4M3>(activation_shared, segment_amax, 0, spec, spot,
                                             targets.activation_t, targets.activation_scales_t,
                                             spot.cols, targets.order, targets.vector_stores_t);
  }
}

// One block per tile: the grid's x the tile columns, y the tile rows.
template <typename T, Fp8Format kFormat, CastInput kInput, bool kHealth, bool kActivationT>
__global__ void __launch_bounds__(kThreads, (kBlockCastBlocksPerSm<T, kActivationT>))
    block_quantize_kernel(const T* __restrict__ x, const bf16* __restrict__ second_input,
                          int64_t rows, int64_t cols, BlockQuantization spec,
                          BlockCastTargets targets, CastHealth* health, RotaryNormGradient rotary) {
  cast_block_tile<T, kFormat, kInput, kHealth, kActivationT>(
      x, second_input, rows, cols, spec, targets, health, rotary, blockIdx.y, blockIdx.x);
}

// Up to kMaxTileCastJobs fp32 tensors cast in one launch (quantize_tiles_grouped): a job's tiles
// are the blocks [first_tile[j], first_tile[j + 1]), row-major over its tile grid.
constexpr int kMaxTileCastJobs = 32;
struct TileCastGroup {
  struct Job {
    const float* x;
    int64_t rows, cols;
    BlockCastTargets targets;
  };
  Job jobs[kMaxTileCastJobs];
  int64_t first_tile[kMaxTileCastJobs + 1];
  int count;
};
static_assert(sizeof(TileCastGroup) <= 4000, "a launch's parameters hold at most 4 KiB");

template <Fp8Format kFormat>
__global__ void __launch_bounds__(kThreads, (kBlockCastBlocksPerSm<float, false>))
    grouped_tile_cast_kernel(const __grid_constant__ TileCastGroup group, BlockQuantization spec) {
  const int64_t tile = blockIdx.x;
  int j = 0;
  while (j + 1 < group.count && group.first_tile[j + 1] <= tile)
    ++j;
  const TileCastGroup::Job& job = group.jobs[j];
  const int64_t tile_cols = (job.cols + kBlockTile - 1) / kBlockTile;
  const int64_t own_tile = tile - group.first_tile[j];
  cast_block_tile<float, kFormat, CastInput::Value, false, false>(
      job.x, nullptr, job.rows, job.cols, spec, job.targets, nullptr, RotaryNormGradient{},
      own_tile / tile_cols, own_tile % tile_cols);
}

template <typename Out>
__global__ void block_dequantize_kernel(const uint8_t* q, int64_t rows, int64_t cols,
                                        BlockQuantization spec, const void* scales, Out* out) {
  const BlockShape block = block_shape(spec.scaling);
  const BlockShape grid = scale_grid(spec.scaling, rows, cols);
  const int64_t count = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const int64_t scale_index = (r / block.rows) * grid.cols + c / block.cols;
    const float scale_inv =
        spec.scaling == BlockScaling::Mx1x32
            ? fp8t::decode(static_cast<const uint8_t*>(scales)[scale_index], Fp8Format::E8M0)
            : static_cast<const float*>(scales)[scale_index];
    store_as(out + i, __fmul_rn(fp8t::decode(q[i], spec.format), scale_inv));
  }
}

// The checks of a block cast's targets that every entry point makes: codes and scales in pairs,
// and the transposed copy's scales strided by block-major lines, at least its `cols` of them.
void check_block_cast_targets(const void* out, const void* scales, const void* out_t,
                              const void* scales_t, BlockScaleOrder order, int64_t scale_lines_t,
                              int64_t cols) {
  FP8T_CHECK(out != nullptr || out_t != nullptr, "a block cast writes out, out_t or both");
  FP8T_CHECK((out == nullptr) == (scales == nullptr), "out and scales go together");
  FP8T_CHECK((out_t == nullptr) == (scales_t == nullptr), "out_t and scales_t go together");
  FP8T_CHECK(scale_lines_t == 0 || (order == BlockScaleOrder::BlockMajor && scale_lines_t >= cols),
             "the transposed copy's scales are strided by block-major lines, at least its {} "
             "lines; found a stride of {}",
             cols, scale_lines_t);
}

// A block cast's grid: one block per 128x128 tile, columns in x, rows in y.
dim3 block_cast_grid(int64_t rows, int64_t cols) {
  const int64_t row_tiles = (rows + kBlockTile - 1) / kBlockTile;
  FP8T_CHECK(row_tiles <= 65535, "expected at most {} rows, found {}", 65535 * kBlockTile, rows);
  return dim3(static_cast<unsigned>((cols + kBlockTile - 1) / kBlockTile),
              static_cast<unsigned>(row_tiles));
}

// The targets of a block cast of x (and second_input, in x's layout), the vector paths on where
// the pointers' alignment and the shape allow.
template <typename T>
BlockCastTargets block_cast_targets(const T* x, const bf16* second_input, int64_t rows,
                                    int64_t cols, uint8_t* out, void* scales, uint8_t* out_t,
                                    void* scales_t, BlockScaleOrder order, int64_t scale_lines_t,
                                    const ActivationTCast& activation_t) {
  constexpr int kVec = BlockTileShape<T>::kVec;
  return {out,
          scales,
          out_t,
          scales_t,
          order,
          scale_lines_t != 0 ? scale_lines_t : cols,
          aligned16(x) && aligned16(second_input) && cols % kVec == 0,
          reinterpret_cast<uintptr_t>(out) % kVec == 0 && cols % kVec == 0,
          (out_t == nullptr || aligned16(out_t)) &&
              (activation_t.out_t == nullptr || aligned16(activation_t.out_t)) && rows % 16 == 0,
          activation_t.out_t,
          activation_t.scales_t};
}

unsigned elementwise_grid(int64_t count) {
  return grid_for((count + kThreads - 1) / kThreads);
}

// Lets `kernel` take `bytes` of dynamic shared memory on the current device: set once per kernel
// and device, so that a cast costs the host no driver call besides its launch.
void allow_shared_bytes(const void* kernel, size_t bytes) {
  static std::mutex mutex;
  static std::set<std::pair<int, const void*>> allowed;
  int device = 0;
  FP8T_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (allowed.count({device, kernel}) != 0) return;
  FP8T_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)));
  allowed.emplace(device, kernel);
}

}  // namespace

void encode(const float* x, int64_t count, Fp8Format format, Saturation saturation, uint8_t* out,
            cudaStream_t stream) {
  check_pointers(count, x, out);
  if (count == 0) return;
  encode_kernel<<<elementwise_grid(count), kThreads, 0, stream>>>(x, count, format, saturation,
                                                                  out);
  FP8T_CUDA_CHECK_LAUNCH();
}

void decode(const uint8_t* codes, int64_t count, Fp8Format format, float* out,
            cudaStream_t stream) {
  check_pointers(count, codes, out);
  if (count == 0) return;
  decode_kernel<<<elementwise_grid(count), kThreads, 0, stream>>>(codes, count, format, out);
  FP8T_CUDA_CHECK_LAUNCH();
}

template <typename T>
void amax(const T* x, int64_t count, float* amax_inout, cudaStream_t stream, CastInput input,
          const bf16* relu2_input) {
  check_pointers(count, x, amax_inout);
  if (count == 0) return;
  constexpr int kVec = InputVector<T>::kSize;
  const bool vectorized = aligned16(x) && aligned16(relu2_input);
  dispatch_cast_input<T>(input, relu2_input, [&](auto input_constant) {
    cast_amax_kernel<T, false, Fp8Format::E4M3, decltype(input_constant)::value>
        <<<elementwise_grid(count / kVec + 1), kThreads, 0, stream>>>(
            x, relu2_input, count, nullptr, nullptr, amax_inout, vectorized);
  });
  FP8T_CUDA_CHECK_LAUNCH();
}

void scale_from_amax(const float* amax, float format_max, bool power_of_2, float epsilon,
                     float* scale, float* scale_inv, cudaStream_t stream) {
  FP8T_CHECK(amax != nullptr && scale != nullptr, "amax and scale must be device pointers");
  scale_from_amax_kernel<<<1, 1, 0, stream>>>(amax, format_max, power_of_2, epsilon, scale,
                                              scale_inv);
  FP8T_CUDA_CHECK_LAUNCH();
}

template <typename T>
void quantize(const T* x, int64_t count, const float* scale, Fp8Format format, uint8_t* out,
              float* amax_inout, cudaStream_t stream, CastInput input, const bf16* relu2_input,
              CastHealth* health) {
  check_pointers(count, x, out);
  check_data_format(format);
  FP8T_CHECK(scale != nullptr, "scale must be a device pointer");
  if (count == 0) return;
  constexpr int kVec = InputVector<T>::kSize;
  // The vector path writes kVec bytes at once: the output must be aligned to that too.
  const bool vectorized =
      aligned16(x) && aligned16(relu2_input) && reinterpret_cast<uintptr_t>(out) % kVec == 0;
  dispatch_cast_input<T>(input, relu2_input, [&](auto input_constant) {
    dispatch_data_format(format, [&](auto format_constant) {
      dispatch_health(health, [&](auto health_constant) {
        cast_amax_kernel<T, true, decltype(format_constant)::value, decltype(input_constant)::value,
                         decltype(health_constant)::value>
            <<<elementwise_grid(count / kVec + 1), kThreads, 0, stream>>>(
                x, relu2_input, count, scale, out, amax_inout, vectorized, health);
      });
    });
  });
  FP8T_CUDA_CHECK_LAUNCH();
}

template <typename T>
void quantize_transpose(const T* x, int64_t rows, int64_t cols, const float* scale,
                        Fp8Format format, uint8_t* out, uint8_t* out_t, float* amax_inout,
                        cudaStream_t stream, CastInput input, const bf16* relu2_input,
                        CastHealth* health) {
  FP8T_CHECK(rows >= 0 && cols >= 0, "expected a non-negative shape, found [{}, {}]", rows, cols);
  check_pointers(rows * cols, x, out_t);
  check_pointers(rows * cols, out_t, scale);
  check_data_format(format);
  if (rows * cols == 0) return;
  // Full tiles use vector loads and stores: every row start must keep their alignment.
  const bool vector_io = aligned16(x) && aligned16(relu2_input) &&
                         (out == nullptr || aligned16(out)) && aligned16(out_t) && cols % 16 == 0 &&
                         rows % 16 == 0;
  const TransposeTile<T> source{
      x,
      relu2_input,
      rows,
      cols,
      (cols + TransposeTile<T>::kColumns - 1) / TransposeTile<T>::kColumns,
      (rows + kTransposeRows - 1) / kTransposeRows,
      vector_io};
  const int64_t tiles = source.tile_cols * source.row_bands;
  dispatch_cast_input<T>(input, relu2_input, [&](auto input_constant) {
    dispatch_data_format(format, [&](auto format_constant) {
      dispatch_health(health, [&](auto health_constant) {
        cast_transpose_kernel<T, decltype(format_constant)::value, decltype(input_constant)::value,
                              decltype(health_constant)::value>
            <<<grid_for(tiles, kTransposeBlocksPerSm), kThreads, 0, stream>>>(
                source, scale, out, out_t, amax_inout, health);
      });
    });
  });
  FP8T_CUDA_CHECK_LAUNCH();
}

template <typename Out>
void dequantize(const uint8_t* q, int64_t count, const float* scale_inv, Fp8Format format, Out* out,
                cudaStream_t stream) {
  check_pointers(count, q, out);
  FP8T_CHECK(scale_inv != nullptr, "scale_inv must be a device pointer");
  if (count == 0) return;
  const bool ocp = format == Fp8Format::E4M3 || format == Fp8Format::E5M2;
  const bool aligned = reinterpret_cast<uintptr_t>(q) % sizeof(uint2) == 0 &&
                       reinterpret_cast<uintptr_t>(out) % sizeof(uint4) == 0;
  int64_t done = 0;
  if (ocp && aligned && count >= kCodesPerThread) {
    const int64_t groups = count / kCodesPerThread;
    dequantize_vector_kernel<<<elementwise_grid(groups), kThreads, 0, stream>>>(
        reinterpret_cast<const uint2*>(q), groups, scale_inv,
        format == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2, out);
    FP8T_CUDA_CHECK_LAUNCH();
    done = groups * kCodesPerThread;
  }
  if (done == count) return;
  dequantize_kernel<<<elementwise_grid(count - done), kThreads, 0, stream>>>(
      q + done, count - done, scale_inv, format, out + done);
  FP8T_CUDA_CHECK_LAUNCH();
}

template <typename T>
void quantize_blocks(const T* x, int64_t rows, int64_t cols, const BlockQuantization& spec,
                     uint8_t* out, void* scales, uint8_t* out_t, void* scales_t,
                     cudaStream_t stream, CastHealth* health, BlockScaleOrder order,
                     CastInput input, const bf16* relu2_input, int64_t scale_lines_t,
                     const ActivationTCast& activation_t) {
  FP8T_CHECK(rows >= 0 && cols >= 0, "expected a non-negative shape, found [{}, {}]", rows, cols);
  check_block_cast_targets(out, scales, out_t, scales_t, order, scale_lines_t, cols);
  FP8T_CHECK((activation_t.out_t == nullptr) == (activation_t.scales_t == nullptr),
             "relu²'s transposed copy and its scales go together");
  const bool with_activation_t = activation_t.out_t != nullptr;
  FP8T_CHECK(!with_activation_t ||
                 (input == CastInput::Relu2Gradient && spec.scaling == BlockScaling::Rows1x128 &&
                  (spec.format == Fp8Format::E4M3 || spec.format == Fp8Format::E5M2)),
             "relu²'s transposed copy comes with a 1x128 cast of relu²'s gradient in an OCP "
             "format");
  FP8T_CHECK(health == nullptr || out != nullptr,
             "a block cast counts the codes of out, and was given none");
  FP8T_CHECK(order != BlockScaleOrder::BlockMajor || spec.scaling == BlockScaling::Rows1x128,
             "block-major scales are for 1x128 blocks");
  FP8T_CHECK(order != BlockScaleOrder::PaddedLineMajor || spec.scaling == BlockScaling::Tile128x128,
             "padded line-major scales are for 128x128 tiles");
  check_pointers(rows * cols, x, out != nullptr ? out : out_t);
  check_data_format(spec.format);
  if (rows * cols == 0) return;
  using Shape = BlockTileShape<T>;
  const dim3 grid = block_cast_grid(rows, cols);
  const BlockCastTargets targets = block_cast_targets(
      x, relu2_input, rows, cols, out, scales, out_t, scales_t, order, scale_lines_t, activation_t);
  dispatch_cast_input<T>(input, relu2_input, [&](auto input_constant) {
    dispatch_data_format(spec.format, [&](auto format_constant) {
      dispatch_health(health, [&](auto health_constant) {
        constexpr CastInput kInput = decltype(input_constant)::value;
        constexpr Fp8Format kFormat = decltype(format_constant)::value;
        constexpr bool kHealth = decltype(health_constant)::value;
        const auto launch = [&](const auto kernel, size_t shared_bytes) {
          allow_shared_bytes(reinterpret_cast<const void*>(kernel), shared_bytes);
          kernel<<<grid, kThreads, shared_bytes, stream>>>(x, relu2_input, rows, cols, spec,
                                                           targets, health, RotaryNormGradient{});
        };
        constexpr bool kOcp = kFormat == Fp8Format::E4M3 || kFormat == Fp8Format::E5M2;
        if constexpr (kInput == CastInput::Relu2Gradient && kOcp) {
          if (with_activation_t) {
            return launch(block_quantize_kernel<T, kFormat, kInput, kHealth, true>,
                          2 * Shape::kSharedBytes);
          }
        }
        launch(block_quantize_kernel<T, kFormat, kInput, kHealth, false>, Shape::kSharedBytes);
      });
    });
  });
  FP8T_CUDA_CHECK_LAUNCH();
}

void quantize_blocks_rotary_norm_gradient(const bf16* gradient, int64_t rows, int64_t cols,
                                          const RotaryNormGradient& input,
                                          const BlockCastOutput& cast, cudaStream_t stream) {
  const BlockQuantization& spec = cast.spec;
  FP8T_CHECK(rows >= 0 && cols > 0 && cols % kBlockTile == 0,
             "expected heads of {} columns, found a gradient of [{}, {}]", kBlockTile, rows, cols);
  FP8T_CHECK(spec.scaling == BlockScaling::Rows1x128 &&
                 (spec.format == Fp8Format::E4M3 || spec.format == Fp8Format::E5M2),
             "the rotary norm's gradient is cast in 1x128 blocks of an OCP format");
  FP8T_CHECK(cast.out != nullptr && cast.out_t != nullptr,
             "the rotary norm's gradient is cast in both orientations");
  check_block_cast_targets(cast.out, cast.scales, cast.out_t, cast.scales_t,
                           BlockScaleOrder::BlockMajor, cast.scale_lines_t, cols);
  if (rows == 0) return;
  FP8T_CHECK(input.seq_len > 0, "expected a positive sequence length, found {}", input.seq_len);
  check_pointers(rows * cols, gradient, input.output);
  check_pointers(rows, input.rstd, input.rstd);
  FP8T_CHECK(aligned16(gradient) && aligned16(input.output) && aligned16(input.cos) &&
                 aligned16(input.sin),
             "the rotary norm's gradient, output and tables must be 16-byte aligned, found {}, "
             "{}, {} and {}",
             static_cast<const void*>(gradient), static_cast<const void*>(input.output),
             static_cast<const void*>(input.cos), static_cast<const void*>(input.sin));
  const dim3 grid = block_cast_grid(rows, cols);
  const BlockCastTargets targets =
      block_cast_targets(gradient, input.output, rows, cols, cast.out, cast.scales, cast.out_t,
                         cast.scales_t, BlockScaleOrder::BlockMajor, cast.scale_lines_t, {});
  dispatch_data_format(spec.format, [&](auto format_constant) {
    constexpr Fp8Format kFormat = decltype(format_constant)::value;
    if constexpr (kFormat == Fp8Format::E4M3 || kFormat == Fp8Format::E5M2) {
      const auto kernel =
          block_quantize_kernel<bf16, kFormat, CastInput::RotaryNormGradient, false, false>;
      const size_t shared_bytes = BlockTileShape<bf16>::kSharedBytes;
      allow_shared_bytes(reinterpret_cast<const void*>(kernel), shared_bytes);
      kernel<<<grid, kThreads, shared_bytes, stream>>>(gradient, input.output, rows, cols, spec,
                                                       targets, nullptr, input);
    }
  });
  FP8T_CUDA_CHECK_LAUNCH();
}

void quantize_tiles_grouped(const std::vector<TileCastJob>& jobs, const BlockQuantization& spec,
                            cudaStream_t stream) {
  FP8T_CHECK(spec.scaling == BlockScaling::Tile128x128,
             "a grouped block cast is of 128x128 tiles, found {} blocks",
             spec.scaling == BlockScaling::Rows1x128 ? "1x128" : "1x32");
  check_data_format(spec.format);
  for (size_t first = 0; first < jobs.size(); first += kMaxTileCastJobs) {
    TileCastGroup group{};
    int64_t tiles = 0;
    for (size_t i = first; i < std::min(jobs.size(), first + kMaxTileCastJobs); ++i) {
      const TileCastJob& job = jobs[i];
      FP8T_CHECK(job.rows >= 0 && job.cols >= 0,
                 "expected a non-negative shape, found [{}, {}] (tensor {} of the group)", job.rows,
                 job.cols, i);
      check_block_cast_targets(job.out, job.scales, job.out_t, job.scales_t,
                               BlockScaleOrder::PaddedLineMajor, 0, job.cols);
      check_pointers(job.rows * job.cols, job.x, job.out != nullptr ? job.out : job.out_t);
      const dim3 grid = block_cast_grid(job.rows, job.cols);
      group.jobs[group.count] = {
          job.x, job.rows, job.cols,
          block_cast_targets(job.x, nullptr, job.rows, job.cols, job.out, job.scales, job.out_t,
                             job.scales_t, BlockScaleOrder::PaddedLineMajor, 0, {})};
      group.first_tile[group.count++] = tiles;
      if (job.rows * job.cols != 0) tiles += int64_t{grid.x} * grid.y;
    }
    group.first_tile[group.count] = tiles;
    if (tiles == 0) continue;
    FP8T_CHECK(tiles <= std::numeric_limits<int32_t>::max(),
               "expected at most 2^31 - 1 tiles in a group, found {}", tiles);
    dispatch_data_format(spec.format, [&](auto format_constant) {
      constexpr Fp8Format kFormat = decltype(format_constant)::value;
      const auto kernel = grouped_tile_cast_kernel<kFormat>;
      const size_t shared_bytes = BlockTileShape<float>::kSharedBytes;
      allow_shared_bytes(reinterpret_cast<const void*>(kernel), shared_bytes);
      kernel<<<static_cast<unsigned>(tiles), kThreads, shared_bytes, stream>>>(group, spec);
    });
    FP8T_CUDA_CHECK_LAUNCH();
  }
}

template <typename Out>
void dequantize_blocks(const uint8_t* q, int64_t rows, int64_t cols, const BlockQuantization& spec,
                       const void* scales, Out* out, cudaStream_t stream) {
  FP8T_CHECK(rows >= 0 && cols >= 0, "expected a non-negative shape, found [{}, {}]", rows, cols);
  check_pointers(rows * cols, q, out);
  check_pointers(rows * cols, scales, scales);
  if (rows * cols == 0) return;
  block_dequantize_kernel<<<elementwise_grid(rows * cols), kThreads, 0, stream>>>(
      q, rows, cols, spec, scales, out);
  FP8T_CUDA_CHECK_LAUNCH();
}

#define FP8T_INSTANTIATE_CUDA_QUANTIZE(T)                                                          \
  template void amax<T>(const T*, int64_t, float*, cudaStream_t, CastInput, const bf16*);          \
  template void quantize<T>(const T*, int64_t, const float*, Fp8Format, uint8_t*, float*,          \
                            cudaStream_t, CastInput, const bf16*, CastHealth*);                    \
  template void quantize_transpose<T>(const T*, int64_t, int64_t, const float*, Fp8Format,         \
                                      uint8_t*, uint8_t*, float*, cudaStream_t, CastInput,         \
                                      const bf16*, CastHealth*);                                   \
  template void quantize_blocks<T>(const T*, int64_t, int64_t, const BlockQuantization&, uint8_t*, \
                                   void*, uint8_t*, void*, cudaStream_t, CastHealth*,              \
                                   BlockScaleOrder, CastInput, const bf16*, int64_t,               \
                                   const ActivationTCast&);

FP8T_INSTANTIATE_CUDA_QUANTIZE(float)
FP8T_INSTANTIATE_CUDA_QUANTIZE(bf16)

#define FP8T_INSTANTIATE_CUDA_DEQUANTIZE(Out)                                                      \
  template void dequantize<Out>(const uint8_t*, int64_t, const float*, Fp8Format, Out*,            \
                                cudaStream_t);                                                     \
  template void dequantize_blocks<Out>(const uint8_t*, int64_t, int64_t, const BlockQuantization&, \
                                       const void*, Out*, cudaStream_t);

FP8T_INSTANTIATE_CUDA_DEQUANTIZE(float)
FP8T_INSTANTIATE_CUDA_DEQUANTIZE(bf16)

}  // namespace fp8t::cuda
