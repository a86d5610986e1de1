// The GPU counterparts of the GPT's CPU ops (src/ops): RMSNorm, rotary (alone or fused with the
// per-head RMSNorm of q and k), relu^2, the residual mix, the embedding and the soft-capped
// cross-entropy. Same semantics as the CPU ops, in the GPU path's precisions: activations and
// their gradients bf16, statistics (1/rms, losses), parameters and parameter gradients fp32,
// all arithmetic inside the kernels fp32.
//
// Host launchers take device pointers, sizes and a stream, check their arguments (throwing
// fp8t::Error), and check the launch. They run asynchronously on the stream.
//
// Gradients: a backward launcher writes or adds its activation gradients (bf16) as its
// GradStore argument says; parameter gradients (fp32) are always added to, like the CPU ops do,
// so that micro-batches accumulate. A gradient buffer never aliases an input of its backward.
//
// This header is C++17 and compiles in host C++ translation units. Below the declarations, a
// section seen only by nvcc holds the device helpers the kernels of src/ops/cuda share.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "numerics/float_bits.h"
#include "numerics/formats.h"

namespace fp8t::cuda {
struct BlockCastOutput;  // numerics/quantize_cuda.h
}  // namespace fp8t::cuda

namespace fp8t::ops::cuda {

// How a backward stores an activation gradient: Write replaces the buffer's contents (nothing
// to zero first, and every element is written), Add adds into it (the CPU ops' convention).
enum class GradStore : uint8_t { Write, Add };

// --- RMSNorm without weight (ops/rmsnorm.h), row by row over [rows, dim] (norm_rotary.cu) ---

inline constexpr int kFusedCastBlock = 128;  // the columns of a fused cast's block scale

// An FP8 cast fused into the kernel that produces a bf16 tensor, reading the bf16 values it
// stores: out = encode_saturating(value * *scale) when out is set (the bytes of
// numerics/quantize_cuda.h's quantize), and *amax = max(*amax, max |value|) when amax is set
// (amax bit patterns, as there). The default does neither.
//
// With block_scales (blockwise: out set, scale and amax null), each 1x128 block of a row takes
// the scale of its own amax instead, and its inverse lands at block_scales[block * rows + row]:
// the bytes and block-major scales of quantize_blocks() with Rows1x128, which the block-scaled
// GEMMs read.
struct FusedCast {
  const float* scale = nullptr;
  Fp8Format format = Fp8Format::E4M3;
  uint8_t* out = nullptr;  // [rows, dim] like the bf16 output
  float* amax = nullptr;
  float* block_scales = nullptr;  // [dim / kFusedCastBlock, rows]
  bool power_of_2_scales = true;  // of the block scales, as BlockQuantization's
  float amax_epsilon = 0.0f;
};

// out = inp * rstd, rstd = 1 / sqrt(mean(inp^2) + eps) (writes out and rstd [rows]). eps as the
// CPU op's: ops::kRmsNormEps, the float machine epsilon. out may be inp (in place). `cast`: the
// FP8 copy and/or the amax of out, in the same pass (the input of an FP8 linear); block scales
// need dim a multiple of 128 and 16-byte aligned rows.
void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, int64_t rows, int64_t dim, float eps,
                     cudaStream_t stream, const FusedCast& cast = {});

// dinp (store) = rstd * (dout - out * mean(dout * out)), from the forward's output and rstd.
void rmsnorm_backward(bf16* dinp, const bf16* dout, const bf16* out, const float* rstd,
                      int64_t rows, int64_t dim, GradStore store, cudaStream_t stream);

// --- Rotary (ops/rotary.h), nanochat's layout: x [batch, seq_len, heads, head_dim], each head's
// first half paired with its second half; tables cos, sin [>= seq_len, head_dim / 2] fp32 from
// ops::rotary_tables (row t for position t). (norm_rotary.cu) ---

struct RotaryShape {
  int64_t batch;
  int64_t seq_len;
  int64_t heads;
  int64_t head_dim;  // even
};

// out = rotate(inp) (writes): y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos. out may be inp.
void rotary_forward(bf16* out, const bf16* inp, const float* cos, const float* sin,
                    const RotaryShape& shape, cudaStream_t stream);

// dinp (store) = the transposed rotation of dout.
void rotary_backward(bf16* dinp, const bf16* dout, const float* cos, const float* sin,
                     const RotaryShape& shape, GradStore store, cudaStream_t stream);

// q and k as the GPT makes them: the rotation, then RMSNorm over each head's head_dim channels,
// in one pass without rounding in between (the x1.2 of nanochat is folded into the attention's
// softmax scale). Writes out and rstd [batch * seq_len * heads]; out may be inp.
void rotary_rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const float* cos,
                            const float* sin, const RotaryShape& shape, float eps,
                            cudaStream_t stream);

// dinp (store) = rotary backward of the RMSNorm backward of dout, from the fused forward's
// output and rstd.
void rotary_rmsnorm_backward(bf16* dinp, const bf16* dout, const bf16* out, const float* rstd,
                             const float* cos, const float* sin, const RotaryShape& shape,
                             GradStore store, cudaStream_t stream);

// The head dim of rotary_rmsnorm_backward_cast: a head is one 1x128 block.
inline constexpr int64_t kRotaryCastHeadDim = 128;

// rotary_rmsnorm_backward's dinp (head_dim kRotaryCastHeadDim) cast in 1x128 blocks into `cast`
// instead of being stored, for the FP8 linear that reads it (CudaLinear::fused_grad_output_cast):
// numerics/quantize_cuda.h quantize_blocks_rotary_norm_gradient.
void rotary_rmsnorm_backward_cast(const bf16* dout, const bf16* out, const float* rstd,
                                  const float* cos, const float* sin, const RotaryShape& shape,
                                  const fp8t::cuda::BlockCastOutput& cast, cudaStream_t stream);

// --- Pointwise ops (ops/elementwise.h) over n elements (elementwise.cu) ---

// out = relu(inp)^2 (writes); out may be inp, but the backward needs inp.
void relu2_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream);

// dinp (store) = 2 relu(inp) dout.
void relu2_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t n, GradStore store,
                    cudaStream_t stream);

// out = a + b (writes); out may be a or b.
void add_forward(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream);

// out = bf16(inp), rounded to nearest even (weights cast for the BF16 GEMMs).
void cast_to_bf16(bf16* out, const float* inp, int64_t n, cudaStream_t stream);

// out = *resid_lambda * x + *x0_lambda * x0 (writes), the lambdas read on the device. out may
// be x, but the backward needs x.
void residual_mix_forward(bf16* out, const bf16* x, const bf16* x0, const float* resid_lambda,
                          const float* x0_lambda, int64_t n, cudaStream_t stream);

// fp32 scratch that residual_mix_backward needs: one pair of partial sums per block.
inline constexpr int64_t kResidualMixMaxBlocks = 1024;
inline constexpr int64_t kResidualMixWorkspaceFloats = 2 * kResidualMixMaxBlocks;

// dx (dx_store) = *resid_lambda * dout; dx0 (dx0_store) = *x0_lambda * dout;
// *dresid_lambda += sum(dout * x); *dx0_lambda += sum(dout * x0). The sums are deterministic
// (block partials in workspace, then one block adds them in a fixed order, in double).
// workspace: kResidualMixWorkspaceFloats floats, contents irrelevant.
void residual_mix_backward(bf16* dx, bf16* dx0, float* dresid_lambda, float* dx0_lambda,
                           const bf16* dout, const bf16* x, const bf16* x0,
                           const float* resid_lambda, const float* x0_lambda, int64_t n,
                           GradStore dx_store, GradStore dx0_store, float* workspace,
                           cudaStream_t stream);

// --- Embedding (ops/embedding.h): table fp32 [vocab, dim], ids int32 [num_tokens]
// (embedding.cu). Ids are not checked on the host (they live on the device): an id outside
// [0, vocab) gives a row of NaN in the forward and is skipped by the backward. ---

// out [num_tokens, dim] = bf16(table[ids[n]]) (writes); the table fp32 or bf16 (the GPT's
// embedding tables on the GPU).
void embedding_forward(bf16* out, const int32_t* ids, const float* table, int64_t num_tokens,
                       int64_t vocab, int64_t dim, cudaStream_t stream);
void embedding_forward(bf16* out, const int32_t* ids, const bf16* table, int64_t num_tokens,
                       int64_t vocab, int64_t dim, cudaStream_t stream);

// dtable[ids[n]] += dout[n] with fp32 atomics: fast, but the order in which repeated ids sum
// varies from run to run, so the last bits of dtable do too.
void embedding_backward(float* dtable, const bf16* dout, const int32_t* ids, int64_t num_tokens,
                        int64_t vocab, int64_t dim, cudaStream_t stream);

// The same sum, bit-reproducible: the tokens are sorted by id (a stable radix sort), and each
// id's rows are summed in token order by one thread per column chunk, then added to dtable.
// workspace: embedding_backward_deterministic_workspace_bytes(num_tokens, vocab) bytes.
size_t embedding_backward_deterministic_workspace_bytes(int64_t num_tokens, int64_t vocab);
void embedding_backward_deterministic(float* dtable, const bf16* dout, const int32_t* ids,
                                      int64_t num_tokens, int64_t vocab, int64_t dim,
                                      void* workspace, size_t workspace_bytes, cudaStream_t stream);

// --- Soft-capped cross-entropy (ops/cross_entropy.h) (cross_entropy.cu) ---
// logits bf16 [rows, padded_vocab], of which the first vocab columns count; targets int32
// [rows], each -1 (ignored) or in [0, vocab) (any other target gives that row a NaN loss and
// gradient). capped = softcap * tanh(logit / softcap) (softcap: ops::kLogitSoftcap, 15).
// Writes row_losses [rows] fp32 (0 for ignored rows), *valid_rows (the rows not ignored) and,
// when mean_loss is not null, *mean_loss = sum(row_losses) / valid_rows (0 without valid rows,
// summed in a fixed order). Each row is one block: an online-softmax pass over the logits,
// then (with the gradient) a second pass that writes it; no fp32 copy of the logits is made.

void softcap_cross_entropy_forward(const bf16* logits, const int32_t* targets, int64_t rows,
                                   int64_t vocab, int64_t padded_vocab, float softcap,
                                   float* row_losses, float* mean_loss, int32_t* valid_rows,
                                   cudaStream_t stream);

// As the forward, and overwrites the logits with dloss * d(mean loss)/d(logits) in bf16:
// (softmax - onehot(target)) * (1 - tanh^2) * dloss / valid_rows on the real vocab columns,
// 0 on the padding columns and on ignored rows.
void softcap_cross_entropy_with_gradient(bf16* logits, const int32_t* targets, int64_t rows,
                                         int64_t vocab, int64_t padded_vocab, float softcap,
                                         float dloss, float* row_losses, float* mean_loss,
                                         int32_t* valid_rows, cudaStream_t stream);

// --- Transposes of cast FP8 weights (fp8_transpose.cu) ---
// out [cols, rows] = the bytes of in [rows, cols] transposed; rows and cols multiples of 4,
// both buffers 4-byte aligned.
void transpose_fp8(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                   cudaStream_t stream);
// A 128x128 grid [grid_rows, grid_cols] in the GEMMs' padded layout, each row padded to a
// multiple of 4 K-blocks with zeros (as the weight casts write it, BlockScaleOrder::
// PaddedLineMajor), into its transpose's, out [grid_cols, ceil(grid_rows / 4) * 4], zeros in
// the pads.
void transpose_tile_scale_grid(float* out, const float* padded, int64_t grid_rows,
                               int64_t grid_cols, cudaStream_t stream);

}  // namespace fp8t::ops::cuda

#if defined(__CUDACC__)
// --- Device helpers shared by the kernels of src/ops/cuda (nvcc only) ---
#include <algorithm>
#include <initializer_list>

#include <cuda_bf16.h>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "core/error.h"
#include "numerics/scaling.h"

namespace fp8t::ops::cuda::device {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
// Elements per 16-byte vector of bf16.
constexpr int kBf16Vector = 8;

// Blocks for a grid-stride loop that would take blocks_needed blocks to give every item its own
// thread: enough to fill every SM blocks_per_sm times, no more than the work needs.
inline unsigned grid_size(int64_t blocks_needed, int blocks_per_sm) {
  const int64_t most = int64_t{multiprocessor_count()} * blocks_per_sm;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(blocks_needed, most)));
}

inline bool aligned16(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

// Whether every pointer is 16-byte aligned (the vector paths' condition).
inline bool all_aligned(std::initializer_list<const void*> pointers) {
  for (const void* pointer : pointers)
    if (!aligned16(pointer)) return false;
  return true;
}

// Every pointer of a launcher over count elements (or rows, or tokens) set, unless count is 0.
inline void check_pointers(int64_t count, std::initializer_list<const void*> pointers) {
  for (const void* pointer : pointers)
    FP8T_CHECK(count == 0 || pointer != nullptr, "null device pointer for {} elements", count);
}

// A FusedCast a launcher over rows of `dim` values was given: an FP8 format, a scale for a
// per-tensor output, and block scales only with an output and neither scale nor amax, on the
// launcher's vector path (`vector_path`) and for dim a multiple of kFusedCastBlock.
inline void check_fused_cast(const FusedCast& cast, int64_t dim, bool vector_path) {
  const bool blocks = cast.block_scales != nullptr;
  FP8T_CHECK(cast.out == nullptr || cast.scale != nullptr || blocks,
             "an FP8 output needs its scale");
  FP8T_CHECK(cast.format != Fp8Format::E8M0, "expected an FP8 data format, found e8m0");
  FP8T_CHECK(!blocks || (cast.out != nullptr && cast.scale == nullptr && cast.amax == nullptr),
             "a block-scaled fused cast needs its output and takes no per-tensor scale or amax");
  FP8T_CHECK(!blocks || (vector_path && dim % kFusedCastBlock == 0),
             "a block-scaled fused cast needs a dim that is a multiple of {} and 16-byte aligned "
             "rows, found dim {}",
             kFusedCastBlock, dim);
}

__device__ inline float to_f32(bf16 value) {
  return __uint_as_float(uint32_t{value.bits} << 16);
}

__device__ inline bf16 to_bf16(float value) {
  return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(value))};
}

// 8 bf16 from a 16-byte aligned address, widened to fp32.
__device__ inline void load_bf16x8(const bf16* source, float (&values)[kBf16Vector]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(source);
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    values[2 * k] = __uint_as_float(words[k] << 16);
    values[2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
  }
}

// 8 fp32 from a 16-byte aligned address.
__device__ inline void load_f32x8(const float* source, float (&values)[kBf16Vector]) {
  const float4 low = *reinterpret_cast<const float4*>(source);
  const float4 high = *reinterpret_cast<const float4*>(source + 4);
  values[0] = low.x, values[1] = low.y, values[2] = low.z, values[3] = low.w;
  values[4] = high.x, values[5] = high.y, values[6] = high.z, values[7] = high.w;
}

// 8 fp32 rounded to bf16 (to nearest even), stored as one 16-byte access.
__device__ inline void store_bf16x8(bf16* destination, const float (&values)[kBf16Vector]) {
  uint32_t words[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(values[2 * k], values[2 * k + 1]);
    words[k] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  *reinterpret_cast<uint4*>(destination) = make_uint4(words[0], words[1], words[2], words[3]);
}

// kWidth (8 or 1) bf16 as fp32: one 16-byte access or a single element.
template <int kWidth>
__device__ inline void load_bf16(const bf16* source, float (&values)[kWidth]) {
  if constexpr (kWidth == kBf16Vector) {
    load_bf16x8(source, values);
  } else {
    static_assert(kWidth == 1, "vectors of 8 or single elements");
    values[0] = to_f32(*source);
  }
}

template <int kWidth>
__device__ inline void store_bf16(bf16* destination, const float (&values)[kWidth]) {
  if constexpr (kWidth == kBf16Vector) {
    store_bf16x8(destination, values);
  } else {
    static_assert(kWidth == 1, "vectors of 8 or single elements");
    *destination = to_bf16(values[0]);
  }
}

// Sum over the lanes of groups of kGroup consecutive lanes (kGroup a power of two <= 32); every
// lane of a group gets its group's sum.
template <int kGroup = kWarpSize>
__device__ inline float group_sum(float value) {
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

// a[:count] . b[:count] over a warp, in fp32; every lane gets the sum. kVector: lane l takes the
// 8-element vectors at 8 l, 8 (l + 32), ... (count % 8 == 0, a and b 16-byte aligned);
// otherwise the elements l, l + 32, ...
template <bool kVector>
__device__ inline float warp_dot(const bf16* a, const bf16* b, int64_t count) {
  const int lane = threadIdx.x % kWarpSize;
  float sum = 0.0f;
  if constexpr (kVector) {
    for (int64_t i = lane * kBf16Vector; i < count; i += kWarpSize * kBf16Vector) {
      float a_v[kBf16Vector], b_v[kBf16Vector];
      load_bf16x8(a + i, a_v);
      load_bf16x8(b + i, b_v);
#pragma unroll
      for (int k = 0; k < kBf16Vector; ++k)
        sum = fmaf(a_v[k], b_v[k], sum);
    }
  } else {
    for (int64_t i = lane; i < count; i += kWarpSize)
      sum = fmaf(to_f32(a[i]), to_f32(b[i]), sum);
  }
  return group_sum(sum);
}

// Sum over a block of kThreads threads (a multiple of 32), in a fixed order; every thread gets
// the sum. Contains __syncthreads(): call from all threads.
template <int kThreads, typename T>
__device__ inline T block_sum(T value) {
  static_assert(kThreads % kWarpSize == 0 && kThreads <= 1024, "whole warps, at most 1024");
  constexpr int kWarps = kThreads / kWarpSize;
  __shared__ T warp_sums[kWarps];
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(kFullMask, value, offset);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  T total = lane < kWarps ? warp_sums[lane] : T(0);
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    total += __shfl_xor_sync(kFullMask, total, offset);
  __syncthreads();  // warp_sums may be reused by the caller's next block_sum
  return total;
}

// The FP8 side of a FusedCast in the kernel that produces its tensor, per thread: the amax of the
// values the thread saw, and their codes under the per-tensor scale or their 1x128 block's.
// Vectors of 8 values; for block scales the 16 lanes of a half warp hold one block (a row's
// columns [128 b, 128 b + 128) at lanes 16 h .. 16 h + 15, 8 each, all of them active together).
struct FusedCastState {
  FusedCast cast;
  float scale = 1.0f;
  uint32_t amax_bits = 0;

  // Reads the per-tensor scale (when there is one to cast with).
  __device__ explicit FusedCastState(const FusedCast& fused) : cast(fused) {
    if (cast.out != nullptr && cast.block_scales == nullptr) scale = *cast.scale;
  }

  // The codes of kWidth values as stored (rounded to bf16), folding them into the amax. With
  // block scales (kWidth 8): the values at `column` of `row` in a tensor of `rows` rows, each
  // block's inverse scale stored block-major. The bytes of quantize() or of quantize_blocks()
  // (numerics/quantize_cuda.h).
  template <bool kBlocks = false, int kWidth>
  __device__ void encode(const float (&rounded)[kWidth], uint8_t (&codes)[kWidth], int64_t row = 0,
                         int64_t rows = 0, int64_t column = 0) {
    static_assert(!kBlocks || kWidth == kBf16Vector, "a block's lanes hold 8 values each");
    constexpr int kBlockLanes = kFusedCastBlock / kBf16Vector;
#pragma unroll
    for (int k = 0; k < kWidth; ++k)
      amax_bits = max(amax_bits, abs_bits(rounded[k]));
    float multiplier = scale;
    if constexpr (kBlocks) {
      const int lane = threadIdx.x % kWarpSize;
      const unsigned half_warp = 0xFFFFu << (lane & kBlockLanes);
      uint32_t block_amax = amax_bits;
#pragma unroll
      for (int offset = kBlockLanes / 2; offset > 0; offset /= 2)
        block_amax = max(block_amax, __shfl_xor_sync(half_warp, block_amax, offset));
      multiplier = fp8t::scale_from_amax(bits_to_float(block_amax), format_max(cast.format),
                                         cast.power_of_2_scales, cast.amax_epsilon);
      if (lane % kBlockLanes == 0)
        cast.block_scales[column / kFusedCastBlock * rows + row] = 1.0f / multiplier;
      amax_bits = 0;  // a block's amax is its own
    }
#pragma unroll
    for (int k = 0; k < kWidth; ++k)
      codes[k] = fp8t::encode(__fmul_rn(rounded[k], multiplier), cast.format, Saturation::Saturate);
  }

  // The block's amax into *cast.amax, one atomic per block: call from every thread of the block
  // (whole warps; it synchronizes them).
  __device__ void publish() {
    const uint32_t block = block_max_bits(amax_bits);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<unsigned int*>(cast.amax), block);
  }
};

}  // namespace fp8t::ops::cuda::device
#endif
