// Quantization kernels: the device counterparts of quantize.h, bit-identical to it.
// Host launchers take device pointers, sizes and a stream, check their inputs, and check the
// launch. Amax outputs are fp32 buffers updated with a max over float bit patterns, so they
// accumulate across calls (micro-batches) and NaN sticks; zero them to start a new step.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "numerics/float_bits.h"
#include "numerics/formats.h"
#include "numerics/quantize.h"

namespace fp8t::cuda {

// Elementwise encode (tests the device conversions against encode_reference).
void encode(const float* x, int64_t count, Fp8Format format, Saturation saturation, uint8_t* out,
            cudaStream_t stream);
void decode(const uint8_t* codes, int64_t count, Fp8Format format, float* out, cudaStream_t stream);

// What a per-tensor cast reads (the relu² forms from bf16 x only):
//  - Value: x itself;
//  - Relu2: relu(x)² rounded to bf16: the GPT's MLP activation, cast straight from the MLP's
//    hidden layer so that the activation itself is never stored (the bytes of relu2_forward
//    followed by a cast of its output);
//  - Relu2Gradient: x is the gradient of relu(p)², p (relu2_input, the same shape) its input:
//    2·relu(p)·x rounded to bf16, the gradient of p, cast without being stored (the bytes of
//    relu2_backward followed by a cast of its output).
//  - RotaryNormGradient: the block cast of quantize_blocks_rotary_norm_gradient() alone.
enum class CastInput : uint8_t { Value, Relu2, Relu2Gradient, RotaryNormGradient };

// *amax_inout = max(*amax_inout, max |input|)
template <typename T>
void amax(const T* x, int64_t count, float* amax_inout, cudaStream_t stream,
          CastInput input = CastInput::Value, const bf16* relu2_input = nullptr);

// Tensorwise scaling on the device: scale and scale_inv from an amax, by scale_from_amax().
void scale_from_amax(const float* amax, float format_max, bool power_of_2, float epsilon,
                     float* scale, float* scale_inv, cudaStream_t stream);

// Fused cast + amax: out = encode_saturating(input * *scale); amax_inout may be null. health
// (a device CastHealth, quantize.h; may be null): the cast's saturated and underflowed elements
// are added to it, counted as the cast goes (no second pass over the data).
template <typename T>
void quantize(const T* x, int64_t count, const float* scale, Fp8Format format, uint8_t* out,
              float* amax_inout, cudaStream_t stream, CastInput input = CastInput::Value,
              const bf16* relu2_input = nullptr, CastHealth* health = nullptr);

// Fused cast + transpose + amax: out [rows, cols] (may be null: the transposed copy alone) and
// out_t [cols, rows].
template <typename T>
void quantize_transpose(const T* x, int64_t rows, int64_t cols, const float* scale,
                        Fp8Format format, uint8_t* out, uint8_t* out_t, float* amax_inout,
                        cudaStream_t stream, CastInput input = CastInput::Value,
                        const bf16* relu2_input = nullptr, CastHealth* health = nullptr);

// out = decode(q) · *scale_inv, stored as float or rounded to bf16.
template <typename Out>
void dequantize(const uint8_t* q, int64_t count, const float* scale_inv, Fp8Format format, Out* out,
                cudaStream_t stream);

// Where quantize_blocks() writes the scale of block b of line l (a row of the tensor or of its
// transpose), for a tensor of L lines of B blocks: LineMajor at l·B + b, the grid of quantize.h;
// BlockMajor at b·L + l, the layout the GEMMs read for 1x128 operands (gemm/cublaslt_gemm.h);
// PaddedLineMajor (128x128 tiles only) at l·B' + b, B' = B rounded up to a multiple of 4, the
// layout the GEMMs read for 128x128 operands (ops/fp8_linear_layout.h tile_floats), the pads
// left as they are.
enum class BlockScaleOrder : uint8_t { LineMajor, BlockMajor, PaddedLineMajor };

// Block scalings, layouts as in quantize.h. out and scales may be null (no row-wise copy), and
// out_t and scales_t (no transposed copy), but not both. health (a device CastHealth; may be
// null, and is with a null out): the counts of quantize_blocks() in quantize.h, those of
// `out`'s codes alone (rows·cols elements per call, with or without the transposed copy),
// added to it as the cast goes. order: BlockMajor for Rows1x128 only. input and relu2_input:
// what the cast reads, as for quantize(). scale_lines_t (BlockMajor only; 0: cols): the
// transposed copy's scale of block b of line l goes to b·scale_lines_t + l, for casts that fill
// consecutive lines of one larger operand (the lines of out_t continue those of the cast before).
// dequantize_blocks stores float or bf16; with E8M0 (power-of-two) scales the bf16 values are
// exact down to bf16's smallest subnormal (2^-133): what the emulated MXFP8 GEMMs multiply.
//
// ActivationTCast, with a 1x128 Relu2Gradient cast in an OCP format only: relu²'s transposed
// copy as well, the e4m3 codes and 1x128 scales (in `order`, over cols lines) of a Relu2 cast of
// relu2_input's transposed copy alone, made from the same reads of relu2_input. It is the x̂ᵗ
// of the linear that reads relu²'s output, whose weight gradient can wait for the gradient cast.
struct ActivationTCast {
  uint8_t* out_t = nullptr;
  float* scales_t = nullptr;
};
template <typename T>
void quantize_blocks(const T* x, int64_t rows, int64_t cols, const BlockQuantization& spec,
                     uint8_t* out, void* scales, uint8_t* out_t, void* scales_t,
                     cudaStream_t stream, CastHealth* health = nullptr,
                     BlockScaleOrder order = BlockScaleOrder::LineMajor,
                     CastInput input = CastInput::Value, const bf16* relu2_input = nullptr,
                     int64_t scale_lines_t = 0, const ActivationTCast& activation_t = {});

// One fp32 [rows, cols] tensor of quantize_tiles_grouped(): its codes and 128x128 tile scales
// (PaddedLineMajor), and its transposed copy's (out_t and scales_t null: none).
struct TileCastJob {
  const float* x = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  uint8_t* out = nullptr;
  float* scales = nullptr;
  uint8_t* out_t = nullptr;
  float* scales_t = nullptr;
};

// quantize_blocks(job.x, job.rows, job.cols, spec, job.out, job.scales, job.out_t,
// job.scales_t, stream, nullptr, BlockScaleOrder::PaddedLineMajor) for every job, the same bytes,
// in one launch per 32 jobs: a model's weights, each too small to fill the GPU, fill it together.
// spec: Tile128x128.
void quantize_tiles_grouped(const std::vector<TileCastJob>& jobs, const BlockQuantization& spec,
                            cudaStream_t stream);

// What the input gradient of rotary followed by an RMSNorm over each 128-wide head (the GPT's q
// and k: ops/cuda/ops_cuda.h rotary_rmsnorm_backward, head_dim 128) is computed from, besides the
// gradient of its output: the forward's output and rstd, and the rotary tables.
struct RotaryNormGradient {
  const bf16* output = nullptr;  // [rows, cols], the layout of the gradient
  const float* rstd = nullptr;   // [rows, cols / 128], one per head row
  const float* cos = nullptr;    // [>= seq_len, 64], 16-byte aligned
  const float* sin = nullptr;
  int64_t seq_len = 0;  // row r sits at position r % seq_len
};

// Where a 1x128 block cast in both orientations puts its codes and block-major scales: out
// [rows, cols] and out_t [cols, rows], the transposed copy's scales strided by scale_lines_t
// lines (0: cols), as quantize_blocks() takes them.
struct BlockCastOutput {
  BlockQuantization spec;
  uint8_t* out = nullptr;
  float* scales = nullptr;
  uint8_t* out_t = nullptr;
  float* scales_t = nullptr;
  int64_t scale_lines_t = 0;
};

// The input gradient of rmsnorm(rotary(x)) per 128-wide head, from `gradient` [rows, cols]
// (cols a multiple of 128) and `input`, cast in 1x128 blocks (an OCP format, both
// orientations) without being stored: the bytes of rotary_rmsnorm_backward() followed by
// quantize_blocks() of its bf16 output.
void quantize_blocks_rotary_norm_gradient(const bf16* gradient, int64_t rows, int64_t cols,
                                          const RotaryNormGradient& input,
                                          const BlockCastOutput& cast, cudaStream_t stream);

template <typename Out>
void dequantize_blocks(const uint8_t* q, int64_t rows, int64_t cols, const BlockQuantization& spec,
                       const void* scales, Out* out, cudaStream_t stream);

}  // namespace fp8t::cuda
