// Helpers shared by the numerics tests: a model of the FP8 formats written from their
// definitions (FP8_RECIPES.md), independent of src/numerics, and reproducible random numbers.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "numerics/formats.h"

namespace fp8t::test {

inline constexpr Fp8Format kDataFormats[] = {Fp8Format::E4M3, Fp8Format::E5M2, Fp8Format::E4M3FNUZ,
                                             Fp8Format::E5M2FNUZ};
inline constexpr Saturation kSaturations[] = {Saturation::Saturate, Saturation::NonSaturate};

// The layout of each format as the spec states it; deliberately not read from format_traits.
struct FormatSpec {
  int mantissa_bits;
  int bias;
  uint8_t max_code;  // magnitude code of the largest finite value
  uint8_t nan_code;  // what NaN input encodes to
  bool fnuz;         // single NaN 0x80, no -0
  bool has_inf;      // s.11111.00
  bool exponent_only;
};

inline FormatSpec spec_of(Fp8Format format) {
  switch (format) {
    case Fp8Format::E4M3:
      return {3, 7, 0x7E, 0x7F, false, false, false};
    case Fp8Format::E5M2:
      return {2, 15, 0x7B, 0x7F, false, true, false};
    case Fp8Format::E4M3FNUZ:
      return {3, 8, 0x7F, 0x80, true, false, false};
    case Fp8Format::E5M2FNUZ:
      return {2, 16, 0x7F, 0x80, true, false, false};
    case Fp8Format::E8M0:
      return {0, 127, 0xFE, 0xFF, false, false, true};
  }
  return {};
}

// Magnitude of a sign-less code from its bit fields alone (special codes not considered), so
// it also gives the value the code after max_code would have.
inline double field_magnitude(int magnitude_code, const FormatSpec& spec) {
  if (spec.exponent_only) return std::ldexp(1.0, magnitude_code - spec.bias);
  const int m = spec.mantissa_bits;
  const int exponent = magnitude_code >> m;
  const int mantissa = magnitude_code & ((1 << m) - 1);
  if (exponent == 0) return std::ldexp(mantissa, 1 - spec.bias - m);  // subnormal
  return std::ldexp(mantissa + (1 << m), exponent - spec.bias - m);
}

// The documented value of a code; NaN for NaN codes.
inline double expected_value(uint8_t code, Fp8Format format) {
  const FormatSpec spec = spec_of(format);
  constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  if (spec.exponent_only) return code == 0xFF ? kNan : field_magnitude(code, spec);
  if (spec.fnuz && code == 0x80) return kNan;
  const bool negative = (code & 0x80) != 0;
  const int magnitude = code & 0x7F;
  if (!spec.fnuz && !spec.has_inf && magnitude == 0x7F) return kNan;
  if (spec.has_inf && (magnitude >> spec.mantissa_bits) == 31) {
    if ((magnitude & 3) != 0) return kNan;
    return negative ? -kInf : kInf;
  }
  const double value = field_magnitude(magnitude, spec);
  return negative ? -value : value;
}

inline double max_finite(Fp8Format format) {
  const FormatSpec spec = spec_of(format);
  return field_magnitude(spec.max_code, spec);
}

// Magnitudes of codes 0..max_code+1 in increasing order; the last entry is the first value
// past the maximum and stands for overflow, so max + half ulp ties like IEEE (to the even code).
inline const std::vector<double>& magnitude_grid(Fp8Format format) {
  static const std::array<std::vector<double>, 5> grids = [] {
    std::array<std::vector<double>, 5> result;
    for (Fp8Format f : kAllFormats) {
      const FormatSpec spec = spec_of(f);
      for (int code = 0; code <= spec.max_code + 1; ++code) {
        result[static_cast<size_t>(f)].push_back(field_magnitude(code, spec));
      }
    }
    return result;
  }();
  return grids[static_cast<size_t>(format)];
}

// Round to nearest, ties to the even code, by searching the list of representable magnitudes.
inline uint8_t reference_encode(double value, Fp8Format format, Saturation saturation) {
  const FormatSpec spec = spec_of(format);
  if (std::isnan(value)) return spec.nan_code;
  const bool negative = std::signbit(value);
  if (spec.exponent_only && negative && value != 0.0) return 0xFF;  // no negative scales
  const std::vector<double>& grid = magnitude_grid(format);
  const double magnitude = std::fabs(value);
  const auto above = std::lower_bound(grid.begin(), grid.end(), magnitude);
  size_t code = grid.size() - 1;  // past the end: overflow
  if (above != grid.end()) {
    code = static_cast<size_t>(above - grid.begin());
    if (code > 0 && *above != magnitude) {
      const double distance_down = magnitude - grid[code - 1];
      const double distance_up = *above - magnitude;
      if (distance_down < distance_up || (distance_down == distance_up && code % 2 == 1)) --code;
    }
  }
  const uint8_t sign = negative ? 0x80 : 0x00;
  if (code > spec.max_code) {
    if (saturation == Saturation::Saturate) {
      return spec.exponent_only ? spec.max_code : static_cast<uint8_t>(sign | spec.max_code);
    }
    return spec.has_inf ? static_cast<uint8_t>(sign | 0x7C) : spec.nan_code;
  }
  if (code == 0 && (spec.fnuz || spec.exponent_only)) return 0x00;  // no negative zero
  return static_cast<uint8_t>(sign | code);
}

// Half the spacing of the format's values at magnitude y: 2^(e - m - 1), where e is the
// exponent of y, floored at the smallest normal exponent (fixed spacing of the subnormals).
inline double half_ulp(Fp8Format format, double y) {
  const FormatSpec spec = spec_of(format);
  const int min_normal_exponent = 1 - spec.bias;
  const int exponent = y > 0.0 ? std::max(std::ilogb(y), min_normal_exponent) : min_normal_exponent;
  return std::ldexp(1.0, exponent - spec.mantissa_bits - 1);
}

// std::mt19937 seeded from std::random_device, or from FP8T_TEST_SEED to replay a failure.
// Tests pass trace() to SCOPED_TRACE so that every failure prints the seed.
class TestRng {
 public:
  TestRng() : seed_(initial_seed()), engine_(seed_) {}

  std::string trace() const { return "replay with FP8T_TEST_SEED=" + std::to_string(seed_); }
  std::mt19937& engine() { return engine_; }

  int uniform_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(engine_); }
  double uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(engine_);
  }
  bool chance(double probability) { return std::bernoulli_distribution(probability)(engine_); }
  uint32_t bits() { return static_cast<uint32_t>(engine_()); }
  // A float with random sign and mantissa and an exponent uniform in [lo, hi].
  float wide(int lo, int hi) {
    const double magnitude = std::ldexp(uniform(1.0, 2.0), uniform_int(lo, hi));
    return static_cast<float>(chance(0.5) ? -magnitude : magnitude);
  }

 private:
  static uint32_t initial_seed() {
    if (const char* text = std::getenv("FP8T_TEST_SEED")) {
      return static_cast<uint32_t>(std::strtoul(text, nullptr, 10));
    }
    return std::random_device{}();
  }

  uint32_t seed_;
  std::mt19937 engine_;
};

}  // namespace fp8t::test
