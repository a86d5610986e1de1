// The FP8 formats: decoding of every code, round-to-nearest-even encoding with both overflow
// behaviours, bf16, and format/family names. Expectations come from tests/numerics/test_util.h,
// which models the formats from their definitions rather than from src/numerics.
#include "numerics/formats.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "numerics/float_bits.h"
#include "test_util.h"

namespace fp8t {
namespace {

using test::expected_value;
using test::kDataFormats;
using test::kSaturations;
using test::reference_encode;
using test::spec_of;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

std::string label(Fp8Format format) {
  return std::string(format_name(format));
}
std::string label(Fp8Format format, Saturation saturation) {
  return label(format) + (saturation == Saturation::Saturate ? " saturate" : " non-saturate");
}

// Encodes through both entry points (they differ only on CUDA devices).
void expect_encodes_to(float value, Fp8Format format, Saturation saturation, uint8_t expected) {
  SCOPED_TRACE(label(format, saturation) + " value " + std::to_string(value));
  EXPECT_EQ(encode_reference(value, format, saturation), expected);
  EXPECT_EQ(encode(value, format, saturation), expected);
}

TEST(FormatTraits, MatchTheSpecTable) {
  for (Fp8Format format : kAllFormats) {
    SCOPED_TRACE(label(format));
    const FormatTraits traits = format_traits(format);
    const test::FormatSpec spec = spec_of(format);
    EXPECT_EQ(traits.exponent_bits, spec.exponent_only ? 8 : 7 - spec.mantissa_bits);
    EXPECT_EQ(traits.mantissa_bits, spec.mantissa_bits);
    EXPECT_EQ(traits.bias, spec.bias);
    EXPECT_EQ(traits.fnuz, spec.fnuz);
    EXPECT_EQ(traits.has_inf, spec.has_inf);
    EXPECT_EQ(traits.max_code, spec.max_code);
    EXPECT_EQ(traits.nan_code, spec.nan_code);
  }
}

TEST(Decode, EveryCodeEqualsItsBitFieldValue) {
  for (Fp8Format format : kAllFormats) {
    for (int code = 0; code < 256; ++code) {
      SCOPED_TRACE(label(format) + " code " + std::to_string(code));
      const double expected = expected_value(static_cast<uint8_t>(code), format);
      const float actual = decode(static_cast<uint8_t>(code), format);
      if (std::isnan(expected)) {
        EXPECT_TRUE(std::isnan(actual));
      } else {
        EXPECT_EQ(static_cast<double>(actual), expected);
        EXPECT_EQ(std::signbit(actual), std::signbit(expected));  // tells -0 from +0
      }
    }
  }
}

// Codes that decode to NaN, inf or -0, listed by hand from the spec.
TEST(Decode, SpecialCodes) {
  struct Specials {
    Fp8Format format;
    std::vector<int> nans;
    std::vector<int> infs;
    std::vector<int> negative_zeros;
  };
  const Specials table[] = {
      {Fp8Format::E4M3, {0x7F, 0xFF}, {}, {0x80}},
      {Fp8Format::E5M2, {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}, {0x7C, 0xFC}, {0x80}},
      {Fp8Format::E4M3FNUZ, {0x80}, {}, {}},
      {Fp8Format::E5M2FNUZ, {0x80}, {}, {}},
      {Fp8Format::E8M0, {0xFF}, {}, {}},
  };
  for (const Specials& specials : table) {
    for (int code = 0; code < 256; ++code) {
      SCOPED_TRACE(label(specials.format) + " code " + std::to_string(code));
      const float value = decode(static_cast<uint8_t>(code), specials.format);
      const auto listed = [code](const std::vector<int>& codes) {
        return std::find(codes.begin(), codes.end(), code) != codes.end();
      };
      EXPECT_EQ(std::isnan(value), listed(specials.nans));
      EXPECT_EQ(std::isinf(value), listed(specials.infs));
      EXPECT_EQ(value == 0.0f && std::signbit(value), listed(specials.negative_zeros));
    }
  }
  EXPECT_EQ(decode(0x7C, Fp8Format::E5M2), kInf);
  EXPECT_EQ(decode(0xFC, Fp8Format::E5M2), -kInf);
  for (Fp8Format format : {Fp8Format::E4M3FNUZ, Fp8Format::E5M2FNUZ}) {
    EXPECT_EQ(decode(0x00, format), 0.0f);
    EXPECT_FALSE(std::signbit(decode(0x00, format)));
  }
}

TEST(Decode, MaxMinSubnormalAndZeros) {
  struct Extremes {
    Fp8Format format;
    float max;
    float min_subnormal;  // code 0x01
    float min_normal;
    uint8_t min_normal_code;
  };
  const Extremes table[] = {
      {Fp8Format::E4M3, 448.0f, std::ldexp(1.0f, -9), std::ldexp(1.0f, -6), 0x08},
      {Fp8Format::E5M2, 57344.0f, std::ldexp(1.0f, -16), std::ldexp(1.0f, -14), 0x04},
      {Fp8Format::E4M3FNUZ, 240.0f, std::ldexp(1.0f, -10), std::ldexp(1.0f, -7), 0x08},
      {Fp8Format::E5M2FNUZ, 57344.0f, std::ldexp(1.0f, -17), std::ldexp(1.0f, -15), 0x04},
  };
  for (const Extremes& e : table) {
    SCOPED_TRACE(label(e.format));
    const uint8_t max_code = format_traits(e.format).max_code;
    EXPECT_EQ(format_max(e.format), e.max);
    EXPECT_EQ(decode(max_code, e.format), e.max);
    EXPECT_EQ(decode(static_cast<uint8_t>(0x80 | max_code), e.format), -e.max);
    EXPECT_EQ(decode(0x01, e.format), e.min_subnormal);
    EXPECT_EQ(decode(0x81, e.format), -e.min_subnormal);
    EXPECT_EQ(decode(e.min_normal_code, e.format), e.min_normal);
    EXPECT_EQ(decode(static_cast<uint8_t>(e.min_normal_code - 1), e.format),
              e.min_normal - e.min_subnormal);  // largest subnormal
    EXPECT_EQ(decode(0x00, e.format), 0.0f);
  }
  EXPECT_TRUE(std::signbit(decode(0x80, Fp8Format::E4M3)));
  EXPECT_TRUE(std::signbit(decode(0x80, Fp8Format::E5M2)));
  EXPECT_EQ(format_max(Fp8Format::E8M0), std::ldexp(1.0f, 127));
  EXPECT_EQ(decode(0x00, Fp8Format::E8M0), std::ldexp(1.0f, -127));  // an fp32 subnormal
  EXPECT_EQ(decode(0x7F, Fp8Format::E8M0), 1.0f);
}

TEST(Encode, EveryFiniteCodeRoundTrips) {
  for (Fp8Format format : kAllFormats) {
    for (Saturation saturation : kSaturations) {
      for (int code = 0; code < 256; ++code) {
        const float value = decode(static_cast<uint8_t>(code), format);
        if (!std::isfinite(value)) continue;
        expect_encodes_to(value, format, saturation, static_cast<uint8_t>(code));
      }
    }
  }
  // Zeros: OCP keeps the sign, FNUZ has only +0, E8M0 has no zero (smallest code).
  for (Saturation saturation : kSaturations) {
    expect_encodes_to(-0.0f, Fp8Format::E4M3, saturation, 0x80);
    expect_encodes_to(-0.0f, Fp8Format::E5M2, saturation, 0x80);
    expect_encodes_to(-0.0f, Fp8Format::E4M3FNUZ, saturation, 0x00);
    expect_encodes_to(-0.0f, Fp8Format::E5M2FNUZ, saturation, 0x00);
    expect_encodes_to(-0.0f, Fp8Format::E8M0, saturation, 0x00);
  }
}

// Between adjacent codes c and c+1 the midpoint goes to the one with an even mantissa LSB
// (the code's LSB), and the floats either side of it to the nearer code.
TEST(Encode, MidpointsTieToEvenAndNeighboursRoundToNearer) {
  for (Fp8Format format : kAllFormats) {
    const test::FormatSpec spec = spec_of(format);
    const bool has_negatives = !spec.exponent_only;
    for (int low = 0; low < spec.max_code; ++low) {
      const double low_value = test::field_magnitude(low, spec);
      const double high_value = test::field_magnitude(low + 1, spec);
      const double midpoint = (low_value + high_value) / 2;
      const auto mid = static_cast<float>(midpoint);
      ASSERT_EQ(static_cast<double>(mid), midpoint) << "midpoint not exact in fp32";
      const int even = low % 2 == 0 ? low : low + 1;
      for (Saturation saturation : kSaturations) {
        for (int sign : {1, -1}) {
          if (sign < 0 && !has_negatives) continue;
          // Negative values rounding to zero give +0 in FNUZ (and E8M0 has no signed zero).
          const auto with_sign = [&](int magnitude) {
            if (sign > 0 || (magnitude == 0 && spec.fnuz)) return static_cast<uint8_t>(magnitude);
            return static_cast<uint8_t>(0x80 | magnitude);
          };
          const float s = static_cast<float>(sign);
          expect_encodes_to(s * mid, format, saturation, with_sign(even));
          expect_encodes_to(s * std::nextafter(mid, 0.0f), format, saturation, with_sign(low));
          expect_encodes_to(s * std::nextafter(mid, kInf), format, saturation, with_sign(low + 1));
        }
      }
    }
  }
}

// Beyond max: clamp when saturating; otherwise inf (E5M2) or the NaN code. The threshold is
// max + half ulp, where the tie goes to the even one of max_code and max_code + 1.
TEST(Encode, OverflowThresholdAndInfinities) {
  struct Overflow {
    Fp8Format format;
    float threshold;            // max + half ulp
    bool threshold_overflows;   // max_code + 1 is the even code
    uint8_t positive_overflow;  // non-saturating
    uint8_t negative_overflow;
  };
  const Overflow table[] = {
      {Fp8Format::E4M3, 464.0f, false, 0x7F, 0x7F},
      {Fp8Format::E5M2, 61440.0f, true, 0x7C, 0xFC},
      {Fp8Format::E4M3FNUZ, 248.0f, true, 0x80, 0x80},
      {Fp8Format::E5M2FNUZ, 61440.0f, true, 0x80, 0x80},
  };
  for (const Overflow& o : table) {
    const uint8_t max_code = spec_of(o.format).max_code;
    const auto negative_max = static_cast<uint8_t>(0x80 | max_code);
    for (float value : {std::nextafter(o.threshold, kInf), 2 * o.threshold, 1e30f, FLT_MAX, kInf}) {
      expect_encodes_to(value, o.format, Saturation::Saturate, max_code);
      expect_encodes_to(-value, o.format, Saturation::Saturate, negative_max);
      expect_encodes_to(value, o.format, Saturation::NonSaturate, o.positive_overflow);
      expect_encodes_to(-value, o.format, Saturation::NonSaturate, o.negative_overflow);
    }
    const float below = std::nextafter(o.threshold, 0.0f);
    const float max = static_cast<float>(test::max_finite(o.format));
    for (float value : {below, std::nextafter(max, kInf)}) {
      for (Saturation saturation : kSaturations) {
        expect_encodes_to(value, o.format, saturation, max_code);
        expect_encodes_to(-value, o.format, saturation, negative_max);
      }
    }
    expect_encodes_to(o.threshold, o.format, Saturation::Saturate, max_code);
    expect_encodes_to(-o.threshold, o.format, Saturation::Saturate, negative_max);
    expect_encodes_to(o.threshold, o.format, Saturation::NonSaturate,
                      o.threshold_overflows ? o.positive_overflow : max_code);
    expect_encodes_to(-o.threshold, o.format, Saturation::NonSaturate,
                      o.threshold_overflows ? o.negative_overflow : negative_max);
  }
}

TEST(Encode, NanGivesTheFormatsNanCode) {
  const float nans[] = {kNan, -kNan, bits_to_float(0x7F800001u), bits_to_float(0xFFFFFFFFu)};
  for (Fp8Format format : kAllFormats) {
    for (Saturation saturation : kSaturations) {
      for (float nan : nans) {
        expect_encodes_to(nan, format, saturation, format_traits(format).nan_code);
        expect_encodes_to(nan, format, saturation, spec_of(format).nan_code);
      }
    }
  }
}

TEST(Encode, FnuzNegativeUnderflowIsPositiveZero) {
  for (Fp8Format format : {Fp8Format::E4M3FNUZ, Fp8Format::E5M2FNUZ}) {
    const float min_subnormal = decode(0x01, format);
    for (float value : {-0.0f, -min_subnormal / 2, -min_subnormal / 4, -1e-30f, -FLT_TRUE_MIN}) {
      for (Saturation saturation : kSaturations)
        expect_encodes_to(value, format, saturation, 0x00);
    }
    expect_encodes_to(-std::nextafter(min_subnormal / 2, 1.0f), format, Saturation::Saturate, 0x81);
  }
  // OCP formats keep the sign of a zero result.
  expect_encodes_to(-std::ldexp(1.0f, -10), Fp8Format::E4M3, Saturation::Saturate, 0x80);
  expect_encodes_to(-1e-30f, Fp8Format::E5M2, Saturation::Saturate, 0x80);
}

TEST(Encode, E8M0ScaleCodes) {
  constexpr Fp8Format kE8M0 = Fp8Format::E8M0;
  for (Saturation saturation : kSaturations) {
    for (int exponent = -127; exponent <= 127; ++exponent) {
      expect_encodes_to(std::ldexp(1.0f, exponent), kE8M0, saturation,
                        static_cast<uint8_t>(exponent + 127));
    }
    // Ties in linear space go to the even code.
    expect_encodes_to(1.5f, kE8M0, saturation, 128);   // 1 (127) or 2 (128)
    expect_encodes_to(3.0f, kE8M0, saturation, 128);   // 2 (128) or 4 (129)
    expect_encodes_to(0.75f, kE8M0, saturation, 126);  // 0.5 (126) or 1 (127)
    expect_encodes_to(std::nextafter(3.0f, kInf), kE8M0, saturation, 129);
    expect_encodes_to(std::nextafter(1.5f, 0.0f), kE8M0, saturation, 127);
    expect_encodes_to(1.5f * std::ldexp(1.0f, 127), kE8M0, saturation, 0xFE);
    // Zero and anything below 2^-127 clamp to the smallest scale.
    for (float tiny : {0.0f, -0.0f, FLT_TRUE_MIN, std::ldexp(1.0f, -128),
                       std::nextafter(std::ldexp(1.0f, -127), 0.0f)}) {
      expect_encodes_to(tiny, kE8M0, saturation, 0x00);
    }
    // No negative scales; NaN has its code.
    for (float invalid : {-1.0f, -FLT_TRUE_MIN, -kInf, kNan}) {
      expect_encodes_to(invalid, kE8M0, saturation, 0xFF);
    }
  }
  expect_encodes_to(kInf, kE8M0, Saturation::Saturate, 0xFE);
  expect_encodes_to(kInf, kE8M0, Saturation::NonSaturate, 0xFF);
  expect_encodes_to(FLT_MAX, kE8M0, Saturation::Saturate, 0xFE);  // past 1.5 * 2^127
  expect_encodes_to(FLT_MAX, kE8M0, Saturation::NonSaturate, 0xFF);
}

// Random fp32 bit patterns (every class of input) and values near the format's grid.
TEST(Encode, MatchesIndependentModelOnRandomFloats) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (Fp8Format format : kAllFormats) {
    const test::FormatSpec spec = spec_of(format);
    for (int i = 0; i < 40000; ++i) {
      float value = bits_to_float(rng.bits());
      if (i % 2 == 1) {  // a grid value moved by a few fp32 ulps, or a scaled midpoint
        const int code = rng.uniform_int(0, spec.max_code + 1);
        const double grid = test::field_magnitude(code, spec);
        value = static_cast<float>(rng.chance(0.5) ? grid : grid * rng.uniform(0.5, 1.0));
        const int steps = rng.uniform_int(-3, 3);
        for (int s = 0; s < std::abs(steps); ++s)
          value = std::nextafter(value, steps > 0 ? kInf : -kInf);
        if (!spec.exponent_only && rng.chance(0.5)) value = -value;
      }
      for (Saturation saturation : kSaturations) {
        const uint8_t expected = reference_encode(value, format, saturation);
        ASSERT_EQ(encode_reference(value, format, saturation), expected)
            << label(format, saturation) << " value " << value << " bits " << std::hex
            << float_to_bits(value);
        ASSERT_EQ(encode(value, format, saturation), expected);
      }
    }
  }
}

TEST(Bf16, FloatToBf16RoundsToNearestEven) {
  struct Case {
    float value;
    uint16_t expected;
  };
  const Case cases[] = {
      {1.0f, 0x3F80},
      {1.0f + std::ldexp(1.0f, -8), 0x3F80},      // tie, 0x3F80 even
      {1.0f + 3 * std::ldexp(1.0f, -8), 0x3F82},  // tie, 0x3F82 even
      {1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20), 0x3F81},
      {-2.5f, 0xC020},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {FLT_MAX, 0x7F80},  // rounds up past the largest bf16
      {kInf, 0x7F80},
      {-kInf, 0xFF80},
      {FLT_TRUE_MIN, 0x0000},
      {bits_to_float(0x00018000u), 0x0002},  // subnormal tie to even
  };
  for (const Case& c : cases) {
    EXPECT_EQ(float_to_bf16(c.value).bits, c.expected) << c.value;
  }
  for (float nan : {kNan, -kNan, bits_to_float(0x7F800001u)}) {
    const bf16 b = float_to_bf16(nan);
    EXPECT_TRUE(std::isnan(bf16_to_float(b)));
    EXPECT_EQ(b.bits >> 15, float_to_bits(nan) >> 31);  // keeps the sign
  }
  // Random finite floats: the result is the nearer of the two bf16 neighbours, even on ties.
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (int i = 0; i < 100000; ++i) {
    const float value = bits_to_float(rng.bits());
    if (!std::isfinite(value)) continue;
    const auto truncated = static_cast<uint16_t>(float_to_bits(value) >> 16);
    const double down = bf16_to_float(bf16{truncated});
    // Past the largest bf16 the next step is 2^128 (which then overflows to inf).
    const double up = (truncated & 0x7FFF) == 0x7F7F
                          ? std::copysign(0x1p128, double{value})
                          : double{bf16_to_float(bf16{static_cast<uint16_t>(truncated + 1)})};
    const double distance_down = std::fabs(double{value} - down);
    const double distance_up = std::fabs(up - double{value});
    const bool round_up =
        distance_up < distance_down || (distance_up == distance_down && (truncated & 1));
    ASSERT_EQ(float_to_bf16(value).bits, round_up ? truncated + 1 : truncated) << value;
  }
}

TEST(Bf16, EncodeOfEveryBf16PatternMatchesFloatEncode) {
  for (Fp8Format format : kAllFormats) {
    for (Saturation saturation : kSaturations) {
      for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
        const bf16 value{static_cast<uint16_t>(bits)};
        const float as_float = bf16_to_float(value);
        const uint8_t expected = encode_reference(as_float, format, saturation);
        ASSERT_EQ(encode(value, format, saturation), expected)
            << label(format, saturation) << " bf16 0x" << std::hex << bits;
        ASSERT_EQ(expected, reference_encode(as_float, format, saturation))
            << label(format, saturation) << " bf16 0x" << std::hex << bits;
      }
    }
  }
}

TEST(FormatNames, RoundTripAndUnknownNames) {
  const std::pair<Fp8Format, std::string_view> names[] = {{Fp8Format::E4M3, "e4m3"},
                                                          {Fp8Format::E5M2, "e5m2"},
                                                          {Fp8Format::E4M3FNUZ, "e4m3fnuz"},
                                                          {Fp8Format::E5M2FNUZ, "e5m2fnuz"},
                                                          {Fp8Format::E8M0, "e8m0"}};
  for (const auto& [format, name] : names) {
    EXPECT_EQ(format_name(format), name);
    EXPECT_EQ(parse_format(name), format);
  }
  for (std::string_view unknown : {"", "fp16", "e4m3fn", "e5m2 ", "hybrid"}) {
    EXPECT_EQ(parse_format(unknown), std::nullopt) << unknown;
  }
  EXPECT_EQ(family_name(Fp8Family::Ocp), "ocp");
  EXPECT_EQ(family_name(Fp8Family::Fnuz), "fnuz");
}

TEST(Family, ForArchitecture) {
  for (std::string_view ocp : {"cpu", "sm_89", "sm_90", "sm_100", "gfx950"}) {
    EXPECT_EQ(family_for_architecture(ocp), Fp8Family::Ocp) << ocp;
  }
  EXPECT_EQ(family_for_architecture("gfx942"), Fp8Family::Fnuz);
  for (std::string_view unsupported : {"gfx90a", "gfx1100"}) {
    try {
      family_for_architecture(unsupported);
      ADD_FAILURE() << "no ConfigError for " << unsupported;
    } catch (const ConfigError& error) {
      EXPECT_NE(std::string(error.what()).find(unsupported), std::string::npos) << error.what();
    }
  }
}

TEST(Family, ResolveHonoursOverrides) {
  EXPECT_EQ(resolve_family(FamilySetting::Ocp, "gfx942"), Fp8Family::Ocp);
  EXPECT_EQ(resolve_family(FamilySetting::Fnuz, "sm_90"), Fp8Family::Fnuz);
  EXPECT_EQ(resolve_family(FamilySetting::Ocp, "gfx90a"), Fp8Family::Ocp);  // no lookup
  EXPECT_EQ(resolve_family(FamilySetting::Auto, "gfx942"), Fp8Family::Fnuz);
  EXPECT_EQ(resolve_family(FamilySetting::Auto, "sm_90"), Fp8Family::Ocp);
  EXPECT_THROW(resolve_family(FamilySetting::Auto, "gfx90a"), ConfigError);
}

TEST(Family, FormatsPerFamily) {
  EXPECT_EQ(e4m3_format(Fp8Family::Ocp), Fp8Format::E4M3);
  EXPECT_EQ(e5m2_format(Fp8Family::Ocp), Fp8Format::E5M2);
  EXPECT_EQ(e4m3_format(Fp8Family::Fnuz), Fp8Format::E4M3FNUZ);
  EXPECT_EQ(e5m2_format(Fp8Family::Fnuz), Fp8Format::E5M2FNUZ);
}

}  // namespace
}  // namespace fp8t
