// Scaling recipes: current (tensorwise/blockwise) scales, MX E8M0 scales, delayed scaling with
// its amax history, and the fp8 configuration read from YAML.
#include "numerics/scaling.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "numerics/float_bits.h"
#include "numerics/formats.h"
#include "test_util.h"

namespace fp8t {
namespace {

using test::kDataFormats;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// fmax / amax / 2^margin rounded once to fp32, clamped to FLT_MAX. Computing in double and
// rounding to float gives the correctly rounded fp32 quotient (53 >= 2 * 24 + 2).
float expected_scale(float fmax, double amax, int margin = 0) {
  const double quotient = double{fmax} / amax / std::ldexp(1.0, margin);
  return quotient > double{FLT_MAX} ? FLT_MAX : static_cast<float>(quotient);
}

// The largest power of two <= the fp32 scale.
float round_down_to_power_of_two(float scale) {
  int exponent = 0;
  std::frexp(scale, &exponent);  // scale = m * 2^exponent, m in [0.5, 1)
  return std::ldexp(1.0f, exponent - 1);
}

// 2^ceil(log2(amax / fmax)) as an E8M0 code. std::frexp gives the exponent exactly (std::log2
// may not near powers of two), and a double quotient of two floats is a power of two only when
// the exact quotient is one.
uint8_t expected_mx_code(float amax, float fmax) {
  if (amax == 0.0f) return 0;
  int exponent = 0;
  const double mantissa = std::frexp(double{amax} / double{fmax}, &exponent);
  const int ceil_log2 = mantissa == 0.5 ? exponent - 1 : exponent;
  return static_cast<uint8_t>(std::clamp(ceil_log2 + 127, 0, 254));
}

TEST(ScaleFromAmax, ZeroInfAndNanGiveOne) {
  for (bool power_of_2 : {false, true}) {
    for (float amax : {0.0f, kInf, kNan, -kNan}) {
      EXPECT_EQ(scale_from_amax(amax, 448.0f, power_of_2, 0.0f), 1.0f) << amax;
    }
  }
}

TEST(ScaleFromAmax, TinyAmaxClampsToFltMax) {
  EXPECT_EQ(scale_from_amax(1e-40f, 448.0f, false, 0.0f), FLT_MAX);
  EXPECT_EQ(scale_from_amax(FLT_TRUE_MIN, 57344.0f, false, 0.0f), FLT_MAX);
  EXPECT_EQ(scale_from_amax(1e-40f, 448.0f, true, 0.0f), std::ldexp(1.0f, 127));
}

TEST(ScaleFromAmax, AmaxBelowEpsilonCountsAsEpsilon) {
  EXPECT_EQ(scale_from_amax(1e-6f, 448.0f, false, 1e-3f), 448.0f / 1e-3f);
  EXPECT_EQ(scale_from_amax(1e-40f, 448.0f, false, 1e-3f), 448.0f / 1e-3f);
  EXPECT_EQ(scale_from_amax(2.0f, 448.0f, false, 1e-3f), 224.0f);     // above epsilon: unchanged
  EXPECT_EQ(scale_from_amax(1e-6f, 448.0f, true, 1e-3f), 262144.0f);  // 448000 -> 2^18
}

TEST(ScaleFromAmax, PowerOfTwoRoundsDown) {
  EXPECT_EQ(scale_from_amax(3.0f, 448.0f, true, 0.0f), 128.0f);  // 149.3
  EXPECT_EQ(scale_from_amax(448.0f, 448.0f, true, 0.0f), 1.0f);
  EXPECT_EQ(scale_from_amax(1.0f, 448.0f, true, 0.0f), 256.0f);
  EXPECT_EQ(scale_from_amax(7.0f, 57344.0f, true, 0.0f), 8192.0f);  // exact
  EXPECT_EQ(scale_from_amax(1000.0f, 240.0f, true, 0.0f), 0.125f);  // 0.24
}

// Random positive finite amaxes over the whole fp32 range, every data format.
TEST(ScaleFromAmax, MatchesQuotientOnRandomAmaxes) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (Fp8Format format : kDataFormats) {
    const float fmax = format_max(format);
    for (int i = 0; i < 20000; ++i) {
      const float amax = bits_to_float(rng.bits() % 0x7F7FFFFFu + 1u);
      const float expected = expected_scale(fmax, amax);
      ASSERT_EQ(scale_from_amax(amax, fmax, false, 0.0f), expected) << amax;
      ASSERT_EQ(scale_from_amax(amax, fmax, true, 0.0f), round_down_to_power_of_two(expected))
          << amax;
    }
  }
}

TEST(MxScale, CeilLog2RuleOnRandomAmaxes) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (Fp8Format format : kDataFormats) {
    const float fmax = format_max(format);
    for (int i = 0; i < 20000; ++i) {
      const float amax = bits_to_float(rng.bits() % 0x7F7FFFFFu + 1u);
      const uint8_t code = mx_scale_from_amax(amax, fmax);
      ASSERT_EQ(code, expected_mx_code(amax, fmax)) << amax;
      ASSERT_LE(amax * mx_inverse_scale(code), fmax) << amax;  // exact: a power of two
    }
  }
}

TEST(MxScale, PowersOfTwoTimesMaxAreExact) {
  for (Fp8Format format : kDataFormats) {
    const float fmax = format_max(format);
    for (int k = -135; k <= 110; ++k) {
      const float amax = std::ldexp(fmax, k);
      const int exact = std::clamp(k + 127, 0, 254);
      EXPECT_EQ(mx_scale_from_amax(amax, fmax), exact) << k;
      EXPECT_EQ(mx_scale_from_amax(std::nextafter(amax, 0.0f), fmax), exact) << k;
      EXPECT_EQ(mx_scale_from_amax(std::nextafter(amax, kInf), fmax), std::clamp(k + 128, 0, 254))
          << k;
    }
  }
}

// Just above 448 * 2^-127 the quotient amax / 448 is an fp32 subnormal; rounding it must not
// land on 2^-127 and leave amax / scale above the format's max.
TEST(MxScale, QuotientNearSmallestScaleRoundsUp) {
  for (Fp8Format format : kDataFormats) {
    const float fmax = format_max(format);
    const float amax = std::nextafter(std::ldexp(fmax, -127), kInf);
    const uint8_t code = mx_scale_from_amax(amax, fmax);
    EXPECT_EQ(code, 1) << format_name(format);
    EXPECT_LE(amax * mx_inverse_scale(code), fmax) << format_name(format);
  }
}

TEST(MxScale, SpecialAmaxAndInverseScales) {
  EXPECT_EQ(mx_scale_from_amax(0.0f, 448.0f), 0x00);
  EXPECT_EQ(mx_scale_from_amax(kNan, 448.0f), 0xFF);
  EXPECT_EQ(mx_scale_from_amax(kInf, 448.0f), 0xFE);
  EXPECT_EQ(mx_scale_from_amax(FLT_MAX, 448.0f), 120 + 127);  // FLT_MAX / 448 = 2^119.2
  EXPECT_TRUE(std::isnan(mx_inverse_scale(0xFF)));
  for (int code = 0; code <= 0xFE; ++code) {
    EXPECT_EQ(double{mx_inverse_scale(static_cast<uint8_t>(code))}, std::ldexp(1.0, 127 - code));
  }
}

// The per-tensor delayed-scaling state, modelled from the spec with a plain vector window.
class DelayedModel {
 public:
  DelayedModel(int history_len, AmaxComputeAlgo algo, int margin, float fmax)
      : history_len_(history_len), algo_(algo), margin_(margin), fmax_(fmax) {}

  void update(float step_amax) {
    if (step_amax != 0.0f) {
      window_.push_back(step_amax);
      if (static_cast<int>(window_.size()) > history_len_) window_.erase(window_.begin());
    }
    double amax = step_amax;
    if (algo_ == AmaxComputeAlgo::Max) {
      amax = 0.0;
      for (float entry : window_) {
        if (!std::isnan(entry)) amax = std::max(amax, double{entry});
      }
    }
    if (std::isfinite(amax) && amax > 0.0) scale_ = expected_scale(fmax_, amax, margin_);
  }

  float scale() const { return scale_; }
  const std::vector<float>& window() const { return window_; }

 private:
  int history_len_;
  AmaxComputeAlgo algo_;
  int margin_;
  float fmax_;
  std::vector<float> window_;
  float scale_ = 1.0f;
};

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || a == b;
}

// Transformer Engine's matrix: history lengths x algorithms x margins.
class DelayedScalingMatrix : public testing::TestWithParam<std::tuple<int, AmaxComputeAlgo, int>> {
};

TEST_P(DelayedScalingMatrix, ScaleFollowsTheHistoryThroughRollover) {
  const auto [history_len, algo, margin] = GetParam();
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const float fmax = 448.0f;
  DelayedScaling state(history_len, algo, static_cast<float>(margin), fmax);
  DelayedModel model(history_len, algo, margin, fmax);
  const int steps = 2 * history_len + 40;
  const int inf_step = history_len / 2 + 3;  // rolls out of the window before the end
  for (int step = 0; step < steps; ++step) {
    // A falling trend, so that the oldest entries matter when they roll out.
    const double trend = std::ldexp(1.0, 8 - 16 * step / steps);
    float step_amax = 0.0f;  // what record_amax must accumulate: max, NaN sticks
    const int micro_batches = rng.chance(0.05) ? 0 : rng.uniform_int(1, 3);  // 0: did not run
    for (int micro = 0; micro < micro_batches; ++micro) {
      auto amax = static_cast<float>(trend * rng.uniform(0.25, 4.0));
      if (step == inf_step && micro == 0) amax = kInf;
      if (step == steps - 7) amax = 1e-40f;  // most_recent: scale overflows to FLT_MAX
      if (rng.chance(0.01)) amax = kNan;
      if (rng.chance(0.03)) amax = 0.0f;
      state.record_amax(amax);
      if (!std::isnan(step_amax)) step_amax = std::isnan(amax) ? amax : std::max(step_amax, amax);
    }
    ASSERT_TRUE(same_float(state.pending_amax(), step_amax)) << "step " << step;
    state.update();
    model.update(step_amax);
    ASSERT_EQ(state.pending_amax(), 0.0f);
    ASSERT_EQ(state.scale(), model.scale()) << "step " << step << " amax " << step_amax;
    ASSERT_EQ(state.scale_inv(), 1.0f / model.scale()) << "step " << step;
    ASSERT_EQ(state.history().size(), model.window().size()) << "step " << step;
    ASSERT_TRUE(std::equal(state.history().begin(), state.history().end(), model.window().begin(),
                           same_float))
        << "step " << step;
  }
}

std::string matrix_name(const testing::TestParamInfo<DelayedScalingMatrix::ParamType>& info) {
  const auto [history_len, algo, margin] = info.param;
  return "len" + std::to_string(history_len) + "_" + std::string(amax_algo_name(algo)) + "_margin" +
         std::to_string(margin);
}

INSTANTIATE_TEST_SUITE_P(TransformerEngineMatrix, DelayedScalingMatrix,
                         testing::Combine(testing::Values(1, 31, 1024),
                                          testing::Values(AmaxComputeAlgo::Max,
                                                          AmaxComputeAlgo::MostRecent),
                                          testing::Values(0, 1, 2)),
                         matrix_name);

TEST(DelayedScaling, ZeroAmaxKeepsScaleAndDoesNotRoll) {
  for (AmaxComputeAlgo algo : {AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent}) {
    DelayedScaling state(3, algo, 0.0f, 448.0f);
    EXPECT_EQ(state.scale(), 1.0f);
    state.update();  // nothing recorded
    EXPECT_EQ(state.scale(), 1.0f);
    EXPECT_TRUE(state.history().empty());
    state.record_amax(2.0f);
    state.update();
    EXPECT_EQ(state.scale(), 224.0f);
    state.record_amax(0.0f);
    state.update();
    EXPECT_EQ(state.scale(), 224.0f);
    EXPECT_EQ(state.history(), std::deque<float>{2.0f});
  }
}

TEST(DelayedScaling, TinyAmaxGivesFltMax) {
  for (AmaxComputeAlgo algo : {AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent}) {
    DelayedScaling state(4, algo, 1.0f, 448.0f);
    state.record_amax(1e-40f);
    state.update();
    EXPECT_EQ(state.scale(), FLT_MAX);
    EXPECT_EQ(state.scale_inv(), 1.0f / FLT_MAX);
  }
}

TEST(DelayedScaling, InfAmaxKeepsScaleUntilItRollsOut) {
  DelayedScaling state(3, AmaxComputeAlgo::Max, 0.0f, 448.0f);
  const float amaxes[] = {2.0f, kInf, 4.0f, 8.0f, 1.0f};
  const float scales[] = {224.0f, 224.0f, 224.0f, 224.0f, 56.0f};  // inf leaves at step 5
  for (int step = 0; step < 5; ++step) {
    state.record_amax(amaxes[step]);
    state.update();
    EXPECT_EQ(state.scale(), scales[step]) << "step " << step;
  }
  DelayedScaling recent(3, AmaxComputeAlgo::MostRecent, 0.0f, 448.0f);
  recent.record_amax(2.0f);
  recent.update();
  recent.record_amax(kInf);
  recent.update();
  EXPECT_EQ(recent.scale(), 224.0f);
  recent.record_amax(4.0f);
  recent.update();
  EXPECT_EQ(recent.scale(), 112.0f);
}

TEST(DelayedScaling, NanAmaxKeptByMostRecentIgnoredByMax) {
  DelayedScaling recent(2, AmaxComputeAlgo::MostRecent, 0.0f, 448.0f);
  recent.record_amax(2.0f);
  recent.update();
  recent.record_amax(kNan);
  recent.update();
  EXPECT_EQ(recent.scale(), 224.0f);

  DelayedScaling max(2, AmaxComputeAlgo::Max, 0.0f, 448.0f);
  for (float amax : {8.0f, 2.0f, kNan}) {
    max.record_amax(amax);
    max.update();
  }
  // The window is {2, NaN}: the 8 rolled out and the NaN does not count.
  EXPECT_EQ(max.scale(), 224.0f);
  ASSERT_EQ(max.history().size(), 2u);
  EXPECT_TRUE(std::isnan(max.history().back()));
}

TEST(DelayedScaling, RecordAmaxTakesMaxAndNanSticks) {
  DelayedScaling state(4, AmaxComputeAlgo::Max, 0.0f, 448.0f);
  for (float amax : {1.0f, 3.0f, 2.0f})
    state.record_amax(amax);
  EXPECT_EQ(state.pending_amax(), 3.0f);
  state.record_amax(kNan);
  state.record_amax(5.0f);
  EXPECT_TRUE(std::isnan(state.pending_amax()));
  state.update();
  state.record_amax(kInf);
  state.record_amax(5.0f);
  EXPECT_EQ(state.pending_amax(), kInf);
}

TEST(DelayedScaling, WeightRecordsOnlyTheFirstMicroBatchOfAStep) {
  DelayedScaling weight(4, AmaxComputeAlgo::MostRecent, 0.0f, 448.0f, TensorRole::Weight);
  DelayedScaling input(4, AmaxComputeAlgo::MostRecent, 0.0f, 448.0f, TensorRole::Input);
  for (DelayedScaling* state : {&weight, &input}) {
    state->record_amax(2.0f);
    state->record_amax(8.0f);  // a later micro-batch of the same step
  }
  EXPECT_EQ(weight.pending_amax(), 2.0f);
  EXPECT_EQ(input.pending_amax(), 8.0f);
  weight.update();
  EXPECT_EQ(weight.scale(), 448.0f / 2.0f);
  // The next step records its first micro-batch again.
  weight.record_amax(7.0f);
  weight.record_amax(1.0f);
  EXPECT_EQ(weight.pending_amax(), 7.0f);
}

TEST(DelayedScaling, SetScaleChecksAndSetsInverse) {
  DelayedScaling state(4, AmaxComputeAlgo::Max, 0.0f, 448.0f);
  state.set_scale(3.0f);
  EXPECT_EQ(state.scale(), 3.0f);
  EXPECT_EQ(state.scale_inv(), 1.0f / 3.0f);
  for (float bad : {0.0f, -0.0f, -1.0f, kInf, -kInf, kNan}) {
    EXPECT_THROW(state.set_scale(bad), Error) << bad;
  }
  EXPECT_EQ(state.scale(), 3.0f);  // unchanged by the rejected calls
}

TEST(DelayedScaling, ConstructorRejectsBadArguments) {
  EXPECT_THROW(DelayedScaling(0, AmaxComputeAlgo::Max, 0.0f, 448.0f), Error);
  EXPECT_THROW(DelayedScaling(4, AmaxComputeAlgo::Max, kNan, 448.0f), Error);
}

TEST(Fp8Config, Defaults) {
  const Fp8Config config;
  EXPECT_EQ(config.mode, Fp8Mode::Hybrid);
  EXPECT_EQ(config.recipe, ScalingRecipe::Tensorwise);
  EXPECT_EQ(config.amax_history_len, 1024);
  EXPECT_EQ(config.amax_compute_algo, AmaxComputeAlgo::Max);
  EXPECT_EQ(config.margin, 0.0f);
  EXPECT_EQ(config.dtype_family, FamilySetting::Auto);
  EXPECT_FALSE(config.power_of_2_scales.has_value());
  EXPECT_EQ(config.amax_epsilon, 0.0f);
}

TEST(Fp8Config, FormatForRoleAndFamily) {
  struct Case {
    Fp8Mode mode;
    TensorRole role;
    Fp8Family family;
    Fp8Format expected;
  };
  const Case cases[] = {
      {Fp8Mode::E4M3, TensorRole::Input, Fp8Family::Ocp, Fp8Format::E4M3},
      {Fp8Mode::E4M3, TensorRole::Weight, Fp8Family::Ocp, Fp8Format::E4M3},
      {Fp8Mode::E4M3, TensorRole::GradOutput, Fp8Family::Ocp, Fp8Format::E4M3},
      {Fp8Mode::E4M3, TensorRole::GradOutput, Fp8Family::Fnuz, Fp8Format::E4M3FNUZ},
      {Fp8Mode::Hybrid, TensorRole::Input, Fp8Family::Ocp, Fp8Format::E4M3},
      {Fp8Mode::Hybrid, TensorRole::Weight, Fp8Family::Ocp, Fp8Format::E4M3},
      {Fp8Mode::Hybrid, TensorRole::GradOutput, Fp8Family::Ocp, Fp8Format::E5M2},
      {Fp8Mode::Hybrid, TensorRole::Input, Fp8Family::Fnuz, Fp8Format::E4M3FNUZ},
      {Fp8Mode::Hybrid, TensorRole::Weight, Fp8Family::Fnuz, Fp8Format::E4M3FNUZ},
      {Fp8Mode::Hybrid, TensorRole::GradOutput, Fp8Family::Fnuz, Fp8Format::E5M2FNUZ},
  };
  for (const Case& c : cases) {
    Fp8Config config;
    config.mode = c.mode;
    EXPECT_EQ(config.format_for(c.role, c.family), c.expected)
        << mode_name(c.mode) << " role " << static_cast<int>(c.role) << " "
        << family_name(c.family);
  }
}

TEST(Fp8Config, PowerOf2ScalesDefaultOnlyForBlockwise) {
  Fp8Config config;
  for (ScalingRecipe recipe : {ScalingRecipe::Delayed, ScalingRecipe::Tensorwise}) {
    config.recipe = recipe;
    EXPECT_FALSE(config.use_power_of_2_scales()) << recipe_name(recipe);
  }
  config.recipe = ScalingRecipe::Blockwise;
  EXPECT_TRUE(config.use_power_of_2_scales());
  config.power_of_2_scales = false;
  EXPECT_FALSE(config.use_power_of_2_scales());
  config.recipe = ScalingRecipe::Tensorwise;
  config.power_of_2_scales = true;
  EXPECT_TRUE(config.use_power_of_2_scales());
}

Fp8Config config_from(const std::string& text) {
  return fp8_config_from_yaml(YAML::Load(text), "cfg.yaml");
}

// The message of the ConfigError that reading `text` as cfg.yaml raises.
std::string config_error(const std::string& text) {
  try {
    config_from(text);
  } catch (const ConfigError& error) {
    return error.what();
  }
  ADD_FAILURE() << "no ConfigError for:\n" << text;
  return {};
}

TEST(Fp8ConfigYaml, ParsesEveryKey) {
  const Fp8Config delayed = config_from(
      "model: d12\n"
      "fp8: e4m3\n"
      "fp8_recipe: delayed\n"
      "fp8_amax_history_len: 16\n"
      "fp8_amax_compute_algo: most_recent\n"
      "fp8_margin: 1.5\n"
      "fp8_dtype_family: fnuz\n"
      "fp8_wgrad: true\n");
  EXPECT_EQ(delayed.mode, Fp8Mode::E4M3);
  EXPECT_EQ(delayed.recipe, ScalingRecipe::Delayed);
  EXPECT_EQ(delayed.amax_history_len, 16);
  EXPECT_EQ(delayed.amax_compute_algo, AmaxComputeAlgo::MostRecent);
  EXPECT_EQ(delayed.margin, 1.5f);
  EXPECT_EQ(delayed.dtype_family, FamilySetting::Fnuz);

  const Fp8Config blockwise = config_from(
      "fp8: hybrid\n"
      "fp8_recipe: blockwise\n"
      "fp8_power_of_2_scales: false\n"
      "fp8_amax_epsilon: 1e-12\n"
      "fp8_dtype_family: ocp\n");
  EXPECT_EQ(blockwise.mode, Fp8Mode::Hybrid);
  EXPECT_EQ(blockwise.recipe, ScalingRecipe::Blockwise);
  EXPECT_EQ(blockwise.power_of_2_scales, false);
  EXPECT_EQ(blockwise.amax_epsilon, 1e-12f);
  EXPECT_EQ(blockwise.dtype_family, FamilySetting::Ocp);

  EXPECT_EQ(config_from("fp8_recipe: mxfp8\nfp8_power_of_2_scales: true\n").recipe,
            ScalingRecipe::Mxfp8);
  EXPECT_EQ(config_from("fp8: none\n").mode, Fp8Mode::None);
}

TEST(Fp8ConfigYaml, EmptyDocumentAndOtherKeysGiveDefaults) {
  for (const char* text : {"", "# only a comment\n", "model: d12\nlr: 0.02\nsteps: [1, 2]\n"}) {
    const Fp8Config config = config_from(text);
    EXPECT_EQ(config.mode, Fp8Config{}.mode) << text;
    EXPECT_EQ(config.recipe, Fp8Config{}.recipe) << text;
    EXPECT_EQ(config.amax_history_len, Fp8Config{}.amax_history_len) << text;
  }
}

TEST(Fp8ConfigYaml, ErrorsNameSourceKeyAndAllowedValues) {
  struct Case {
    const char* text;
    std::vector<std::string> expected_parts;
  };
  const Case cases[] = {
      {"fp8_recipe: foo", {"fp8_recipe", "foo", "delayed, tensorwise, blockwise, mxfp8"}},
      {"fp8: e3m4", {"fp8", "e3m4", "none, e4m3, hybrid"}},
      {"fp8_amax_compute_algo: mean", {"fp8_amax_compute_algo", "mean", "max, most_recent"}},
      {"fp8_dtype_family: xyz", {"fp8_dtype_family", "xyz", "auto, ocp, fnuz"}},
      {"fp8_amax_history_len: 0", {"fp8_amax_history_len", "at least 1", "0"}},
      {"fp8_amax_history_len: -3", {"fp8_amax_history_len", "at least 1", "-3"}},
      {"fp8_amax_history_len: abc", {"fp8_amax_history_len", "integer >= 1", "abc"}},
      {"fp8_margin: .nan", {"fp8_margin", "finite number >= 0", "nan"}},
      {"fp8_margin: .inf", {"fp8_margin", "finite number >= 0", "inf"}},
      {"fp8_margin: -1", {"fp8_margin", "finite number >= 0", "-1"}},
      {"fp8_amax_epsilon: -1", {"fp8_amax_epsilon", "finite number >= 0", "-1"}},
      {"fp8_power_of_2_scales: maybe", {"fp8_power_of_2_scales", "true or false", "maybe"}},
      {"fp8_recipee: delayed", {"fp8_recipee", "unknown key", "fp8_recipe,"}},
      {"fp8_recipe: mxfp8\nfp8_power_of_2_scales: false", {"fp8_power_of_2_scales", "mxfp8"}},
      // Settings that the chosen recipe has no use for.
      {"fp8_recipe: delayed\nfp8_power_of_2_scales: true", {"fp8_power_of_2_scales", "delayed"}},
      {"fp8_recipe: delayed\nfp8_amax_epsilon: 1e-6", {"fp8_amax_epsilon", "delayed"}},
      {"- fp8: e4m3", {"mapping"}},
  };
  for (const Case& c : cases) {
    const std::string message = config_error(c.text);
    EXPECT_NE(message.find("cfg.yaml"), std::string::npos) << message;
    for (const std::string& part : c.expected_parts) {
      EXPECT_NE(message.find(part), std::string::npos)
          << "'" << part << "' missing from: " << message;
    }
  }
}

TEST(Fp8ConfigYaml, ErrorsNameTheLine) {
  EXPECT_NE(config_error("model: d12\nfp8_recipe: foo\n").find("cfg.yaml:2: fp8_recipe"),
            std::string::npos);
  EXPECT_NE(config_error("model: d12\nfp8_recipee: delayed\n").find("cfg.yaml:2: fp8_recipee"),
            std::string::npos);
  EXPECT_NE(config_error("fp8: e4m3\n\nfp8_amax_history_len: abc\n").find("cfg.yaml:3:"),
            std::string::npos);
}

}  // namespace
}  // namespace fp8t
