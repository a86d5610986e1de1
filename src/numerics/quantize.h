// Quantization to FP8, CPU reference. Every CUDA kernel in quantize_cuda.h must produce
// exactly these bytes and scales.
//
// Layouts: tensors are row-major [rows, cols]. A transposed output is row-major [cols, rows].
// Block scales are row-major over the block grid: 1xB blocks give [rows, ceil(cols/B)],
// 128x128 blocks give [ceil(rows/128), ceil(cols/128)]. A block that runs past the edge of the
// tensor covers only the elements that exist (its amax is theirs); shapes need not be
// multiples of the block.
#pragma once

#include <cstdint>

#include "numerics/float_bits.h"
#include "numerics/formats.h"

namespace fp8t {

// max |x|; NaN if any element is NaN. Zero for an empty tensor.
template <typename T>
float amax(const T* x, int64_t count);

// What a cast did to its values, for FP8 statistics: the elements whose scaled value lies
// beyond the format's largest finite value (saturated to ±max), and the non-zero elements whose
// scaled value encodes to zero (underflow). NaNs count as neither. The counts accumulate over
// calls; the element count is the caller's.
struct CastHealth {
  unsigned long long saturated = 0;
  unsigned long long underflow = 0;
};

// One element's part of CastHealth: `value` the cast's input, `scaled` value·scale, `code` its
// encoding.
FP8T_HD inline bool cast_saturates(float scaled, float format_maximum) {
  return scaled > format_maximum || scaled < -format_maximum;  // NaN: neither
}
FP8T_HD inline bool cast_underflows(float value, uint8_t code) {
  return value != 0.0f && value == value && (code & 0x7Fu) == 0;  // ±0 in every format
}

// out[i] = encode_saturating(x[i] * scale): the per-tensor cast of delayed and tensorwise
// scaling. When amax_out is not null, *amax_out = max(*amax_out, amax(x)) (NaN sticks); when
// health is not null, the cast's counts are added to it.
template <typename T>
void quantize(const T* x, int64_t count, float scale, Fp8Format format, uint8_t* out,
              float* amax_out, CastHealth* health = nullptr);

// quantize() plus the transposed copy out_t [cols, rows] that dgrad and wgrad GEMMs read.
template <typename T>
void quantize_transpose(const T* x, int64_t rows, int64_t cols, float scale, Fp8Format format,
                        uint8_t* out, uint8_t* out_t, float* amax_out,
                        CastHealth* health = nullptr);

// out[i] = decode(q[i]) * scale_inv
void dequantize(const uint8_t* q, int64_t count, float scale_inv, Fp8Format format, float* out);

// Block scalings with fp32 scales (fp8_recipe: blockwise) and E8M0 scales (mxfp8).
enum class BlockScaling : uint8_t {
  Rows1x128,    // activations and gradients
  Tile128x128,  // weights
  Mx1x32,       // MXFP8, E8M0 scales
};

struct BlockShape {
  int rows;
  int cols;
};

FP8T_HD inline BlockShape block_shape(BlockScaling scaling) {
  switch (scaling) {
    case BlockScaling::Rows1x128:
      return {1, 128};
    case BlockScaling::Tile128x128:
      return {128, 128};
    case BlockScaling::Mx1x32:
      return {1, 32};
  }
  return {1, 1};
}

// Rows and columns of the scale grid for a [rows, cols] tensor.
FP8T_HD inline BlockShape scale_grid(BlockScaling scaling, int64_t rows, int64_t cols) {
  const BlockShape block = block_shape(scaling);
  return {static_cast<int>((rows + block.rows - 1) / block.rows),
          static_cast<int>((cols + block.cols - 1) / block.cols)};
}

struct BlockQuantization {
  BlockScaling scaling = BlockScaling::Rows1x128;
  Fp8Format format = Fp8Format::E4M3;
  bool power_of_2_scales = true;  // fp32 scales only; E8M0 scales are powers of two
  float amax_epsilon = 0.0f;      // fp32 scales only
};

// Per block: scale from the block's amax; out = encode_saturating(x * scale). The scale
// tensor receives scale_inv (fp32) for blockwise, or the E8M0 code (one byte) for Mx1x32:
// `scales` points to float or uint8_t storage accordingly.
//
// health (may be null): the cast's counts over the codes of `out`, rows·cols elements per
// call, with `scaled` = x · its block's multiplier. A scale from the block's own amax keeps
// finite values within ±max, except where an fp32 scale that is no power of two rounds up and
// puts the amax an ulp above max. A block holding an infinity has the fp32 scale 1 (its values
// beyond ±max saturate) or the E8M0 scale 2^127 (its finite values underflow). An MX block
// holding a NaN has the NaN scale, which casts all its elements to NaN; the FNUZ formats encode
// that as 0x80, the bits of -0 elsewhere, and such elements count as neither.
template <typename T>
void quantize_blocks(const T* x, int64_t rows, int64_t cols, const BlockQuantization& spec,
                     uint8_t* out, void* scales, CastHealth* health = nullptr);

// Both the row-wise quantization of x and that of its transpose [cols, rows] (for dgrad and
// wgrad). For Tile128x128 the transposed data is exactly the transpose of `out` and its
// scales the transpose of `scales`; for 1xB blocks the transposed copy has its own blocks,
// running along the original columns. health counts the codes of `out` as quantize_blocks()
// does: the transposed copy holds the same values, cast again (in other blocks for 1xB), and
// is not counted.
template <typename T>
void quantize_transpose_blocks(const T* x, int64_t rows, int64_t cols,
                               const BlockQuantization& spec, uint8_t* out, void* scales,
                               uint8_t* out_t, void* scales_t, CastHealth* health = nullptr);

// x[i] = decode(q[i]) * scale_inv of its block.
void dequantize_blocks(const uint8_t* q, int64_t rows, int64_t cols, const BlockQuantization& spec,
                       const void* scales, float* out);

}  // namespace fp8t
