// The 8-bit floating-point formats: definitions, encoding from fp32/bf16 and decoding to fp32.
// One definition serves the CPU reference and CUDA kernels, so both round identically.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "core/host_device.h"
#include "numerics/float_bits.h"

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#endif

namespace fp8t {

enum class Fp8Format : uint8_t {
  E4M3,      // OCP "fn": bias 7, max 448, no inf, NaN s.1111.111
  E5M2,      // OCP: bias 15, max 57344, inf s.11111.00, NaN s.11111.{01,10,11}
  E4M3FNUZ,  // AMD gfx942: bias 8, max 240, no inf, NaN 0x80 only, no -0
  E5M2FNUZ,  // AMD gfx942: bias 16, max 57344, no inf, NaN 0x80 only, no -0
  E8M0,      // MX block scale: unsigned power of two 2^(code-127), NaN 0xFF, no zero
};

inline constexpr Fp8Format kAllFormats[] = {Fp8Format::E4M3, Fp8Format::E5M2, Fp8Format::E4M3FNUZ,
                                            Fp8Format::E5M2FNUZ, Fp8Format::E8M0};

// What to do with finite values beyond the largest finite code (and with infinities).
enum class Saturation : uint8_t {
  Saturate,     // clamp to +-max (CUDA's satfinite); what training casts use
  NonSaturate,  // overflow to inf (E5M2) or NaN (formats without inf)
};

struct FormatTraits {
  int exponent_bits;
  int mantissa_bits;
  int bias;
  bool fnuz;         // single NaN at 0x80, no negative zero, no inf
  bool has_inf;      // E5M2 only
  uint8_t max_code;  // magnitude code of the largest finite value
  uint8_t nan_code;  // the NaN this library produces
};

FP8T_HD constexpr FormatTraits format_traits(Fp8Format format) {
  switch (format) {
    case Fp8Format::E4M3:
      return {4, 3, 7, false, false, 0x7E, 0x7F};
    case Fp8Format::E5M2:
      return {5, 2, 15, false, true, 0x7B, 0x7F};
    case Fp8Format::E4M3FNUZ:
      return {4, 3, 8, true, false, 0x7F, 0x80};
    case Fp8Format::E5M2FNUZ:
      return {5, 2, 16, true, false, 0x7F, 0x80};
    case Fp8Format::E8M0:
      return {8, 0, 127, false, false, 0xFE, 0xFF};
  }
  return {0, 0, 0, false, false, 0, 0};
}

inline constexpr uint8_t kE5M2InfCode = 0x7C;

// Largest finite value: 448, 57344, 240, 57344, 2^127.
FP8T_HD inline float format_max(Fp8Format format);

// Decodes one code to fp32 (exact: every 8-bit value is an fp32).
FP8T_HD inline float decode(uint8_t code, Fp8Format format) {
  const FormatTraits t = format_traits(format);
  if (format == Fp8Format::E8M0) {
    return code == t.nan_code ? bits_to_float(0x7FC00000u) : exact_power_of_two(int(code) - 127);
  }
  const bool negative = (code & 0x80u) != 0;
  const uint32_t magnitude = code & 0x7Fu;
  if (t.fnuz) {
    if (code == t.nan_code) return bits_to_float(0x7FC00000u);
  } else {
    const uint32_t all_ones = (1u << t.exponent_bits) - 1u;
    const uint32_t exponent_field = magnitude >> t.mantissa_bits;
    const uint32_t mantissa_field = magnitude & ((1u << t.mantissa_bits) - 1u);
    if (t.has_inf && exponent_field == all_ones) {
      if (mantissa_field == 0) return bits_to_float(negative ? 0xFF800000u : 0x7F800000u);
      return bits_to_float(0x7FC00000u);
    }
    if (!t.has_inf && magnitude == 0x7Fu) return bits_to_float(0x7FC00000u);
  }
  const int exponent_field = int(magnitude >> t.mantissa_bits);
  const int mantissa_field = int(magnitude & ((1u << t.mantissa_bits) - 1u));
  // value = significand * 2^(exponent - mantissa_bits), with the implicit bit for normals.
  const int significand =
      exponent_field == 0 ? mantissa_field : mantissa_field + (1 << t.mantissa_bits);
  const int exponent = (exponent_field == 0 ? 1 : exponent_field) - t.bias - t.mantissa_bits;
  const float value = float(significand) * exact_power_of_two(exponent);
  return negative ? -value : value;
}

FP8T_HD inline float format_max(Fp8Format format) {
  return decode(format_traits(format).max_code, format);
}

namespace detail {

FP8T_HD inline uint8_t overflow_code(const FormatTraits& t, uint32_t sign, Saturation saturation) {
  if (saturation == Saturation::Saturate) return static_cast<uint8_t>((sign << 7) | t.max_code);
  if (t.has_inf) return static_cast<uint8_t>((sign << 7) | kE5M2InfCode);
  return t.nan_code;
}

// E8M0 holds positive powers of two only. Rounds to nearest in linear space with ties to the
// even code; below 2^-127 (zero included) clamps to the smallest code, since a scale cannot
// be zero; negative values and NaN have no code and give NaN.
FP8T_HD inline uint8_t encode_e8m0(float value, Saturation saturation) {
  const uint32_t bits = float_to_bits(value);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u || ((bits >> 31) != 0 && magnitude != 0)) return 0xFF;
  if (magnitude == 0x7F800000u) return saturation == Saturation::Saturate ? 0xFE : 0xFF;
  if (magnitude < 0x00400000u) return 0x00;  // below 2^-127
  int code;
  uint32_t fraction;              // 23 bits below the leading one
  if (magnitude < 0x00800000u) {  // fp32 subnormal in [2^-127, 2^-126)
    code = 0;
    fraction = (magnitude << 1) & 0x7FFFFFu;
  } else {
    code = int(magnitude >> 23);  // biased exponents of fp32 and E8M0 coincide
    fraction = magnitude & 0x7FFFFFu;
  }
  if (fraction > 0x400000u || (fraction == 0x400000u && (code & 1))) ++code;
  if (code > 0xFE) return saturation == Saturation::Saturate ? 0xFE : 0xFF;
  return static_cast<uint8_t>(code);
}

}  // namespace detail

// Round to nearest, ties to even, by integer arithmetic on the fp32 bits. This is the
// definition of every conversion in the project; hardware conversions are tested against it.
FP8T_HD inline uint8_t encode_reference(float value, Fp8Format format, Saturation saturation) {
  if (format == Fp8Format::E8M0) return detail::encode_e8m0(value, saturation);
  const FormatTraits t = format_traits(format);
  const uint32_t bits = float_to_bits(value);
  const uint32_t sign = bits >> 31;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return t.nan_code;
  if (magnitude == 0x7F800000u) return detail::overflow_code(t, sign, saturation);

  // value = significand * 2^(exponent - 23)
  const int biased = int(magnitude >> 23);
  const uint32_t significand =
      biased == 0 ? (magnitude & 0x7FFFFFu) : ((magnitude & 0x7FFFFFu) | 0x800000u);
  const int exponent = biased == 0 ? -126 : biased - 127;

  // The target grid spacing is 2^(max(exponent, min_normal) - mantissa_bits): a fixed spacing
  // in the subnormal range. Count grid steps, then round the dropped bits to nearest even.
  const int min_normal_exponent = 1 - t.bias;
  const bool normal = exponent >= min_normal_exponent;
  const int shift = (normal ? exponent : min_normal_exponent) - t.mantissa_bits - (exponent - 23);
  uint32_t code = 0;
  if (shift <= 24) {  // beyond 24 the value is below half the smallest step: rounds to zero
    // Normal: code = (exponent + bias - 1) * 2^m + steps, where steps includes the implicit
    // bit, so a carry out of the mantissa lands in the exponent field by itself.
    const uint32_t base = normal ? uint32_t(exponent + t.bias - 1) << t.mantissa_bits : 0u;
    const uint32_t dropped = significand & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    code = base + (significand >> shift);
    if (dropped > half || (dropped == half && (code & 1u))) ++code;
  }
  if (code > t.max_code) return detail::overflow_code(t, sign, saturation);
  if (code == 0 && t.fnuz) return 0x00;  // fnuz has no negative zero
  return static_cast<uint8_t>((sign << 7) | code);
}

// The conversion used by kernels: the hardware instruction where one exists (OCP formats,
// saturating, sm_89+), the reference otherwise. Tests require both to agree bit for bit.
FP8T_HD inline uint8_t encode(float value, Fp8Format format, Saturation saturation) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (saturation == Saturation::Saturate) {
    if (format == Fp8Format::E4M3) return __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3);
    if (format == Fp8Format::E5M2) return __nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E5M2);
  }
#endif
  return encode_reference(value, format, saturation);
}

FP8T_HD inline uint8_t encode(bf16 value, Fp8Format format, Saturation saturation) {
  return encode(bf16_to_float(value), format, saturation);  // bf16 -> fp32 is exact
}

// Which family of formats a platform uses, and the user's override.
enum class Fp8Family : uint8_t { Ocp, Fnuz };
enum class FamilySetting : uint8_t { Auto, Ocp, Fnuz };

// E4M3 or E4M3FNUZ; E5M2 or E5M2FNUZ.
Fp8Format e4m3_format(Fp8Family family);
Fp8Format e5m2_format(Fp8Family family);

// The family a device architecture uses: "cpu" and NVIDIA "sm_NN" -> OCP (GPUs before sm_89
// emulate FP8 in these formats); AMD "gfx950" -> OCP; "gfx942" -> fnuz. Throws ConfigError for
// any other AMD architecture: none has FP8 formats.
Fp8Family family_for_architecture(std::string_view architecture);
Fp8Family resolve_family(FamilySetting setting, std::string_view architecture);

std::string_view format_name(Fp8Format format);
std::optional<Fp8Format> parse_format(std::string_view name);
std::string_view family_name(Fp8Family family);

}  // namespace fp8t
