// Which linear layers of the GPT run in FP8 and which stay in BF16, with the reason for each.
// Embeddings are not linears (never FP8); gates never are either.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "models/gpt_config.h"
#include "numerics/scaling.h"
#include "ops/attention_fp8.h"
#include "ops/fp8_linear_layout.h"
#include "ops/linear.h"

namespace fp8t {

struct PrecisionOptions {
  Fp8Mode mode = Fp8Mode::Hybrid;
  ScalingRecipe recipe = ScalingRecipe::Tensorwise;
  // nanochat's filter: min(in, out) >= min_dim and both divisible by require_divisible_by
  // (FP8 GEMMs need leading dimensions that are multiples of 16).
  int64_t min_dim = 128;
  int64_t require_divisible_by = 16;
  // nanochat's filter lets lm_head through (d24: 145 of 158 linears in FP8); torchtitan keeps
  // the output head in BF16 by default. On by default to match nanochat.
  bool lm_head_fp8 = true;
  // Primus: keep the first and last transformer blocks in BF16.
  bool first_last_layers_bf16 = false;
  int num_layers_at_start_in_bf16 = 1;
  int num_layers_at_end_in_bf16 = 1;
  // Linears kept in BF16 by name: the NaN guard's bf16_layer remedy (train/nan_guard.h), and
  // FP8 health's fp8_auto_fallback (train/fp8_health_monitor.h).
  std::vector<std::string> bf16_linears;
  std::vector<std::string> fallback_linears;
};

// mode and recipe from the fp8 configuration; the filter options at their defaults.
PrecisionOptions precision_options(const Fp8Config& config);

// How a model's linears compute (the GPT's and the Flux's alike): FP8 per the precision policy,
// the others on fp32 or bf16 operands.
struct ModelPrecision {
  Fp8Config fp8;                      // fp8: none keeps every linear out of FP8
  Fp8Family family = Fp8Family::Ocp;  // resolved for the platform
  PrecisionOptions policy;            // which linears may be FP8
  bool fp8_wgrad = true;
  // The GPU's FP8 linears: Ŵᵗ kept, or transposed from Ŵ in backward (fp8_weight_transposes).
  ops::WeightTransposes fp8_weight_transposes = ops::WeightTransposes::Kept;
  ops::LinearOperands other_linears = ops::LinearOperands::Fp32;
  // fp8_dot_product_attention: attention's products on FP8 operands (ops/attention_fp8.h).
  // Only with fp8 other than none.
  bool fp8_attention = false;

  // Everything in fp32: the reference golden files and FP8 runs are compared with.
  static ModelPrecision fp32_reference();
};

// The fp8_weight_transposes setting of that name ("kept", "in_backward"); throws ConfigError
// naming `origin` and the allowed names for another.
ops::WeightTransposes weight_transposes_named(std::string_view name, std::string_view origin);

// Throws ConfigError, prefixed with `origin` (where fp8_weight_transposes was given), for
// in_backward under mxfp8, whose Ŵᵗ is no transpose of Ŵ.
void check_fp8_weight_transposes(ops::WeightTransposes transposes, ScalingRecipe recipe,
                                 std::string_view origin);

// The formats and scale rounding of FP8 attention: the recipe's input and gradient formats for
// the family, its power-of-2 rule and amax epsilon.
ops::AttentionFp8Formats attention_fp8_formats(const ModelPrecision& precision);

struct LinearPrecision {
  LinearSpec linear;
  bool fp8 = false;
  std::string reason;  // why it stays in BF16; empty for FP8
};

// One decision per linear, in the order given. `n_layer` places the first/last blocks.
// The first reason that applies is reported, checked in this order: fp8 none; the size filter
// (min_dim, then require_divisible_by); gates; lm_head_fp8; first/last layers; bf16_linears;
// fallback_linears; the
// recipe's block sizes (blockwise 128, mxfp8 32).
std::vector<LinearPrecision> decide_precision(const std::vector<LinearSpec>& linears, int n_layer,
                                              const PrecisionOptions& options);
std::vector<LinearPrecision> decide_precision(const GptConfig& config,
                                              const PrecisionOptions& options);

// Tensor parallelism: why a rank's share [in, out] of a linear split over `group` ranks cannot be
// cast in the recipe's blocks (blockwise: 128, mxfp8: 32), or nothing (always nothing for one
// rank: the whole linear passed decide_precision).
std::optional<std::string> tensor_parallel_share_reason(int64_t in_features, int64_t out_features,
                                                        ScalingRecipe recipe, int group);

// One line, e.g. "FP8: 145/158 linear layers; 13 kept in BF16 (12 × ve_gate: dims < 128;
// smear_gate: dims < 128)". BF16 layers are grouped by name without the block prefix
// (transformer.h.{i}.) and reason, in order of first appearance; a name is shortened to its
// last component where that is unambiguous (ve_gate, but attn.c_proj and mlp.c_proj).
std::string precision_summary(const std::vector<LinearPrecision>& decisions);

}  // namespace fp8t
