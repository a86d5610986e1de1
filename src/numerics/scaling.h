// FP8 scaling recipes: the configuration users choose, the scale rules of each recipe, and the
// per-tensor state of delayed scaling.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "core/host_device.h"
#include "numerics/float_bits.h"
#include "numerics/formats.h"

namespace YAML {
class Node;
}

namespace fp8t {

// `fp8`: which tensors are FP8, and in which format.
enum class Fp8Mode : uint8_t {
  None,    // BF16 training
  E4M3,    // input, weight and grad_output in E4M3
  Hybrid,  // input and weight in E4M3, grad_output in E5M2
};

// `fp8_recipe`
enum class ScalingRecipe : uint8_t {
  Delayed,     // per-tensor scale from an amax history of earlier steps
  Tensorwise,  // per-tensor scale from this tensor's own amax ("current scaling")
  Blockwise,   // fp32 scale per 1x128 block (activations, gradients) or 128x128 (weights)
  Mxfp8,       // E8M0 scale per 1x32 block
};

// `fp8_amax_compute_algo`
enum class AmaxComputeAlgo : uint8_t { Max, MostRecent };

// The role of a quantized tensor in a linear layer; decides its format and block shape.
enum class TensorRole : uint8_t { Input, Weight, GradOutput };
inline constexpr TensorRole kTensorRoles[] = {TensorRole::Input, TensorRole::Weight,
                                              TensorRole::GradOutput};
// "input", "weight", "grad_output": how checkpoints and logs name the operands.
const char* tensor_role_name(TensorRole role);

struct Fp8Config {
  Fp8Mode mode = Fp8Mode::Hybrid;
  ScalingRecipe recipe = ScalingRecipe::Tensorwise;
  int amax_history_len = 1024;
  AmaxComputeAlgo amax_compute_algo = AmaxComputeAlgo::Max;
  float margin = 0.0f;
  FamilySetting dtype_family = FamilySetting::Auto;
  // Unset: the recipe's default (on for blockwise, off otherwise; mxfp8 scales are always
  // powers of two).
  std::optional<bool> power_of_2_scales;
  float amax_epsilon = 0.0f;

  bool use_power_of_2_scales() const;
  // The format of a tensor in a given role, for the family the platform resolved to.
  Fp8Format format_for(TensorRole role, Fp8Family family) const;
};

// The names of the configuration values, for the key table (config/config_keys.h) and messages.
inline constexpr std::pair<std::string_view, Fp8Mode> kFp8ModeNames[] = {
    {"none", Fp8Mode::None}, {"e4m3", Fp8Mode::E4M3}, {"hybrid", Fp8Mode::Hybrid}};
inline constexpr std::pair<std::string_view, ScalingRecipe> kScalingRecipeNames[] = {
    {"delayed", ScalingRecipe::Delayed},
    {"tensorwise", ScalingRecipe::Tensorwise},
    {"blockwise", ScalingRecipe::Blockwise},
    {"mxfp8", ScalingRecipe::Mxfp8}};
inline constexpr std::pair<std::string_view, AmaxComputeAlgo> kAmaxComputeAlgoNames[] = {
    {"max", AmaxComputeAlgo::Max}, {"most_recent", AmaxComputeAlgo::MostRecent}};
inline constexpr std::pair<std::string_view, FamilySetting> kFamilySettingNames[] = {
    {"auto", FamilySetting::Auto}, {"ocp", FamilySetting::Ocp}, {"fnuz", FamilySetting::Fnuz}};

// Throws ConfigError naming `source`, the key and the allowed values when a field is out of
// range (history length < 1, non-finite or negative margin, negative or non-finite epsilon).
void validate(const Fp8Config& config, std::string_view source);

// Reads the fp8 keys of a YAML mapping: the top-level keys starting with "fp8" and the keys of
// an `fp8:` section; keys starting with "fp8" that are not fp8 keys are errors, other keys are
// left to their owners. `source` names the file in messages. The result is validated. Defined
// in config/train_config.cpp: the keys are read through the configuration's key table, so they
// parse, check and report errors exactly as in a training configuration.
Fp8Config fp8_config_from_yaml(const YAML::Node& root, std::string_view source);

std::string_view mode_name(Fp8Mode mode);
std::string_view recipe_name(ScalingRecipe recipe);
std::string_view amax_algo_name(AmaxComputeAlgo algo);
std::string_view family_setting_name(FamilySetting setting);
std::string describe(const Fp8Config& config);

// A 128x128-scaled operand's scale grid keeps each row's K blocks rounded up to a multiple of 4
// (16 bytes of fp32, as cuBLASLt reads them); the casts, the weights' scale buffers and both
// GEMM paths share this layout.
FP8T_HD constexpr int64_t padded_tile_scale_row(int64_t k_blocks) {
  return (k_blocks + 3) / 4 * 4;
}

// Current scaling (tensorwise, and each fp32 block of blockwise): the factor that maps amax to
// the format's max. amax below epsilon counts as epsilon; amax 0 or inf gives 1; a quotient
// that overflows gives FLT_MAX; NaN gives 1. Power-of-2 scales round down to 2^k.
FP8T_HD inline float scale_from_amax(float amax, float format_max, bool power_of_2, float epsilon) {
  if (amax < epsilon) amax = epsilon;
  const uint32_t amax_bits = float_to_bits(amax) & 0x7FFFFFFFu;
  if (amax_bits == 0x7F800000u || amax_bits == 0) return 1.0f;
  float scale = format_max / amax;
  const uint32_t scale_bits = float_to_bits(scale);
  if ((scale_bits & 0x7FFFFFFFu) == 0x7F800000u) scale = bits_to_float(0x7F7FFFFFu);  // FLT_MAX
  if ((scale_bits & 0x7FFFFFFFu) > 0x7F800000u) scale = 1.0f;                         // NaN
  if (power_of_2) scale = bits_to_float(float_to_bits(scale) & 0xFF800000u);
  return scale;
}

// MXFP8: the E8M0 code of the block scale s = 2^ceil(log2(amax / format_max)), so that
// amax / s fits the format. amax 0 gives the smallest code, NaN gives NaN (0xFF), inf the largest.
FP8T_HD inline uint8_t mx_scale_from_amax(float amax, float format_max) {
  const float ratio = amax * (1.0f / format_max);
  const uint32_t bits = float_to_bits(ratio) & 0x7FFFFFFFu;
  if (bits > 0x7F800000u) return 0xFF;
  if (bits == 0x7F800000u) return 0xFE;
  const uint32_t exponent = bits >> 23;
  const uint32_t mantissa = bits & 0x7FFFFFu;
  // Round up to the next power of two, except: subnormals up to 2^-127 stay at code 0, and
  // the top code saturates.
  const bool round_up =
      mantissa != 0 && exponent != 0xFE && !(exponent == 0 && mantissa <= 0x400000u);
  const uint8_t code = static_cast<uint8_t>(exponent + (round_up ? 1u : 0u));
  // Where the ratio is an fp32 subnormal it is rounded coarsely and can land on 2^-127 from
  // above; amax * 2^(127 - code) is exact, so the check on it is too.
  if (code < 0xFE && amax * exact_power_of_two(127 - int(code)) > format_max) {
    return static_cast<uint8_t>(code + 1);
  }
  return code;
}

// The multiplier that takes data into an MX block: 1 / 2^(code - 127). Exact; NaN for 0xFF.
FP8T_HD inline float mx_inverse_scale(uint8_t code) {
  if (code == 0xFF) return bits_to_float(0x7FC00000u);
  return exact_power_of_two(127 - int(code));
}

// Delayed scaling state of one quantized tensor. Casts record the amax of what they quantize
// (max over the micro-batches of a step); update() runs once per optimizer step.
class DelayedScaling {
 public:
  DelayedScaling(int history_len, AmaxComputeAlgo algo, float margin, float format_max,
                 TensorRole role = TensorRole::Input);

  // Folds a cast's amax into this step's amax (max; NaN and inf are kept as seen). A weight
  // does not change between micro-batches: only its first cast of a step is recorded.
  void record_amax(float amax);
  // End of step: roll the history (unless this step's amax is 0: the tensor did not run),
  // pick the amax (max over the history, NaN entries ignored, or the most recent), and set
  // scale = format_max / 2^margin / amax when that amax is finite and positive, else keep it.
  void update();

  float scale() const { return scale_; }
  float scale_inv() const { return scale_inv_; }
  float pending_amax() const { return pending_amax_; }
  const std::deque<float>& history() const { return history_; }  // oldest first

  // Replaces the scale, e.g. when the amax was seeded from the actual weights at step 0.
  void set_scale(float scale);

  // Checkpoints: the state between steps as state_size() floats: the scale, the number of
  // history entries, then the history oldest first, padded with zeros to history_len.
  int state_size() const { return 2 + history_len_; }
  void save_state(float* out) const;
  // Throws fp8t::Error for a non-positive scale or an entry count outside [0, history_len].
  void load_state(const float* in);

 private:
  int history_len_;
  AmaxComputeAlgo algo_;
  TensorRole role_;
  bool recorded_this_step_ = false;
  float scaled_max_;  // format_max * 2^-margin
  std::deque<float> history_;
  float pending_amax_ = 0.0f;
  float scale_ = 1.0f;
  float scale_inv_ = 1.0f;
};

}  // namespace fp8t
