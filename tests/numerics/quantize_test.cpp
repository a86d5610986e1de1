// The CPU quantization reference: amax, per-tensor casts, their transposes and the block
// recipes, checked element by element against the independent format model of test_util.h.
#include "numerics/quantize.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "numerics/float_bits.h"
#include "numerics/formats.h"
#include "numerics/scaling.h"
#include "test_util.h"

namespace fp8t {
namespace {

using test::kDataFormats;
using test::reference_encode;
using test::TestRng;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

struct Shape {
  int64_t rows;
  int64_t cols;
};

std::string case_name(Fp8Format format, Shape shape) {
  return std::string(format_name(format)) + " [" + std::to_string(shape.rows) + ", " +
         std::to_string(shape.cols) + "]";
}

// |x| <= amplitude, with the values that break casts: many binades, +-0, fp32 subnormals,
// +-amplitude itself, and midpoints of the format's grid times amplitude / max, which are
// exact ties once a scale of max / amplitude (a power of two here) is applied.
std::vector<float> random_values(TestRng& rng, int64_t count, float amplitude, Fp8Format format) {
  const test::FormatSpec spec = test::spec_of(format);
  const double to_amplitude = amplitude / test::max_finite(format);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) {
    const int kind = rng.uniform_int(0, 19);
    if (kind < 9) {
      value = static_cast<float>(amplitude * rng.uniform(-1.0, 1.0));
    } else if (kind < 13) {
      value = static_cast<float>(amplitude * std::ldexp(rng.wide(0, 0), -rng.uniform_int(1, 40)));
    } else if (kind < 16) {
      const int low = rng.uniform_int(0, spec.max_code - 1);
      const double midpoint =
          (test::field_magnitude(low, spec) + test::field_magnitude(low + 1, spec)) / 2;
      value = static_cast<float>((rng.chance(0.5) ? midpoint : -midpoint) * to_amplitude);
    } else if (kind == 16) {
      value = rng.chance(0.5) ? 0.0f : -0.0f;
    } else if (kind == 17) {
      value = bits_to_float((rng.bits() & 0x807FFFFFu) | 1u);  // fp32 subnormal
    } else {
      value = rng.chance(0.5) ? amplitude : -std::nextafter(amplitude, 0.0f);
    }
  }
  if (count > 0) values[static_cast<size_t>(rng.uniform_int(0, int(count - 1)))] = -amplitude;
  return values;
}

// fmax * 2^-k: a power-of-two ratio to the format's max, so that ties stay ties after scaling.
float tie_amplitude(TestRng& rng, Fp8Format format, int max_shift) {
  return std::ldexp(format_max(format), rng.uniform_int(-max_shift, max_shift));
}

// The tensor as T, with its exact values as floats (bf16 rounds them).
template <typename T>
struct Input {
  std::vector<T> data;
  std::vector<float> values;
};

template <typename T>
Input<T> make_input(std::vector<float> values) {
  Input<T> input;
  if constexpr (std::is_same_v<T, bf16>) {
    for (float& value : values) {
      input.data.push_back(float_to_bf16(value));
      value = bf16_to_float(input.data.back());
    }
  } else {
    input.data = values;
  }
  input.values = std::move(values);
  return input;
}

// max |x| with NaN propagation, in double.
float expected_amax(const float* x, int64_t count) {
  double result = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    if (std::isnan(x[i])) return kNan;
    result = std::max(result, std::fabs(double{x[i]}));
  }
  return static_cast<float>(result);
}

template <typename T>
std::vector<T> transposed(const std::vector<T>& x, Shape shape) {
  std::vector<T> result(x.size());
  for (int64_t r = 0; r < shape.rows; ++r) {
    for (int64_t c = 0; c < shape.cols; ++c)
      result[c * shape.rows + r] = x[r * shape.cols + c];
  }
  return result;
}

// |dequantized - x| <= half an ulp of the format at |x * scale|, divided by the scale. The
// slack covers the fp32 roundings around the cast (x * scale, 1 / scale, q * scale_inv: each
// 2^-24 relative) and an fp32 subnormal result.
testing::AssertionResult within_half_ulp(float x, float dequantized, double scale,
                                         Fp8Format format) {
  const double scaled = std::fabs(double{x} * scale);
  const double half_ulp = test::half_ulp(format, scaled);
  const double bound = (half_ulp + std::ldexp(scaled + half_ulp, -21)) / scale + FLT_TRUE_MIN;
  const double error = std::fabs(double{dequantized} - double{x});
  if (error <= bound) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "x " << x << " dequantized " << dequantized << " scale "
                                     << scale << ": error " << error << " > bound " << bound;
}

template <typename T>
void check_amax(TestRng& rng) {
  const Input<T> input = make_input<T>(random_values(rng, 1000, 3.5e4f, Fp8Format::E4M3));
  EXPECT_EQ(amax(input.data.data(), 1000), expected_amax(input.values.data(), 1000));
  EXPECT_EQ(amax(input.data.data(), 0), 0.0f);

  std::vector<T> with_special = input.data;
  with_special[rng.uniform_int(0, 999)] = make_input<T>({-kInf}).data[0];
  EXPECT_EQ(amax(with_special.data(), 1000), kInf);
  for (float nan : {kNan, -kNan}) {
    with_special[rng.uniform_int(0, 999)] = make_input<T>({nan}).data[0];
    EXPECT_TRUE(std::isnan(amax(with_special.data(), 1000)));
  }
}

TEST(Amax, MaxAbsNanPropagatesEmptyIsZero) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  check_amax<float>(rng);
  check_amax<bf16>(rng);
  EXPECT_EQ(amax(static_cast<const float*>(nullptr), 0), 0.0f);
}

// Every byte against the model at the fp32 product x * scale, with scales that saturate
// (random) and scales that make exact ties (powers of two).
template <typename T>
void check_quantize_matches_encode(TestRng& rng, Fp8Format format) {
  const float fmax = format_max(format);
  const float amplitude = tie_amplitude(rng, format, 100);
  std::vector<float> values = random_values(rng, 4000, amplitude, format);
  values[1] = kNan;
  values[2] = kInf;
  values[3] = -kInf;
  const Input<T> input = make_input<T>(values);
  const float scales[] = {fmax / amplitude,
                          static_cast<float>(fmax / amplitude * rng.uniform(0.3, 8.0))};
  std::vector<uint8_t> out(values.size());
  for (float scale : scales) {
    SCOPED_TRACE(std::string(format_name(format)) + " scale " + std::to_string(scale));
    quantize(input.data.data(), 4000, scale, format, out.data(), nullptr);
    for (size_t i = 0; i < out.size(); ++i) {
      const float scaled = input.values[i] * scale;
      ASSERT_EQ(out[i], reference_encode(scaled, format, Saturation::Saturate))
          << "x " << input.values[i] << " scaled " << scaled;
      ASSERT_EQ(out[i], encode(scaled, format, Saturation::Saturate));
    }
  }

  // amax_out is a running max across calls, NaN included; values[1] is the NaN.
  float running = 0.0f;
  quantize(input.data.data() + 4, 2000, 1.0f, format, out.data(), &running);
  EXPECT_EQ(running, expected_amax(input.values.data() + 4, 2000));
  quantize(input.data.data() + 2004, 1996, 1.0f, format, out.data(), &running);
  EXPECT_EQ(running, expected_amax(input.values.data() + 4, 3996));
  float larger = 2 * amplitude;
  quantize(input.data.data() + 4, 3996, 1.0f, format, out.data(), &larger);
  EXPECT_EQ(larger, 2 * amplitude);
  quantize(input.data.data(), 2, 1.0f, format, out.data(), &running);
  quantize(input.data.data() + 4, 3996, 1.0f, format, out.data(), &running);
  EXPECT_TRUE(std::isnan(running));
}

TEST(Quantize, MatchesPerElementEncodeAndAccumulatesAmax) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (Fp8Format format : kDataFormats) {
    check_quantize_matches_encode<float>(rng, format);
    check_quantize_matches_encode<bf16>(rng, format);
  }
}

const Shape kAwkwardShapes[] = {{1, 16}, {5, 160}, {217, 256}, {3, 1}};

template <typename T>
void check_quantize_transpose(TestRng& rng, Fp8Format format, Shape shape) {
  SCOPED_TRACE(case_name(format, shape));
  const int64_t count = shape.rows * shape.cols;
  const float amplitude = tie_amplitude(rng, format, 20);
  const Input<T> input = make_input<T>(random_values(rng, count, amplitude, format));
  const float scale = format_max(format) / amplitude;
  std::vector<uint8_t> expected(input.data.size()), out(input.data.size()),
      out_t(input.data.size());
  quantize(input.data.data(), count, scale, format, expected.data(), nullptr);
  float running = 0.0f;
  quantize_transpose(input.data.data(), shape.rows, shape.cols, scale, format, out.data(),
                     out_t.data(), &running);
  EXPECT_EQ(out, expected);
  EXPECT_EQ(out_t, transposed(out, shape));
  EXPECT_EQ(running, amplitude);
}

// Crafted values around each format's largest value and smallest subnormal: which saturate,
// which underflow, which are neither (zero, NaN, the largest value itself, what rounds up to the
// smallest subnormal), counted the same by quantize_transpose, and accumulated over calls.
TEST(CastHealth, CountsSaturationAndUnderflowOnCraftedInputs) {
  for (Fp8Format format : kDataFormats) {
    SCOPED_TRACE(format_name(format));
    const float top = format_max(format);
    const float tiny = decode(1, format);  // the smallest positive subnormal
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float inf = std::numeric_limits<float>::infinity();
    // With scale 2: the saturated are 0.6·top, −top, inf; the underflowed 0.2·tiny, −0.2·tiny
    // and tiny/8 (scaled: below half the smallest subnormal).
    const std::vector<float> x = {0.6f * top, -top, inf,   0.5f * top, 0.2f * tiny, -0.2f * tiny,
                                  tiny / 8,   0.0f, -0.0f, nan,        0.3f * tiny, 1.0f};
    const float scale = 2.0f;
    std::vector<uint8_t> out(x.size()), out_t(x.size());
    CastHealth health;
    quantize(x.data(), std::ssize(x), scale, format, out.data(), nullptr, &health);
    EXPECT_EQ(health.saturated, 3u);
    EXPECT_EQ(health.underflow, 3u);
    for (size_t i = 0; i < x.size(); ++i) {  // the counts describe the codes written
      const float scaled = x[i] * scale;
      if (cast_underflows(x[i], out[i])) {
        EXPECT_EQ(decode(out[i], format), 0.0f) << i;
      }
      if (cast_saturates(scaled, top)) {
        EXPECT_EQ(std::fabs(decode(out[i], format)), top) << i;
      }
    }
    quantize_transpose(x.data(), 3, 4, scale, format, out.data(), out_t.data(), nullptr, &health);
    EXPECT_EQ(health.saturated, 6u);  // accumulated
    EXPECT_EQ(health.underflow, 6u);
  }
}

TEST(QuantizeTranspose, OutTIsTheTransposeOnAwkwardShapes) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (Fp8Format format : kDataFormats) {
    for (Shape shape : kAwkwardShapes) {
      check_quantize_transpose<float>(rng, format, shape);
      check_quantize_transpose<bf16>(rng, format, shape);
    }
  }
}

template <typename T>
void check_per_tensor_round_trip(const std::vector<float>& values, Fp8Format format,
                                 bool power_of_2) {
  const Input<T> input = make_input<T>(values);
  const auto count = static_cast<int64_t>(values.size());
  const float scale =
      scale_from_amax(amax(input.data.data(), count), format_max(format), power_of_2, 0.0f);
  std::vector<uint8_t> q(values.size());
  std::vector<float> dequantized(values.size());
  quantize(input.data.data(), count, scale, format, q.data(), nullptr);
  dequantize(q.data(), count, 1.0f / scale, format, dequantized.data());
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_TRUE(within_half_ulp(input.values[i], dequantized[i], scale, format))
        << format_name(format) << (power_of_2 ? " power-of-2 scale" : "");
  }
}

TEST(Quantize, DequantizedErrorWithinHalfUlp) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (Fp8Format format : kDataFormats) {
    for (bool power_of_2 : {false, true}) {
      // Amplitudes from 2^-100 to 2^100 times max (ties stay ties), and arbitrary ones.
      const float amplitudes[] = {tie_amplitude(rng, format, 100),
                                  static_cast<float>(std::fabs(rng.wide(-100, 100)))};
      for (float amplitude : amplitudes) {
        const std::vector<float> values = random_values(rng, 5000, amplitude, format);
        check_per_tensor_round_trip<float>(values, format, power_of_2);
        check_per_tensor_round_trip<bf16>(values, format, power_of_2);
      }
    }
  }
}

// The block shapes as the spec states them (not read from block_shape()).
BlockShape spec_block(BlockScaling scaling) {
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

bool is_mx(const BlockQuantization& spec) {
  return spec.scaling == BlockScaling::Mx1x32;
}

// What quantize_blocks writes: data, and either fp32 scale_inv or E8M0 codes.
struct BlockOutput {
  std::vector<uint8_t> data;
  std::vector<float> scales;
  std::vector<uint8_t> codes;
  void* scale_storage(bool mx) { return mx ? static_cast<void*>(codes.data()) : scales.data(); }
  const void* scale_storage(bool mx) const {
    return mx ? static_cast<const void*>(codes.data()) : scales.data();
  }
};

// Output buffers filled with markers, so that unwritten bytes show up.
BlockOutput block_output(Shape shape, BlockScaling scaling) {
  const BlockShape grid = scale_grid(scaling, shape.rows, shape.cols);
  const auto scale_count = static_cast<size_t>(grid.rows) * static_cast<size_t>(grid.cols);
  return {std::vector<uint8_t>(static_cast<size_t>(shape.rows * shape.cols), 0xAA),
          std::vector<float>(scale_count, -1.0f), std::vector<uint8_t>(scale_count, 0xAA)};
}

template <typename T>
BlockOutput run_quantize_blocks(const std::vector<T>& x, Shape shape,
                                const BlockQuantization& spec) {
  BlockOutput result = block_output(shape, spec.scaling);
  quantize_blocks(x.data(), shape.rows, shape.cols, spec, result.data.data(),
                  result.scale_storage(is_mx(spec)));
  return result;
}

// Per block, from that block's elements alone: the multiplier applied to the data and what the
// scale tensor must hold (scale_inv for fp32 scales, the E8M0 code for MX).
struct ExpectedBlock {
  float multiplier;
  float scale_inv;
  uint8_t code;
};

std::vector<ExpectedBlock> expected_blocks(const std::vector<float>& values, Shape shape,
                                           const BlockQuantization& spec) {
  const BlockShape block = spec_block(spec.scaling);
  const int64_t grid_rows = (shape.rows + block.rows - 1) / block.rows;
  const int64_t grid_cols = (shape.cols + block.cols - 1) / block.cols;
  const float fmax = format_max(spec.format);
  std::vector<ExpectedBlock> result;
  for (int64_t block_row = 0; block_row < grid_rows; ++block_row) {
    for (int64_t block_col = 0; block_col < grid_cols; ++block_col) {
      const int64_t c0 = block_col * block.cols;
      const int64_t c1 = std::min(shape.cols, c0 + block.cols);
      const int64_t r1 = std::min(shape.rows, (block_row + 1) * block.rows);
      float block_amax = 0.0f;
      for (int64_t r = block_row * block.rows; r < r1 && !std::isnan(block_amax); ++r) {
        const float row_amax = expected_amax(values.data() + r * shape.cols + c0, c1 - c0);
        block_amax = std::isnan(row_amax) ? row_amax : std::max(block_amax, row_amax);
      }
      if (is_mx(spec)) {
        const uint8_t code = mx_scale_from_amax(block_amax, fmax);
        const float multiplier = code == 0xFF ? kNan : std::ldexp(1.0f, 127 - code);
        result.push_back({multiplier, 0.0f, code});
      } else {
        const float multiplier =
            scale_from_amax(block_amax, fmax, spec.power_of_2_scales, spec.amax_epsilon);
        result.push_back({multiplier, 1.0f / multiplier, 0});
      }
    }
  }
  return result;
}

int64_t block_index(int64_t r, int64_t c, Shape shape, BlockScaling scaling) {
  const BlockShape block = spec_block(scaling);
  return (r / block.rows) * ((shape.cols + block.cols - 1) / block.cols) + c / block.cols;
}

// Scales and every data byte of a quantize_blocks result against the independent computation.
testing::AssertionResult blocks_match(const std::vector<float>& values, Shape shape,
                                      const BlockQuantization& spec, const BlockOutput& got) {
  const std::vector<ExpectedBlock> expected = expected_blocks(values, shape, spec);
  for (size_t i = 0; i < expected.size(); ++i) {
    const bool same =
        is_mx(spec) ? got.codes[i] == expected[i].code : got.scales[i] == expected[i].scale_inv;
    if (!same) {
      return testing::AssertionFailure()
             << "block " << i << ": scale_inv " << got.scales[i] << " / code " << int{got.codes[i]}
             << ", expected " << expected[i].scale_inv << " / " << int{expected[i].code};
    }
  }
  for (int64_t r = 0; r < shape.rows; ++r) {
    for (int64_t c = 0; c < shape.cols; ++c) {
      const int64_t i = r * shape.cols + c;
      const float multiplier = expected[block_index(r, c, shape, spec.scaling)].multiplier;
      const uint8_t want =
          reference_encode(values[i] * multiplier, spec.format, Saturation::Saturate);
      if (got.data[i] != want) {
        return testing::AssertionFailure()
               << "element (" << r << ", " << c << ") x " << values[i] << " multiplier "
               << multiplier << ": code " << int{got.data[i]} << ", expected " << int{want};
      }
    }
  }
  return testing::AssertionSuccess();
}

// Block recipes, on shapes that are and are not multiples of the block.
class BlockRecipe : public testing::TestWithParam<std::tuple<BlockScaling, Shape>> {
 protected:
  BlockScaling scaling() const { return std::get<0>(GetParam()); }
  Shape shape() const { return std::get<1>(GetParam()); }
  int64_t count() const { return shape().rows * shape().cols; }

  // Power-of-2 scales on and off, and an epsilon (fp32 scales only; MX has no such settings).
  std::vector<BlockQuantization> specs(Fp8Format format, float amplitude) const {
    if (scaling() == BlockScaling::Mx1x32) return {{scaling(), format, true, 0.0f}};
    return {{scaling(), format, true, 0.0f},
            {scaling(), format, false, std::ldexp(amplitude, -10)}};
  }

  // Magnitudes that change from block to block by exact powers of two.
  std::vector<float> block_varying_values(TestRng& rng, Fp8Format format, float amplitude) const {
    std::vector<float> values = random_values(rng, count(), amplitude, format);
    for (int64_t r = 0; r < shape().rows; ++r) {
      for (int64_t c = 0; c < shape().cols; ++c) {
        const auto shift = static_cast<int>((r / 7 + c / 29) % 16) - 12;
        float& value = values[r * shape().cols + c];
        value = std::ldexp(value, shift);
      }
    }
    return values;
  }

  // block_varying_values with, in tensors of more than 100 values, one block holding a NaN and
  // one an inf.
  std::vector<float> values_with_specials(TestRng& rng, Fp8Format format, float amplitude) const {
    std::vector<float> values = block_varying_values(rng, format, amplitude);
    if (count() > 100) {
      values[static_cast<size_t>(rng.uniform_int(0, int(count() - 1)))] = kNan;
      values[static_cast<size_t>(rng.uniform_int(0, int(count() - 1)))] = -kInf;
    }
    return values;
  }
};

TEST_P(BlockRecipe, ScaleGridCountsPartialBlocks) {
  const BlockShape block = spec_block(scaling());
  EXPECT_EQ(block_shape(scaling()).rows, block.rows);
  EXPECT_EQ(block_shape(scaling()).cols, block.cols);
  const BlockShape grid = scale_grid(scaling(), shape().rows, shape().cols);
  EXPECT_EQ(grid.rows, (shape().rows + block.rows - 1) / block.rows);
  EXPECT_EQ(grid.cols, (shape().cols + block.cols - 1) / block.cols);
}

TEST_P(BlockRecipe, ScalesAndDataMatchIndependentComputation) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (Fp8Format format : kDataFormats) {
    const float amplitude = tie_amplitude(rng, format, 40);
    const std::vector<float> values = values_with_specials(rng, format, amplitude);
    const Input<bf16> as_bf16 = make_input<bf16>(values);
    for (const BlockQuantization& spec : specs(format, amplitude)) {
      SCOPED_TRACE(case_name(format, shape()) + (spec.power_of_2_scales ? " pow2" : " epsilon"));
      ASSERT_TRUE(blocks_match(values, shape(), spec, run_quantize_blocks(values, shape(), spec)));
      ASSERT_TRUE(blocks_match(as_bf16.values, shape(), spec,
                               run_quantize_blocks(as_bf16.data, shape(), spec)))
          << "bf16 input";
    }
  }
}

TEST_P(BlockRecipe, DequantizeWithinHalfUlp) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (Fp8Format format : kDataFormats) {
    const float amplitude = tie_amplitude(rng, format, 40);
    const std::vector<float> values = block_varying_values(rng, format, amplitude);
    for (const BlockQuantization& spec : specs(format, amplitude)) {
      SCOPED_TRACE(case_name(format, shape()) + (spec.power_of_2_scales ? " pow2" : " epsilon"));
      const BlockOutput q = run_quantize_blocks(values, shape(), spec);
      std::vector<float> dequantized(values.size());
      dequantize_blocks(q.data.data(), shape().rows, shape().cols, spec,
                        q.scale_storage(is_mx(spec)), dequantized.data());
      const std::vector<ExpectedBlock> blocks = expected_blocks(values, shape(), spec);
      for (int64_t r = 0; r < shape().rows; ++r) {
        for (int64_t c = 0; c < shape().cols; ++c) {
          const int64_t i = r * shape().cols + c;
          const float multiplier = blocks[block_index(r, c, shape(), scaling())].multiplier;
          ASSERT_TRUE(within_half_ulp(values[i], dequantized[i], multiplier, format))
              << "element (" << r << ", " << c << ")";
        }
      }
    }
  }
}

template <typename T>
void check_transpose_blocks(const std::vector<T>& x, Shape shape, const BlockQuantization& spec) {
  const Shape transposed_shape{shape.cols, shape.rows};
  BlockOutput out = block_output(shape, spec.scaling);
  BlockOutput out_t = block_output(transposed_shape, spec.scaling);
  quantize_transpose_blocks(x.data(), shape.rows, shape.cols, spec, out.data.data(),
                            out.scale_storage(is_mx(spec)), out_t.data.data(),
                            out_t.scale_storage(is_mx(spec)));
  const BlockOutput direct = run_quantize_blocks(x, shape, spec);
  EXPECT_EQ(out.data, direct.data);
  EXPECT_EQ(out.scales, direct.scales);
  EXPECT_EQ(out.codes, direct.codes);
  if (spec.scaling == BlockScaling::Tile128x128) {
    // The same 128x128 tiles, transposed: same elements, same scale.
    const BlockShape grid = scale_grid(spec.scaling, shape.rows, shape.cols);
    EXPECT_EQ(out_t.data, transposed(out.data, shape));
    EXPECT_EQ(out_t.scales, transposed(out.scales, Shape{grid.rows, grid.cols}));
  } else {
    // 1xB blocks of the transpose run along the original columns.
    const BlockOutput expected = run_quantize_blocks(transposed(x, shape), transposed_shape, spec);
    EXPECT_EQ(out_t.data, expected.data);
    EXPECT_EQ(out_t.scales, expected.scales);
    EXPECT_EQ(out_t.codes, expected.codes);
  }
}

TEST_P(BlockRecipe, QuantizeTransposeBlocks) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (Fp8Format format : {Fp8Format::E4M3, Fp8Format::E5M2FNUZ}) {
    const float amplitude = tie_amplitude(rng, format, 40);
    const std::vector<float> values = block_varying_values(rng, format, amplitude);
    for (const BlockQuantization& spec : specs(format, amplitude)) {
      SCOPED_TRACE(case_name(format, shape()));
      check_transpose_blocks(values, shape(), spec);
      check_transpose_blocks(make_input<bf16>(values).data, shape(), spec);
    }
  }
}

TEST_P(BlockRecipe, OutlierChangesOnlyItsOwnBlock) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const Fp8Format format = Fp8Format::E4M3;
  const float amplitude = tie_amplitude(rng, format, 10);
  std::vector<float> values = block_varying_values(rng, format, amplitude);
  const BlockQuantization spec = specs(format, amplitude).front();
  const BlockOutput before = run_quantize_blocks(values, shape(), spec);
  const int64_t r = rng.uniform_int(0, int(shape().rows - 1));
  const int64_t c = rng.uniform_int(0, int(shape().cols - 1));
  values[r * shape().cols + c] = 3e38f;
  const BlockOutput after = run_quantize_blocks(values, shape(), spec);
  const int64_t outlier_block = block_index(r, c, shape(), scaling());
  for (int64_t rr = 0; rr < shape().rows; ++rr) {
    for (int64_t cc = 0; cc < shape().cols; ++cc) {
      const int64_t b = block_index(rr, cc, shape(), scaling());
      const int64_t i = rr * shape().cols + cc;
      if (b == outlier_block) continue;
      ASSERT_EQ(after.data[i], before.data[i]) << "element (" << rr << ", " << cc << ")";
      if (is_mx(spec)) {
        ASSERT_EQ(after.codes[b], before.codes[b]) << "block " << b;
      } else {
        ASSERT_EQ(after.scales[b], before.scales[b]) << "block " << b;
      }
    }
  }
  if (is_mx(spec)) {
    EXPECT_NE(after.codes[outlier_block], before.codes[outlier_block]);
  } else {
    EXPECT_NE(after.scales[outlier_block], before.scales[outlier_block]);
  }
}

// The counts a block cast must make, from the independent computation of the blocks'
// multipliers and the format model: beyond ±max after scaling, or non-zero and encoded to zero
// (a NaN code is not zero, whatever its bits).
CastHealth expected_health(const std::vector<float>& values, Shape shape,
                           const BlockQuantization& spec) {
  const std::vector<ExpectedBlock> blocks = expected_blocks(values, shape, spec);
  const double top = test::max_finite(spec.format);
  CastHealth health;
  for (int64_t r = 0; r < shape.rows; ++r) {
    for (int64_t c = 0; c < shape.cols; ++c) {
      const float value = values[r * shape.cols + c];
      const float scaled = value * blocks[block_index(r, c, shape, spec.scaling)].multiplier;
      const uint8_t code = reference_encode(scaled, spec.format, Saturation::Saturate);
      health.saturated += std::fabs(scaled) > top ? 1 : 0;
      health.underflow +=
          value != 0.0f && !std::isnan(value) && test::expected_value(code, spec.format) == 0.0 ? 1
                                                                                                : 0;
    }
  }
  return health;
}

void expect_health_equal(const CastHealth& got, const CastHealth& expected, const char* what) {
  EXPECT_EQ(got.saturated, expected.saturated) << what << ": saturated";
  EXPECT_EQ(got.underflow, expected.underflow) << what << ": underflow";
}

template <typename T>
void check_block_cast_health(const Input<T>& input, Shape shape, const BlockQuantization& spec) {
  const CastHealth expected = expected_health(input.values, shape, spec);
  BlockOutput out = block_output(shape, spec.scaling);
  CastHealth health;
  quantize_blocks(input.data.data(), shape.rows, shape.cols, spec, out.data.data(),
                  out.scale_storage(is_mx(spec)), &health);
  expect_health_equal(health, expected, "quantize_blocks");
  const BlockOutput without = run_quantize_blocks(input.data, shape, spec);
  EXPECT_EQ(out.data, without.data);
  EXPECT_EQ(out.scales, without.scales);
  EXPECT_EQ(out.codes, without.codes);

  // The transposed copy is not counted: the same counts, whatever its blocks hold.
  BlockOutput out_t = block_output(Shape{shape.cols, shape.rows}, spec.scaling);
  CastHealth transposed_health;
  quantize_transpose_blocks(input.data.data(), shape.rows, shape.cols, spec, out.data.data(),
                            out.scale_storage(is_mx(spec)), out_t.data.data(),
                            out_t.scale_storage(is_mx(spec)), &transposed_health);
  expect_health_equal(transposed_health, expected, "quantize_transpose_blocks");
  EXPECT_EQ(out.data, without.data);
}

TEST_P(BlockRecipe, CastHealthCountsTheRowWiseCodesAndChangesNothing) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (Fp8Format format : kDataFormats) {
    const float amplitude = tie_amplitude(rng, format, 40);
    const std::vector<float> values = values_with_specials(rng, format, amplitude);
    for (const BlockQuantization& spec : specs(format, amplitude)) {
      SCOPED_TRACE(case_name(format, shape()) + (spec.power_of_2_scales ? " pow2" : " epsilon"));
      check_block_cast_health(make_input<float>(values), shape(), spec);
      check_block_cast_health(make_input<bf16>(values), shape(), spec);
    }
  }
}

std::string block_recipe_name(const testing::TestParamInfo<BlockRecipe::ParamType>& info) {
  const char* const names[] = {"Rows1x128", "Tile128x128", "Mx1x32"};
  const Shape shape = std::get<1>(info.param);
  return std::string(names[static_cast<int>(std::get<0>(info.param))]) + "_" +
         std::to_string(shape.rows) + "x" + std::to_string(shape.cols);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BlockRecipe,
    testing::Combine(testing::Values(BlockScaling::Rows1x128, BlockScaling::Tile128x128,
                                     BlockScaling::Mx1x32),
                     testing::Values(Shape{128, 256}, Shape{256, 384}, Shape{5, 160},
                                     Shape{217, 300}, Shape{1, 1}, Shape{130, 129})),
    block_recipe_name);

// The first fp32 above 1 whose scale under fp32 scales that are no power of two (top / amax,
// rounded to nearest) puts the amax itself above top.
float amax_whose_scale_rounds_up(float top) {
  float amax = 1.0f;
  while (!(amax * scale_from_amax(amax, top, false, 0.0f) > top) && amax < 2.0f)
    amax = std::nextafter(amax, 2.0f);
  return amax;
}

// Block b's values at distinct elements of that block, zeros elsewhere: 1xB blocks are the rows
// of [blocks, B]; 128x128 tiles lie side by side in [128, 128·blocks], each value on its own row.
std::pair<Shape, std::vector<float>> place_blocks(BlockScaling scaling,
                                                  const std::vector<std::vector<float>>& blocks) {
  const BlockShape block = spec_block(scaling);
  const auto count = static_cast<int64_t>(blocks.size());
  const Shape shape = block.rows == 1 ? Shape{count, block.cols} : Shape{block.rows, count * 128};
  std::vector<float> values(static_cast<size_t>(shape.rows * shape.cols), 0.0f);
  for (int64_t b = 0; b < count; ++b) {
    for (int64_t k = 0; k < std::ssize(blocks[b]); ++k) {
      const int64_t r = block.rows == 1 ? b : k * 37 % 128;
      const int64_t c = block.rows == 1 ? k : b * 128 + k;
      values[r * shape.cols + c] = blocks[b][k];
    }
  }
  return {shape, values};
}

// Crafted blocks whose counts are known under each scaling (top: the format's max; tiny: its
// smallest subnormal):
//  0. amax 16·top: every scaling multiplies by 2^-4 exactly. 0.2·tiny, the tie -0.5·tiny (to the
//     even code, zero) and two fp32 subnormals underflow once scaled; 0.6·tiny rounds up to tiny;
//     nothing saturates.
//  1. ±inf: an fp32 scale is 1: ±inf, 2·top and -1.5·top saturate, 0.2·tiny underflows. The
//     E8M0 scale is 2^127: ±inf saturate, the five finite non-zero values underflow.
//  2. a NaN: an fp32 scale is 1: 2·top saturates, 0.2·tiny underflows. The E8M0 scale is NaN:
//     every code is NaN (0x80 in FNUZ, the bits of -0 elsewhere) and counts as neither.
//  3. ±amax where top / amax rounds up in fp32: the amax lands above top under fp32 scales that
//     are no power of two; rounded down to a power of two, or up to an E8M0 scale (the rule
//     rounds log2(amax / top) up), the scale keeps it within. Only infinities saturate there.
TEST(BlockCastHealth, CountsSaturationAndUnderflowOnCraftedBlocks) {
  const float denorm_min = std::numeric_limits<float>::denorm_min();
  for (Fp8Format format : kDataFormats) {
    const float top = format_max(format);
    const float tiny = decode(1, format);
    const float rounded = amax_whose_scale_rounds_up(top);
    ASSERT_GT(rounded * scale_from_amax(rounded, top, false, 0.0f), top) << format_name(format);
    const std::vector<std::vector<float>> blocks = {
        {16 * top, -16 * top, 8 * top, 16 * 0.2f * tiny, -8 * tiny, 16 * 0.6f * tiny, 1e-38f,
         denorm_min, 0.0f, -0.0f},
        {kInf, -kInf, 2 * top, -1.5f * top, top, 0.2f * tiny, 1.0f, 0.0f},
        {kNan, 2 * top, 0.2f * tiny, 1.0f},
        {rounded, -rounded}};
    struct Case {
      BlockQuantization spec;
      CastHealth expected;
    };
    const Case cases[] = {
        {{BlockScaling::Rows1x128, format, true, 0.0f}, {5, 6}},
        {{BlockScaling::Rows1x128, format, false, 0.0f}, {7, 6}},
        {{BlockScaling::Tile128x128, format, true, 0.0f}, {5, 6}},
        {{BlockScaling::Tile128x128, format, false, 0.0f}, {7, 6}},
        {{BlockScaling::Mx1x32, format, true, 0.0f}, {2, 9}},
    };
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(format_name(format)) + " block " +
                   std::to_string(spec_block(c.spec.scaling).rows) + "x" +
                   std::to_string(spec_block(c.spec.scaling).cols) +
                   (c.spec.power_of_2_scales ? " pow2" : ""));
      const auto [shape, values] = place_blocks(c.spec.scaling, blocks);
      expect_health_equal(expected_health(values, shape, c.spec), c.expected, "model");
      check_block_cast_health(make_input<float>(values), shape, c.spec);

      // Counts accumulate over calls.
      BlockOutput out = block_output(shape, c.spec.scaling);
      CastHealth health = c.expected;
      quantize_blocks(values.data(), shape.rows, shape.cols, c.spec, out.data.data(),
                      out.scale_storage(is_mx(c.spec)), &health);
      expect_health_equal(health, {2 * c.expected.saturated, 2 * c.expected.underflow}, "twice");
    }
  }
}

TEST(QuantizeBlocks, E8M0IsNotADataFormat) {
  const std::vector<float> x(64, 1.0f);
  std::vector<uint8_t> out(64), out_t(64);
  std::vector<float> scales(64), scales_t(64);  // room for either kind of scale
  for (BlockScaling scaling : {BlockScaling::Rows1x128, BlockScaling::Mx1x32}) {
    const BlockQuantization spec{scaling, Fp8Format::E8M0, true, 0.0f};
    EXPECT_THROW(quantize_blocks(x.data(), 1, 64, spec, out.data(), scales.data()), Error);
    EXPECT_THROW(quantize_transpose_blocks(x.data(), 1, 64, spec, out.data(), scales.data(),
                                           out_t.data(), scales_t.data()),
                 Error);
  }
}

}  // namespace
}  // namespace fp8t
