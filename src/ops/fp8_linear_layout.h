// The sizes of the GPU FP8 linears' buffers (ops/cuda/linear_cuda.h), in plain C++: what the
// linears and their shared scratch take, and what the host-side memory plans count
// (models/flux_memory.h), from one set of rules.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>

#include "numerics/float_bits.h"
#include "numerics/scaling.h"

namespace fp8t::ops {

// Where an FP8 linear's Ŵᵗ (the dgrad's weight operand) comes from. Kept: its own copy, cast with
// Ŵ once per optimizer step. InBackward: Ŵ transposed into the shared scratch before each
// backward, the same bytes (a per-tensor cast is elementwise; a 128x128 tile's scale is the
// transposed tile's), one byte per weight less to hold and one transpose pass more per
// backward. Not for MXFP8, whose Ŵᵗ has its own 1x32 blocks.
enum class WeightTransposes : uint8_t { Kept, InBackward };
inline constexpr std::pair<std::string_view, WeightTransposes> kWeightTransposesNames[] = {
    {"kept", WeightTransposes::Kept}, {"in_backward", WeightTransposes::InBackward}};

// The device floats of one FP8 linear's per-tensor scaling: for each TensorRole (input, weight,
// grad_output, in that order) the inverse scale the GEMM reads, the scale the cast uses and the
// amax recorded this step, in 16 bytes (cuBLASLt wants its scale pointers 16-byte aligned).
inline constexpr int kScalingFloatsPerRole = 4;
inline constexpr int kLinearScalingFloats = 3 * kScalingFloatsPerRole;
inline constexpr int kScaleInvSlot = 0;
inline constexpr int kScaleSlot = 1;
inline constexpr int kAmaxSlot = 2;
// FP8 health's counters of one FP8 linear (a CastHealth per TensorRole, in the same order).
inline constexpr int kHealthCountersPerLinear = 3;

inline constexpr int64_t kScaleBlock = 128;   // blockwise: 1x128 blocks, 128x128 weight tiles
inline constexpr int64_t kMxScaleBlock = 32;  // MXFP8: 1x32 blocks of E8M0 scales

inline int64_t scale_blocks(int64_t count) {
  return (count + kScaleBlock - 1) / kScaleBlock;
}
// The GEMMs' scale layouts (gemm/cublaslt_gemm.h): a 1x128 operand [rows, k] takes
// [ceil(k / 128), rows] floats; a 128x128 one [ceil(rows / 128), ceil(k / 128) padded to 4]; an
// MXFP8 operand's E8M0 bytes [rows, ceil(k / 32)] are held in floats.
inline int64_t row_block_floats(int64_t rows, int64_t k) {
  return scale_blocks(k) * rows;
}
inline int64_t tile_floats(int64_t rows, int64_t k) {
  return scale_blocks(rows) * padded_tile_scale_row(scale_blocks(k));
}
inline int64_t mx_scale_floats(int64_t rows, int64_t k) {
  return (rows * ((k + kMxScaleBlock - 1) / kMxScaleBlock) + 3) / 4;
}

// Elements of each of the backward's FP8 operands (x̂ᵗ, dŷ, dŷᵗ): all max_tokens rows of layers
// up to backward_width wide, and at least a block of rows of the widest layer.
inline int64_t fp8_backward_elements(int64_t max_tokens, int64_t max_in, int64_t max_out,
                                     int64_t backward_width) {
  const int64_t widest = std::max(max_in, max_out);
  return std::max(max_tokens * std::clamp(backward_width, int64_t{1}, widest),
                  std::min(max_tokens, kScaleBlock) * widest);
}

// Floats of each block-scale scratch buffer: blockwise fp32 scales or MXFP8 E8M0 bytes of
// either orientation of any operand.
inline int64_t fp8_scale_scratch_floats(int64_t max_tokens, int64_t max_in, int64_t max_out) {
  const int64_t widest = std::max(max_in, max_out);
  return std::max({row_block_floats(max_tokens, widest), row_block_floats(widest, max_tokens),
                   mx_scale_floats(max_tokens, widest), mx_scale_floats(widest, max_tokens)});
}

// The bytes one linear [in -> out] allocates itself: its bf16 bias and the weight copies of its
// precision (bf16; or FP8 Ŵ and, when kept, Ŵᵗ, with their block scales, and for MXFP8 both
// dequantized).
inline size_t linear_weight_bytes(int64_t in, int64_t out, bool bias, bool fp8,
                                  ScalingRecipe recipe,
                                  WeightTransposes transposes = WeightTransposes::Kept) {
  const auto weights = static_cast<size_t>(in * out);
  size_t bytes = bias ? static_cast<size_t>(out) * sizeof(bf16) : 0;
  if (!fp8) return bytes + weights * sizeof(bf16);
  const bool kept = transposes == WeightTransposes::Kept;
  bytes += (kept ? 2 : 1) * weights;
  if (recipe == ScalingRecipe::Mxfp8) {
    bytes += 2 * weights * sizeof(bf16);
    bytes +=
        static_cast<size_t>(mx_scale_floats(out, in) + mx_scale_floats(in, out)) * sizeof(float);
  } else if (recipe == ScalingRecipe::Blockwise) {
    bytes += static_cast<size_t>(tile_floats(out, in) + (kept ? tile_floats(in, out) : 0)) *
             sizeof(float);
  }
  return bytes;
}

// The shared scratch's Ŵᵗ under WeightTransposes::InBackward: room for the largest FP8 weight
// of a model, and for blockwise its padded 128x128 scale grid. Empty when Ŵᵗ are kept.
struct WeightTScratch {
  int64_t bytes = 0;
  int64_t scale_floats = 0;

  // Makes room for an FP8 linear [in -> out].
  void fit(int64_t in, int64_t out, ScalingRecipe recipe) {
    bytes = std::max(bytes, in * out);
    if (recipe == ScalingRecipe::Blockwise)
      scale_floats = std::max(scale_floats, tile_floats(in, out));
  }
};

}  // namespace fp8t::ops
