// GPU quantization kernels against the CPU reference: every byte and every scale must match.
// Inputs are fresh random draws (the seed is printed) with edge cases mixed in; outputs are
// poisoned before each launch so unwritten elements show.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "numerics/quantize.h"
#include "numerics/quantize_cuda.h"
#include "numerics/scaling.h"

namespace fp8t {
namespace {

constexpr Fp8Format kDataFormats[] = {Fp8Format::E4M3, Fp8Format::E5M2, Fp8Format::E4M3FNUZ,
                                      Fp8Format::E5M2FNUZ};

std::mt19937& rng() {
  static std::mt19937 generator = [] {
    const unsigned seed = std::random_device{}();
    std::printf("[ seed     ] %u\n", seed);
    return std::mt19937(seed);
  }();
  return generator;
}

// Values whose rounding is hard: every code's value and the midpoints between neighbours
// (ties), their float neighbours, the overflow threshold region, infinities, NaN, fp32
// subnormals and zeros of both signs.
std::vector<float> edge_values() {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN(),
                               -std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::denorm_min(),
                               std::numeric_limits<float>::min(),
                               std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::max()};
  for (Fp8Format format : kAllFormats) {
    std::vector<float> codes;
    for (int code = 0; code < 256; ++code) {
      const float value = decode(static_cast<uint8_t>(code), format);
      if (!std::isnan(value) && !std::isinf(value)) codes.push_back(value);
    }
    std::sort(codes.begin(), codes.end());
    for (size_t i = 0; i < codes.size(); ++i) {
      const float value = codes[i];
      for (float candidate :
           {value, std::nextafter(value, INFINITY), std::nextafter(value, -INFINITY)}) {
        values.push_back(candidate);
      }
      if (i + 1 < codes.size()) {
        const float midpoint = static_cast<float>((double(codes[i]) + double(codes[i + 1])) / 2);
        for (float candidate :
             {midpoint, std::nextafter(midpoint, INFINITY), std::nextafter(midpoint, -INFINITY)}) {
          values.push_back(candidate);
        }
      }
    }
    const float top = format_max(format);
    for (float factor : {1.0312f, 1.0625f, 1.07f, 1.125f, 2.0f})
      values.push_back(top * factor);
  }
  return values;
}

// Random values over the whole fp32 range: random bit patterns (NaN, inf and subnormals
// included) and normal draws at random magnitudes, with the edge values mixed in.
std::vector<float> random_floats(size_t count, bool with_specials) {
  std::vector<float> values(count);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> exponent(-30, 20);
  for (size_t i = 0; i < count; ++i) {
    float value = with_specials && (i % 3 == 0) ? bits_to_float(bits(rng()))
                                                : std::ldexp(normal(rng()), exponent(rng()));
    if (!with_specials && !std::isfinite(value)) value = 1.0f;
    values[i] = value;
  }
  if (with_specials) {
    const std::vector<float> edges = edge_values();
    for (size_t i = 0; i < edges.size() && i * 7 < count; ++i)
      values[i * 7] = edges[i];
  }
  return values;
}

template <typename T>
T from_float(float value) {
  if constexpr (std::is_same_v<T, float>) {
    return value;
  } else {
    return float_to_bf16(value);
  }
}

template <typename T>
std::vector<T> random_tensor(size_t count, bool with_specials) {
  const std::vector<float> values = random_floats(count, with_specials);
  std::vector<T> converted(count);
  for (size_t i = 0; i < count; ++i)
    converted[i] = from_float<T>(values[i]);
  return converted;
}

// Index of the first difference, or -1. Everything compares by bits, except that any two fp32
// NaNs are equal: fp32 arithmetic on NaN keeps the payload on x86 and gives the canonical NaN
// on the GPU. FP8 codes and scales must match exactly.
template <typename T>
int64_t first_mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if constexpr (std::is_same_v<T, float>) {
      if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    }
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  }
  return -1;
}

#define EXPECT_IDENTICAL(gpu, cpu, what)                                             \
  do {                                                                               \
    const int64_t mismatch_ = first_mismatch(gpu, cpu);                              \
    EXPECT_EQ(mismatch_, -1) << what << ": first difference at index " << mismatch_; \
  } while (false)

TEST(CudaEncode, MatchesReferenceOnRandomAndEdgeInputs) {
  const std::vector<float> x = random_floats(size_t{4} << 20, /*with_specials=*/true);
  DeviceBuffer<float> device_x(x);
  DeviceBuffer<uint8_t> device_out(x.size());
  for (Fp8Format format : kAllFormats) {
    for (Saturation saturation : {Saturation::Saturate, Saturation::NonSaturate}) {
      device_out.poison();
      cuda::encode(device_x.get(), static_cast<int64_t>(x.size()), format, saturation,
                   device_out.get(), nullptr);
      const std::vector<uint8_t> gpu = device_out.download();
      int64_t mismatches = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        const uint8_t expected = encode_reference(x[i], format, saturation);
        if (gpu[i] != expected && ++mismatches <= 5) {
          ADD_FAILURE() << format_name(format)
                        << (saturation == Saturation::Saturate ? " sat" : " nonsat")
                        << ": x=" << x[i] << " (bits 0x" << std::hex << float_to_bits(x[i])
                        << ") gpu=0x" << int(gpu[i]) << " cpu=0x" << int(expected) << std::dec;
        }
      }
      EXPECT_EQ(mismatches, 0) << format_name(format);
    }
  }
}

TEST(CudaEncode, EveryBf16MatchesReference) {
  std::vector<float> x(65536);
  for (uint32_t bits = 0; bits < 65536; ++bits)
    x[bits] = bf16_to_float(bf16{static_cast<uint16_t>(bits)});
  DeviceBuffer<float> device_x(x);
  DeviceBuffer<uint8_t> device_out(x.size());
  for (Fp8Format format : kAllFormats) {
    device_out.poison();
    cuda::encode(device_x.get(), 65536, format, Saturation::Saturate, device_out.get(), nullptr);
    std::vector<uint8_t> cpu(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      cpu[i] = encode_reference(x[i], format, Saturation::Saturate);
    EXPECT_IDENTICAL(device_out.download(), cpu, format_name(format));
  }
}

TEST(CudaDecode, EveryCodeMatchesReference) {
  std::vector<uint8_t> codes(256);
  for (int i = 0; i < 256; ++i)
    codes[i] = static_cast<uint8_t>(i);
  DeviceBuffer<uint8_t> device_codes(codes);
  DeviceBuffer<float> device_out(256);
  for (Fp8Format format : kAllFormats) {
    device_out.poison();
    cuda::decode(device_codes.get(), 256, format, device_out.get(), nullptr);
    std::vector<float> cpu(256);
    for (int i = 0; i < 256; ++i)
      cpu[i] = decode(static_cast<uint8_t>(i), format);
    EXPECT_IDENTICAL(device_out.download(), cpu, format_name(format));
  }
}

template <typename T>
class CudaQuantize : public ::testing::Test {};
using InputTypes = ::testing::Types<float, bf16>;
TYPED_TEST_SUITE(CudaQuantize, InputTypes);

TYPED_TEST(CudaQuantize, AmaxMatchesReferenceAndAccumulates) {
  for (size_t count : {size_t{1}, size_t{7}, size_t{4099}, size_t{3} << 20}) {
    for (bool with_specials : {false, true}) {
      const std::vector<TypeParam> x = random_tensor<TypeParam>(count, with_specials);
      DeviceBuffer<TypeParam> device_x(x);
      // Offset by one element: the kernel must handle a pointer that is not 16-byte aligned.
      for (size_t offset : {size_t{0}, size_t{1}}) {
        if (offset >= count) continue;
        DeviceBuffer<float> device_amax(std::vector<float>{0.0f});
        const int64_t n = static_cast<int64_t>(count - offset);
        cuda::amax(device_x.get() + offset, n, device_amax.get(), nullptr);
        const float expected = amax(x.data() + offset, n);
        EXPECT_IDENTICAL(device_amax.download(), std::vector<float>{expected},
                         "amax, count " << count);
      }
    }
  }
  // Accumulation across calls (micro-batches): the larger amax wins, NaN sticks.
  DeviceBuffer<TypeParam> small(
      std::vector<TypeParam>{from_float<TypeParam>(2.0f), from_float<TypeParam>(-3.0f)});
  DeviceBuffer<TypeParam> large(std::vector<TypeParam>{from_float<TypeParam>(-96.0f)});
  DeviceBuffer<TypeParam> nan(std::vector<TypeParam>{from_float<TypeParam>(std::nanf(""))});
  DeviceBuffer<float> device_amax(std::vector<float>{0.0f});
  cuda::amax(small.get(), 2, device_amax.get(), nullptr);
  EXPECT_EQ(device_amax.download()[0], 3.0f);
  cuda::amax(large.get(), 1, device_amax.get(), nullptr);
  cuda::amax(small.get(), 2, device_amax.get(), nullptr);
  EXPECT_EQ(device_amax.download()[0], 96.0f);
  cuda::amax(nan.get(), 1, device_amax.get(), nullptr);
  cuda::amax(large.get(), 1, device_amax.get(), nullptr);
  EXPECT_TRUE(std::isnan(device_amax.download()[0]));
}

TEST(CudaScale, ScaleFromAmaxMatchesReference) {
  const std::vector<float> amaxes = {
      0.0f,         1.0f,   3.0f,  1e-30f,
      1e-42f,       448.0f, 1e30f, std::numeric_limits<float>::infinity(),
      std::nanf("")};
  for (Fp8Format format : kDataFormats) {
    for (bool power_of_2 : {false, true}) {
      for (float epsilon : {0.0f, 1e-12f}) {
        for (float amax_value : amaxes) {
          DeviceBuffer<float> device_amax(std::vector<float>{amax_value});
          DeviceBuffer<float> scale(1), scale_inv(1);
          cuda::scale_from_amax(device_amax.get(), format_max(format), power_of_2, epsilon,
                                scale.get(), scale_inv.get(), nullptr);
          const float expected =
              fp8t::scale_from_amax(amax_value, format_max(format), power_of_2, epsilon);
          EXPECT_IDENTICAL(scale.download(), std::vector<float>{expected}, "amax " << amax_value);
          EXPECT_IDENTICAL(scale_inv.download(), std::vector<float>{1.0f / expected},
                           "amax " << amax_value);
        }
      }
    }
  }
}

// Random scale in the range training produces, from the data's own amax.
template <typename T>
float realistic_scale(const std::vector<T>& x, Fp8Format format) {
  return fp8t::scale_from_amax(amax(x.data(), static_cast<int64_t>(x.size())), format_max(format),
                               false, 0.0f);
}

TYPED_TEST(CudaQuantize, CastAmaxMatchesReference) {
  for (size_t count : {size_t{1}, size_t{9}, size_t{4096 + 3}, size_t{1} << 21}) {
    for (bool with_specials : {false, true}) {
      const std::vector<TypeParam> x = random_tensor<TypeParam>(count, with_specials);
      DeviceBuffer<TypeParam> device_x(x);
      for (Fp8Format format : kDataFormats) {
        for (size_t offset : {size_t{0}, size_t{1}}) {
          if (offset >= count) continue;
          const int64_t n = static_cast<int64_t>(count - offset);
          const float scale = with_specials ? 0.75f : realistic_scale(x, format);
          DeviceBuffer<float> device_scale(std::vector<float>{scale});
          DeviceBuffer<float> device_amax(std::vector<float>{0.0f});
          DeviceBuffer<uint8_t> out(static_cast<size_t>(n));
          cuda::quantize(device_x.get() + offset, n, device_scale.get(), format, out.get(),
                         device_amax.get(), nullptr);
          std::vector<uint8_t> expected(static_cast<size_t>(n));
          float expected_amax = 0.0f;
          quantize(x.data() + offset, n, scale, format, expected.data(), &expected_amax);
          EXPECT_IDENTICAL(out.download(), expected, format_name(format) << " count " << n);
          EXPECT_IDENTICAL(device_amax.download(), std::vector<float>{expected_amax},
                           "amax count " << n);
        }
      }
    }
  }
}

struct Shape {
  int64_t rows;
  int64_t cols;
};
constexpr Shape kAwkwardShapes[] = {{1, 16},    {5, 160},    {217, 256},  {64, 64},
                                    {100, 33},  {1, 1},      {130, 129},  {128, 256},
                                    {256, 384}, {1024, 768}, {2048, 1536}};

TYPED_TEST(CudaQuantize, CastTransposeAmaxMatchesReference) {
  for (const Shape shape : kAwkwardShapes) {
    const size_t count = static_cast<size_t>(shape.rows * shape.cols);
    for (bool with_specials : {false, true}) {
      const std::vector<TypeParam> x = random_tensor<TypeParam>(count, with_specials);
      DeviceBuffer<TypeParam> device_x(x);
      for (Fp8Format format : kDataFormats) {
        const float scale = with_specials ? 1.5f : realistic_scale(x, format);
        DeviceBuffer<float> device_scale(std::vector<float>{scale});
        DeviceBuffer<float> device_amax(std::vector<float>{0.0f});
        DeviceBuffer<uint8_t> out(count), out_t(count);
        cuda::quantize_transpose(device_x.get(), shape.rows, shape.cols, device_scale.get(), format,
                                 out.get(), out_t.get(), device_amax.get(), nullptr);
        std::vector<uint8_t> expected(count), expected_t(count);
        float expected_amax = 0.0f;
        quantize_transpose(x.data(), shape.rows, shape.cols, scale, format, expected.data(),
                           expected_t.data(), &expected_amax);
        const auto where = ::testing::Message() << format_name(format) << " [" << shape.rows << ", "
                                                << shape.cols << "]";
        EXPECT_IDENTICAL(out.download(), expected, where);
        EXPECT_IDENTICAL(out_t.download(), expected_t, where << " transposed");
        EXPECT_IDENTICAL(device_amax.download(), std::vector<float>{expected_amax},
                         where << " amax");
      }
    }
  }
}

// The device's CastHealth counts equal the CPU's.
void expect_health(const DeviceBuffer<CastHealth>& health, const CastHealth& expected,
                   const std::string& where) {
  const CastHealth got = health.download()[0];
  EXPECT_EQ(got.saturated, expected.saturated) << where << " saturated";
  EXPECT_EQ(got.underflow, expected.underflow) << where << " underflow";
}

// Saturation and underflow counted by the cast kernels, on the vector and scalar paths and on
// full and edge tiles: a scale 16 times the amax's saturates the largest values, and the random
// magnitudes (2^-30 to 2^20) underflow the smallest.
TYPED_TEST(CudaQuantize, CastHealthCountsMatchTheCpu) {
  for (const Shape shape : kAwkwardShapes) {
    const size_t count = static_cast<size_t>(shape.rows * shape.cols);
    const auto n = static_cast<int64_t>(count);
    const std::vector<TypeParam> x = random_tensor<TypeParam>(count, true);
    DeviceBuffer<TypeParam> device_x(x);
    for (Fp8Format format : kDataFormats) {
      const float scale = 16.0f * realistic_scale(x, format);
      const auto where = ::testing::Message()
                         << format_name(format) << " [" << shape.rows << ", " << shape.cols << "]";
      std::vector<uint8_t> expected(count), expected_t(count);
      CastHealth expected_health;
      quantize_transpose(x.data(), shape.rows, shape.cols, scale, format, expected.data(),
                         expected_t.data(), nullptr, &expected_health);
      if (count >= 4096) {  // the test must see both kinds
        EXPECT_GT(expected_health.saturated, 0u) << where;
        EXPECT_GT(expected_health.underflow, 0u) << where;
      }
      DeviceBuffer<float> device_scale(std::vector<float>{scale});
      DeviceBuffer<uint8_t> out(count), out_t(count);
      DeviceBuffer<CastHealth> health(std::vector<CastHealth>(1));
      cuda::quantize(device_x.get(), n, device_scale.get(), format, out.get(), nullptr, nullptr,
                     cuda::CastInput::Value, nullptr, health.get());
      EXPECT_IDENTICAL(out.download(), expected, where << " cast");
      expect_health(health, expected_health, ::testing::Message(where).GetString() + " cast");
      DeviceBuffer<CastHealth> transposed_health(std::vector<CastHealth>(1));
      cuda::quantize_transpose(device_x.get(), shape.rows, shape.cols, device_scale.get(), format,
                               out.get(), out_t.get(), nullptr, nullptr, cuda::CastInput::Value,
                               nullptr, transposed_health.get());
      EXPECT_IDENTICAL(out_t.download(), expected_t, where << " transposed");
      expect_health(transposed_health, expected_health,
                    ::testing::Message(where).GetString() + " cast + transpose");
      // A second cast adds to the counts.
      cuda::quantize(device_x.get(), n, device_scale.get(), format, out.get(), nullptr, nullptr,
                     cuda::CastInput::Value, nullptr, health.get());
      CastHealth twice = expected_health;
      twice.saturated *= 2;
      twice.underflow *= 2;
      expect_health(health, twice, ::testing::Message(where).GetString() + " cast, twice");
    }
  }
}

// A cast of `input` from x (and relu2_input, for Relu2Gradient) on the device against the CPU's
// cast of what it reads, act [rows, cols]: the bytes and the amax of amax(), quantize() and
// quantize_transpose(), with and without the row-major copy.
void expect_cast_input_matches(cuda::CastInput input, Shape shape, const DeviceBuffer<bf16>& x,
                               const bf16* relu2_input, const std::vector<bf16>& act,
                               bool with_specials) {
  const size_t count = act.size();
  const auto n = static_cast<int64_t>(count);
  for (Fp8Format format : kDataFormats) {
    const float scale = with_specials ? 1.5f : realistic_scale(act, format);
    const auto where = ::testing::Message()
                       << format_name(format) << " [" << shape.rows << ", " << shape.cols << "]";
    float expected_amax = 0.0f;
    std::vector<uint8_t> expected(count), expected_t(count);
    quantize_transpose(act.data(), shape.rows, shape.cols, scale, format, expected.data(),
                       expected_t.data(), &expected_amax);

    DeviceBuffer<float> device_amax(std::vector<float>{0.0f});
    cuda::amax(x.get(), n, device_amax.get(), nullptr, input, relu2_input);
    EXPECT_IDENTICAL(device_amax.download(), std::vector<float>{expected_amax}, where << " amax");

    CastHealth expected_health;
    quantize(act.data(), n, scale, format, expected.data(), nullptr, &expected_health);

    DeviceBuffer<float> device_scale(std::vector<float>{scale});
    DeviceBuffer<float> cast_amax(std::vector<float>{0.0f});
    DeviceBuffer<uint8_t> out(count), out_t(count);
    DeviceBuffer<CastHealth> health(std::vector<CastHealth>(1));
    cuda::quantize(x.get(), n, device_scale.get(), format, out.get(), cast_amax.get(), nullptr,
                   input, relu2_input, health.get());
    EXPECT_IDENTICAL(out.download(), expected, where << " cast");
    EXPECT_IDENTICAL(cast_amax.download(), std::vector<float>{expected_amax},
                     where << " cast amax");
    expect_health(health, expected_health, ::testing::Message(where).GetString() + " cast");

    DeviceBuffer<uint8_t> both(count), both_t(count);
    DeviceBuffer<CastHealth> both_health(std::vector<CastHealth>(1));
    cuda::quantize_transpose(x.get(), shape.rows, shape.cols, device_scale.get(), format,
                             both.get(), both_t.get(), nullptr, nullptr, input, relu2_input,
                             both_health.get());
    EXPECT_IDENTICAL(both.download(), expected, where << " cast + transpose");
    EXPECT_IDENTICAL(both_t.download(), expected_t, where << " cast + transpose, transposed");
    expect_health(both_health, expected_health,
                  ::testing::Message(where).GetString() + " cast + transpose");
    cuda::quantize_transpose(x.get(), shape.rows, shape.cols, device_scale.get(), format, nullptr,
                             out_t.get(), nullptr, nullptr, input, relu2_input);
    EXPECT_IDENTICAL(out_t.download(), expected_t, where << " transposed alone");
  }
}

// relu² casts (CastInput::Relu2) must give the bytes and amax of relu(x)², rounded to bf16 as
// the GPT's relu2_forward stores it, cast as usual; the transposed copy also alone.
TEST(CudaQuantize, Relu2CastsMatchCastOfTheActivation) {
  for (const Shape shape : kAwkwardShapes) {
    const size_t count = static_cast<size_t>(shape.rows * shape.cols);
    for (bool with_specials : {false, true}) {
      const std::vector<bf16> x = random_tensor<bf16>(count, with_specials);
      std::vector<bf16> act(count);
      for (size_t i = 0; i < count; ++i) {
        const float value = bf16_to_float(x[i]);
        const float positive = value > 0.0f ? value : 0.0f;  // NaN -> 0
        act[i] = float_to_bf16(positive * positive);
      }
      expect_cast_input_matches(cuda::CastInput::Relu2, shape, DeviceBuffer<bf16>(x), nullptr, act,
                                with_specials);
    }
  }
}

// relu² gradient casts (CastInput::Relu2Gradient) must give the bytes and amax of 2·relu(p)·x,
// rounded to bf16 as relu2_backward stores it, cast as usual; a missing or a stray relu²
// input is an error.
TEST(CudaQuantize, Relu2GradientCastsMatchCastOfTheGradient) {
  for (const Shape shape : kAwkwardShapes) {
    const size_t count = static_cast<size_t>(shape.rows * shape.cols);
    for (bool with_specials : {false, true}) {
      const std::vector<bf16> dy = random_tensor<bf16>(count, with_specials);
      const std::vector<bf16> p = random_tensor<bf16>(count, with_specials);
      std::vector<bf16> gradient(count);
      for (size_t i = 0; i < count; ++i) {
        const float input = bf16_to_float(p[i]);  // NaN -> 0, as relu2_backward
        gradient[i] = float_to_bf16(input > 0.0f ? 2.0f * input * bf16_to_float(dy[i]) : 0.0f);
      }
      const DeviceBuffer<bf16> device_p(p);
      expect_cast_input_matches(cuda::CastInput::Relu2Gradient, shape, DeviceBuffer<bf16>(dy),
                                device_p.get(), gradient, with_specials);
    }
  }
  const DeviceBuffer<bf16> x(std::vector<bf16>(64));
  DeviceBuffer<float> amax(std::vector<float>{0.0f});
  EXPECT_THROW(cuda::amax(x.get(), 64, amax.get(), nullptr, cuda::CastInput::Relu2Gradient), Error);
  EXPECT_THROW(cuda::amax(x.get(), 64, amax.get(), nullptr, cuda::CastInput::Value, x.get()),
               Error);
}

TEST(CudaQuantize, TensorwiseOnDeviceMatchesReference) {
  // The current-scaling sequence as training runs it: amax pass, scale on device, cast.
  const std::vector<bf16> x = random_tensor<bf16>(size_t{1} << 20, false);
  DeviceBuffer<bf16> device_x(x);
  for (Fp8Format format : kDataFormats) {
    DeviceBuffer<float> device_amax(std::vector<float>{0.0f});
    DeviceBuffer<float> scale(1), scale_inv(1);
    DeviceBuffer<uint8_t> out(x.size());
    DeviceBuffer<float> restored(x.size());
    const int64_t n = static_cast<int64_t>(x.size());
    cuda::amax(device_x.get(), n, device_amax.get(), nullptr);
    cuda::scale_from_amax(device_amax.get(), format_max(format), true, 0.0f, scale.get(),
                          scale_inv.get(), nullptr);
    cuda::quantize(device_x.get(), n, scale.get(), format, out.get(), nullptr, nullptr);
    cuda::dequantize(out.get(), n, scale_inv.get(), format, restored.get(), nullptr);

    const float expected_scale =
        fp8t::scale_from_amax(amax(x.data(), n), format_max(format), true, 0.0f);
    std::vector<uint8_t> expected(x.size());
    quantize(x.data(), n, expected_scale, format, expected.data(), nullptr);
    std::vector<float> expected_restored(x.size());
    dequantize(expected.data(), n, 1.0f / expected_scale, format, expected_restored.data());
    EXPECT_IDENTICAL(out.download(), expected, format_name(format));
    EXPECT_IDENTICAL(restored.download(), expected_restored, format_name(format) << " dequantized");
  }
}

// Every code, at lengths around the eight-code vector path and from unaligned addresses (its
// tail and its byte-at-a-time fallback), to fp32 and to bf16, with a scale that is no power of
// two: the CPU's decode times scale_inv, rounded to bf16 for bf16.
TEST(CudaQuantize, DequantizeEveryCodeAtAnyLengthAndAlignment) {
  std::vector<uint8_t> codes;
  for (int repeat = 0; repeat < 3; ++repeat) {
    for (int code = 0; code < 256; ++code)
      codes.push_back(static_cast<uint8_t>(code));
  }
  const float scale_inv = 0.3f;
  DeviceBuffer<float> device_scale_inv(std::vector<float>{scale_inv});
  DeviceBuffer<uint8_t> device_codes(codes);
  for (Fp8Format format : kDataFormats) {
    for (const int64_t offset : {0, 1, 8}) {
      for (const int64_t count : {int64_t{5}, int64_t{8}, int64_t{700}, int64_t{759}}) {
        std::vector<float> expected(static_cast<size_t>(count));
        dequantize(codes.data() + offset, count, scale_inv, format, expected.data());
        DeviceBuffer<float> restored(static_cast<size_t>(count + offset));
        DeviceBuffer<bf16> restored_bf16(static_cast<size_t>(count + offset));
        restored.poison();
        restored_bf16.poison();
        cuda::dequantize(device_codes.get() + offset, count, device_scale_inv.get(), format,
                         restored.get() + offset, nullptr);
        cuda::dequantize(device_codes.get() + offset, count, device_scale_inv.get(), format,
                         restored_bf16.get() + offset, nullptr);
        const std::vector<float> got = restored.download();
        const std::vector<bf16> got_bf16 = restored_bf16.download();
        std::vector<float> got_tail(got.begin() + offset, got.end());
        std::vector<float> got_bf16_tail, expected_bf16;
        for (int64_t i = 0; i < count; ++i) {
          got_bf16_tail.push_back(bf16_to_float(got_bf16[size_t(offset + i)]));
          expected_bf16.push_back(bf16_to_float(float_to_bf16(expected[size_t(i)])));
        }
        const std::string where =
            fmt::format("{} offset {} count {}", format_name(format), offset, count);
        EXPECT_IDENTICAL(got_tail, expected, where);
        EXPECT_IDENTICAL(got_bf16_tail, expected_bf16, where << " to bf16");
      }
    }
  }
}

constexpr BlockScaling kBlockScalings[] = {BlockScaling::Rows1x128, BlockScaling::Tile128x128,
                                           BlockScaling::Mx1x32};

std::string scaling_name(BlockScaling scaling) {
  const BlockShape block = block_shape(scaling);
  return std::to_string(block.rows) + "x" + std::to_string(block.cols);
}

// Scale storage: fp32 for blockwise, one E8M0 byte for MX.
struct ScaleBuffers {
  ScaleBuffers(BlockScaling scaling, int64_t rows, int64_t cols) {
    const BlockShape grid = scale_grid(scaling, rows, cols);
    count = static_cast<size_t>(grid.rows) * static_cast<size_t>(grid.cols);
    bytes = count * (scaling == BlockScaling::Mx1x32 ? 1 : sizeof(float));
  }
  size_t count;
  size_t bytes;
};

TYPED_TEST(CudaQuantize, BlockScalingsMatchReference) {
  for (BlockScaling scaling : kBlockScalings) {
    for (const Shape shape : kAwkwardShapes) {
      const size_t count = static_cast<size_t>(shape.rows * shape.cols);
      for (bool with_specials : {false, true}) {
        const std::vector<TypeParam> x = random_tensor<TypeParam>(count, with_specials);
        DeviceBuffer<TypeParam> device_x(x);
        for (Fp8Format format : kDataFormats) {
          for (bool power_of_2 : {false, true}) {
            if (scaling == BlockScaling::Mx1x32 && !power_of_2) continue;
            const BlockQuantization spec{scaling, format, power_of_2, 0.0f};
            const ScaleBuffers grid(scaling, shape.rows, shape.cols);
            const ScaleBuffers grid_t(scaling, shape.cols, shape.rows);
            DeviceBuffer<uint8_t> out(count), out_t(count), scales(grid.bytes),
                scales_t(grid_t.bytes);
            DeviceBuffer<float> restored(count);
            cuda::quantize_blocks(device_x.get(), shape.rows, shape.cols, spec, out.get(),
                                  scales.get(), out_t.get(), scales_t.get(), nullptr);
            cuda::dequantize_blocks(out.get(), shape.rows, shape.cols, spec, scales.get(),
                                    restored.get(), nullptr);

            std::vector<uint8_t> expected(count), expected_t(count), expected_scales(grid.bytes),
                expected_scales_t(grid_t.bytes);
            quantize_transpose_blocks(x.data(), shape.rows, shape.cols, spec, expected.data(),
                                      expected_scales.data(), expected_t.data(),
                                      expected_scales_t.data());
            std::vector<float> expected_restored(count);
            dequantize_blocks(expected.data(), shape.rows, shape.cols, spec, expected_scales.data(),
                              expected_restored.data());
            const auto where = ::testing::Message()
                               << scaling_name(scaling) << " " << format_name(format)
                               << (power_of_2 ? " pow2" : "") << " [" << shape.rows << ", "
                               << shape.cols << "]";
            EXPECT_IDENTICAL(out.download(), expected, where);
            EXPECT_IDENTICAL(scales.download(), expected_scales, where << " scales");
            EXPECT_IDENTICAL(out_t.download(), expected_t, where << " transposed");
            EXPECT_IDENTICAL(scales_t.download(), expected_scales_t, where << " transposed scales");
            EXPECT_IDENTICAL(restored.download(), expected_restored, where << " dequantized");

            // The bf16 dequantization (the emulated MXFP8 GEMMs' operands): the fp32 value
            // rounded once; exact for E8M0 scales.
            DeviceBuffer<bf16> restored_bf16(count);
            cuda::dequantize_blocks(out.get(), shape.rows, shape.cols, spec, scales.get(),
                                    restored_bf16.get(), nullptr);
            // Compared as floats (bf16 widens exactly) so that any two NaNs are equal.
            std::vector<float> got_bf16, want_bf16;
            int64_t inexact = 0;
            for (size_t i = 0; i < count; ++i) {
              const float value = expected_restored[i];
              want_bf16.push_back(bf16_to_float(float_to_bf16(value)));
              if (!std::isnan(value) && want_bf16.back() != value) ++inexact;
            }
            for (const bf16 value : restored_bf16.download())
              got_bf16.push_back(bf16_to_float(value));
            EXPECT_IDENTICAL(got_bf16, want_bf16, where << " dequantized to bf16");
            if (scaling == BlockScaling::Mx1x32) EXPECT_EQ(inexact, 0) << where;
          }
        }
      }
    }
  }
}

// Full tiles, edge tiles and one random shape.
std::vector<Shape> block_cast_shapes() {
  std::vector<Shape> shapes = {{256, 384}, {130, 129}, {5, 160}, {1, 16}};
  std::uniform_int_distribution<int64_t> extent(1, 600);
  shapes.push_back({extent(rng()), extent(rng())});
  return shapes;
}

// A tensor of several waves of block casts on this GPU: at least twelve 128x128 tiles per SM,
// with edge tiles of 80 rows (transposed stores still 16 bytes wide) and 40 columns.
Shape many_waves_shape() {
  const auto tiles_per_side =
      static_cast<int64_t>(std::ceil(std::sqrt(12.0 * multiprocessor_count())));
  return {tiles_per_side * 128 + 80, tiles_per_side * 128 + 40};
}

// The CPU's codes and scales of both orientations, and the counts of the row-wise codes.
struct BlockReference {
  std::vector<uint8_t> codes, codes_t, scales, scales_t;
  CastHealth health;

  template <typename T>
  BlockReference(const std::vector<T>& x, Shape shape, const BlockQuantization& spec)
      : codes(x.size()),
        codes_t(x.size()),
        scales(ScaleBuffers(spec.scaling, shape.rows, shape.cols).bytes),
        scales_t(ScaleBuffers(spec.scaling, shape.cols, shape.rows).bytes) {
    quantize_transpose_blocks(x.data(), shape.rows, shape.cols, spec, codes.data(), scales.data(),
                              codes_t.data(), scales_t.data(), &health);
  }

  // The GPU's cast of both orientations, with its counts, equals this reference.
  void expect_matched_by(const DeviceBuffer<uint8_t>& out, const DeviceBuffer<uint8_t>& out_scales,
                         const DeviceBuffer<uint8_t>& out_t,
                         const DeviceBuffer<uint8_t>& out_scales_t,
                         const DeviceBuffer<CastHealth>& out_health,
                         const ::testing::Message& where) const {
    EXPECT_IDENTICAL(out.download(), codes, where);
    EXPECT_IDENTICAL(out_scales.download(), scales, where << " scales");
    EXPECT_IDENTICAL(out_t.download(), codes_t, where << " transposed");
    EXPECT_IDENTICAL(out_scales_t.download(), scales_t, where << " transposed scales");
    const std::vector<CastHealth> got_health = out_health.download();
    EXPECT_EQ(got_health[0].saturated, health.saturated) << where;
    EXPECT_EQ(got_health[0].underflow, health.underflow) << where;
  }
};

// Either orientation alone (the other's pointers null): the codes and scales of that
// orientation, as when both are cast, and nothing written past them.
TYPED_TEST(CudaQuantize, BlockScalingOfOneOrientationMatchesReference) {
  std::vector<Shape> shapes = block_cast_shapes();
  shapes.push_back({300, 1000});
  for (const Shape shape : shapes) {
    const size_t count = static_cast<size_t>(shape.rows * shape.cols);
    const std::vector<TypeParam> x = random_tensor<TypeParam>(count, true);
    DeviceBuffer<TypeParam> device_x(x);
    for (BlockScaling scaling : kBlockScalings) {
      const BlockQuantization spec{scaling, Fp8Format::E4M3, true, 0.0f};
      const BlockReference expected(x, shape, spec);
      const auto where = ::testing::Message() << scaling_name(scaling) << " [" << shape.rows << ", "
                                              << shape.cols << "]";
      for (bool transposed : {false, true}) {
        std::vector<uint8_t> want_codes = transposed ? expected.codes_t : expected.codes;
        std::vector<uint8_t> want_scales = transposed ? expected.scales_t : expected.scales;
        DeviceBuffer<uint8_t> codes(std::vector<uint8_t>(count + 16, 0xA5)),
            scales(std::vector<uint8_t>(want_scales.size() + 16, 0xA5));
        uint8_t* out = transposed ? nullptr : codes.get();
        uint8_t* out_t = transposed ? codes.get() : nullptr;
        cuda::quantize_blocks(device_x.get(), shape.rows, shape.cols, spec, out,
                              transposed ? nullptr : scales.get(), out_t,
                              transposed ? scales.get() : nullptr, nullptr);
        want_codes.resize(want_codes.size() + 16, 0xA5);
        want_scales.resize(want_scales.size() + 16, 0xA5);
        EXPECT_IDENTICAL(codes.download(), want_codes, where << (transposed ? " transposed" : ""));
        EXPECT_IDENTICAL(scales.download(), want_scales,
                         where << (transposed ? " transposed" : "") << " scales");
      }
    }
  }
}

// Block-major 1x128 scales are the transposes of the reference's grids, both orientations;
// the codes do not change.
TYPED_TEST(CudaQuantize, BlockMajorScalesAreTheGridsTransposed) {
  for (const Shape shape : block_cast_shapes()) {
    const size_t count = static_cast<size_t>(shape.rows * shape.cols);
    const std::vector<TypeParam> x = random_tensor<TypeParam>(count, false);
    DeviceBuffer<TypeParam> device_x(x);
    const BlockQuantization spec{BlockScaling::Rows1x128, Fp8Format::E4M3, false, 0.0f};
    const BlockShape grid = scale_grid(spec.scaling, shape.rows, shape.cols);
    const BlockShape grid_t = scale_grid(spec.scaling, shape.cols, shape.rows);
    const auto grid_count = static_cast<size_t>(grid.rows) * static_cast<size_t>(grid.cols);
    const auto grid_t_count = static_cast<size_t>(grid_t.rows) * static_cast<size_t>(grid_t.cols);
    DeviceBuffer<uint8_t> out(count), out_t(count);
    DeviceBuffer<float> scales(std::vector<float>(grid_count, -1.0f)),
        scales_t(std::vector<float>(grid_t_count, -1.0f));
    cuda::quantize_blocks(device_x.get(), shape.rows, shape.cols, spec, out.get(), scales.get(),
                          out_t.get(), scales_t.get(), nullptr, nullptr,
                          cuda::BlockScaleOrder::BlockMajor);
    std::vector<uint8_t> expected(count), expected_t(count);
    std::vector<float> expected_scales(grid_count), expected_scales_t(grid_t_count);
    quantize_transpose_blocks(x.data(), shape.rows, shape.cols, spec, expected.data(),
                              expected_scales.data(), expected_t.data(), expected_scales_t.data());
    const auto transposed = [](const std::vector<float>& values, BlockShape shape_of) {
      std::vector<float> result(values.size());
      for (int r = 0; r < shape_of.rows; ++r) {
        for (int c = 0; c < shape_of.cols; ++c)
          result[static_cast<size_t>(c) * shape_of.rows + r] =
              values[static_cast<size_t>(r) * shape_of.cols + c];
      }
      return result;
    };
    const auto where = ::testing::Message() << "[" << shape.rows << ", " << shape.cols << "]";
    EXPECT_IDENTICAL(out.download(), expected, where);
    EXPECT_IDENTICAL(out_t.download(), expected_t, where << " transposed");
    EXPECT_IDENTICAL(scales.download(), transposed(expected_scales, grid), where << " scales");
    EXPECT_IDENTICAL(scales_t.download(), transposed(expected_scales_t, grid_t),
                     where << " transposed scales");
  }
}

// 128x128 tile scales in the GEMMs' padded layout (PaddedLineMajor): each grid row of both
// orientations padded to a multiple of 4 blocks, the reference's scales in place and the pads
// left as they were; the codes do not change. Refused for 1x128 blocks.
TYPED_TEST(CudaQuantize, PaddedTileScalesAreTheGridsWithTheirRowsPadded) {
  const BlockQuantization spec{BlockScaling::Tile128x128, Fp8Format::E4M3, true, 0.0f};
  std::vector<Shape> shapes = block_cast_shapes();
  shapes.push_back({640, 1000});  // 5 x 8 tiles: rows padded to 8 blocks, columns to 8
  for (const Shape shape : shapes) {
    const size_t count = static_cast<size_t>(shape.rows * shape.cols);
    const std::vector<TypeParam> x = random_tensor<TypeParam>(count, false);
    const DeviceBuffer<TypeParam> device_x(x);
    const BlockReference expected(x, shape, spec);
    const auto padded = [](const std::vector<uint8_t>& grid_bytes, BlockShape grid) {
      const int64_t padded_cols = (grid.cols + 3) / 4 * 4;
      std::vector<float> grid_floats(grid_bytes.size() / sizeof(float));
      std::memcpy(grid_floats.data(), grid_bytes.data(), grid_bytes.size());
      std::vector<float> result(size_t(grid.rows * padded_cols), -1.0f);
      for (int64_t r = 0; r < grid.rows; ++r) {
        for (int64_t c = 0; c < grid.cols; ++c)
          result[size_t(r * padded_cols + c)] = grid_floats[size_t(r * grid.cols + c)];
      }
      return result;
    };
    const std::vector<float> want =
        padded(expected.scales, scale_grid(spec.scaling, shape.rows, shape.cols));
    const std::vector<float> want_t =
        padded(expected.scales_t, scale_grid(spec.scaling, shape.cols, shape.rows));
    DeviceBuffer<uint8_t> out(count), out_t(count);
    DeviceBuffer<float> scales(std::vector<float>(want.size(), -1.0f)),
        scales_t(std::vector<float>(want_t.size(), -1.0f));
    cuda::quantize_blocks(device_x.get(), shape.rows, shape.cols, spec, out.get(), scales.get(),
                          out_t.get(), scales_t.get(), nullptr, nullptr,
                          cuda::BlockScaleOrder::PaddedLineMajor);
    const auto where = ::testing::Message() << "[" << shape.rows << ", " << shape.cols << "]";
    EXPECT_IDENTICAL(out.download(), expected.codes, where);
    EXPECT_IDENTICAL(out_t.download(), expected.codes_t, where << " transposed");
    EXPECT_IDENTICAL(scales.download(), want, where << " scales");
    EXPECT_IDENTICAL(scales_t.download(), want_t, where << " transposed scales");
  }
  const DeviceBuffer<TypeParam> x(std::vector<TypeParam>(256));
  DeviceBuffer<uint8_t> out(256);
  DeviceBuffer<float> scales(16);
  const BlockQuantization rows_spec{BlockScaling::Rows1x128, Fp8Format::E4M3, true, 0.0f};
  EXPECT_THROW(
      cuda::quantize_blocks(x.get(), 2, 128, rows_spec, out.get(), scales.get(), nullptr, nullptr,
                            nullptr, nullptr, cuda::BlockScaleOrder::PaddedLineMajor),
      Error);
}

// Grouped 128x128-tile casts of fp32 tensors (quantize_tiles_grouped): each tensor's codes and
// padded scales are the reference's, whatever its neighbours in the group; empty tensors and
// tensors without a transposed copy take their place; more tensors than one launch takes; pads
// and absent copies left as they were. Refused for 1x128 blocks and for unpaired targets.
TEST(CudaQuantize, GroupedTileCastsMatchEachTensorsOwnCast) {
  std::vector<Shape> shapes = block_cast_shapes();
  shapes.push_back({0, 128});
  shapes.push_back({640, 1000});
  std::uniform_int_distribution<int64_t> extent(1, 300);
  while (shapes.size() < 37)
    shapes.push_back({extent(rng()), extent(rng())});
  const auto padded = [](const std::vector<uint8_t>& grid_bytes, BlockShape grid) {
    const int64_t padded_cols = (grid.cols + 3) / 4 * 4;
    std::vector<float> result(size_t(grid.rows * padded_cols), -1.0f);
    for (int64_t r = 0; r < grid.rows; ++r) {
      for (int64_t c = 0; c < grid.cols; ++c)
        std::memcpy(&result[size_t(r * padded_cols + c)],
                    grid_bytes.data() + (r * grid.cols + c) * sizeof(float), sizeof(float));
    }
    return result;
  };
  for (const BlockQuantization spec :
       {BlockQuantization{BlockScaling::Tile128x128, Fp8Format::E4M3, true, 0.0f},
        BlockQuantization{BlockScaling::Tile128x128, Fp8Format::E5M2, false, 1e-12f}}) {
    struct Tensor {
      Shape shape;
      DeviceBuffer<float> x;
      DeviceBuffer<uint8_t> out, out_t;
      DeviceBuffer<float> scales, scales_t;
      BlockReference expected;
      std::vector<float> want, want_t;
    };
    std::vector<std::unique_ptr<Tensor>> tensors;  // DeviceBuffers stay where they are made
    std::vector<cuda::TileCastJob> jobs;
    for (size_t i = 0; i < shapes.size(); ++i) {
      const Shape shape = shapes[i];
      const bool transposed = i % 5 != 3;
      const auto count = static_cast<size_t>(shape.rows * shape.cols);
      const std::vector<float> x = random_tensor<float>(count, false);
      BlockReference expected(x, shape, spec);
      std::vector<float> want =
          padded(expected.scales, scale_grid(spec.scaling, shape.rows, shape.cols));
      std::vector<float> want_t =
          transposed ? padded(expected.scales_t, scale_grid(spec.scaling, shape.cols, shape.rows))
                     : std::vector<float>(4, -1.0f);
      if (!transposed) expected.codes_t.assign(count, 0xA5);
      const Tensor& tensor = *tensors.emplace_back(new Tensor{
          shape, DeviceBuffer<float>(x), DeviceBuffer<uint8_t>(std::vector<uint8_t>(count, 0xA5)),
          DeviceBuffer<uint8_t>(std::vector<uint8_t>(count, 0xA5)),
          DeviceBuffer<float>(std::vector<float>(want.size(), -1.0f)),
          DeviceBuffer<float>(std::vector<float>(want_t.size(), -1.0f)), std::move(expected),
          std::move(want), std::move(want_t)});
      jobs.push_back({tensor.x.get(), shape.rows, shape.cols, tensor.out.get(), tensor.scales.get(),
                      transposed ? tensor.out_t.get() : nullptr,
                      transposed ? tensor.scales_t.get() : nullptr});
    }
    cuda::quantize_tiles_grouped(jobs, spec, nullptr);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& tensor = *tensors[i];
      const auto where = ::testing::Message()
                         << format_name(spec.format) << " tensor " << i << " [" << tensor.shape.rows
                         << ", " << tensor.shape.cols << "]";
      EXPECT_IDENTICAL(tensor.out.download(), tensor.expected.codes, where);
      EXPECT_IDENTICAL(tensor.out_t.download(), tensor.expected.codes_t, where << " transposed");
      EXPECT_IDENTICAL(tensor.scales.download(), tensor.want, where << " scales");
      EXPECT_IDENTICAL(tensor.scales_t.download(), tensor.want_t, where << " transposed scales");
    }
  }
  const DeviceBuffer<float> x(std::vector<float>(256));
  DeviceBuffer<uint8_t> out(256);
  DeviceBuffer<float> scales(16);
  const BlockQuantization tiles{BlockScaling::Tile128x128, Fp8Format::E4M3, true, 0.0f};
  const BlockQuantization rows{BlockScaling::Rows1x128, Fp8Format::E4M3, true, 0.0f};
  EXPECT_THROW(
      cuda::quantize_tiles_grouped({{x.get(), 2, 128, out.get(), scales.get()}}, rows, nullptr),
      Error);
  EXPECT_THROW(
      cuda::quantize_tiles_grouped({{x.get(), 2, 128, out.get(), nullptr}}, tiles, nullptr), Error);
  EXPECT_THROW(cuda::quantize_tiles_grouped({{x.get(), 2, 128, nullptr, nullptr}}, tiles, nullptr),
               Error);
  EXPECT_THROW(
      cuda::quantize_tiles_grouped({{nullptr, 2, 128, out.get(), scales.get()}}, tiles, nullptr),
      Error);
}

// Transposed copies cast one after the other into consecutive lines of one operand, their
// block-major scales strided by all its lines (scale_lines_t): the codes and scales of the
// transposed cast of the side-by-side tensor, every byte written; a stride below a cast's own
// lines, or with line-major scales, is refused.
TEST(CudaQuantize, TransposedCastsFillConsecutiveLinesOfOneOperand) {
  const BlockQuantization spec{BlockScaling::Rows1x128, Fp8Format::E4M3, true, 0.0f};
  for (const Shape shape : {Shape{300, 200}, Shape{1024, 384}}) {
    const int64_t rows = shape.rows, first_cols = shape.cols, second_cols = 72;
    const int64_t cols = first_cols + second_cols;
    const std::vector<bf16> first = random_tensor<bf16>(size_t(rows * first_cols), false);
    const std::vector<bf16> second = random_tensor<bf16>(size_t(rows * second_cols), false);
    std::vector<bf16> side_by_side(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(first.begin() + r * first_cols, first_cols, side_by_side.begin() + r * cols);
      std::copy_n(second.begin() + r * second_cols, second_cols,
                  side_by_side.begin() + r * cols + first_cols);
    }
    const BlockShape grid_t = scale_grid(spec.scaling, cols, rows);  // [cols, row blocks]
    const auto count = static_cast<size_t>(rows * cols);
    const auto grid_t_count = static_cast<size_t>(grid_t.rows) * static_cast<size_t>(grid_t.cols);
    DeviceBuffer<uint8_t> out_t(std::vector<uint8_t>(count, 0xA5));
    DeviceBuffer<float> scales_t(std::vector<float>(grid_t_count, -1.0f));
    const DeviceBuffer<bf16> device_first(first), device_second(second);
    cuda::quantize_blocks(device_first.get(), rows, first_cols, spec, nullptr, nullptr, out_t.get(),
                          scales_t.get(), nullptr, nullptr, cuda::BlockScaleOrder::BlockMajor,
                          cuda::CastInput::Value, nullptr, cols);
    cuda::quantize_blocks(device_second.get(), rows, second_cols, spec, nullptr, nullptr,
                          out_t.get() + first_cols * rows, scales_t.get() + first_cols, nullptr,
                          nullptr, cuda::BlockScaleOrder::BlockMajor, cuda::CastInput::Value,
                          nullptr, cols);
    std::vector<uint8_t> expected(count), expected_t(count);
    const BlockShape grid = scale_grid(spec.scaling, rows, cols);
    std::vector<float> expected_scales(static_cast<size_t>(grid.rows) *
                                       static_cast<size_t>(grid.cols));
    std::vector<float> expected_scales_t(grid_t_count);
    quantize_transpose_blocks(side_by_side.data(), rows, cols, spec, expected.data(),
                              expected_scales.data(), expected_t.data(), expected_scales_t.data());
    std::vector<float> block_major_t(grid_t_count);
    for (int line = 0; line < grid_t.rows; ++line) {
      for (int block = 0; block < grid_t.cols; ++block)
        block_major_t[static_cast<size_t>(block) * grid_t.rows + line] =
            expected_scales_t[static_cast<size_t>(line) * grid_t.cols + block];
    }
    const auto where = ::testing::Message()
                       << "[" << rows << ", " << first_cols << " + " << second_cols << "]";
    EXPECT_IDENTICAL(out_t.download(), expected_t, where << " transposed");
    EXPECT_IDENTICAL(scales_t.download(), block_major_t, where << " transposed scales");
    for (const auto order : {cuda::BlockScaleOrder::BlockMajor, cuda::BlockScaleOrder::LineMajor}) {
      const int64_t stride = order == cuda::BlockScaleOrder::BlockMajor ? first_cols - 1 : cols;
      EXPECT_THROW(cuda::quantize_blocks(device_first.get(), rows, first_cols, spec, nullptr,
                                         nullptr, out_t.get(), scales_t.get(), nullptr, nullptr,
                                         order, cuda::CastInput::Value, nullptr, stride),
                   Error)
          << where << " a scale stride of " << stride;
    }
  }
}

// The bf16 tensors a relu² block cast stands for: relu²(x), and the gradient dy · 2·relu(p) of
// relu²'s input p.
struct Relu2Tensors {
  std::vector<bf16> act, gradient;

  Relu2Tensors(const std::vector<bf16>& x, const std::vector<bf16>& p)
      : act(x.size()), gradient(x.size()) {
    for (size_t i = 0; i < x.size(); ++i) {
      const float value = bf16_to_float(x[i]);
      const float positive = value > 0.0f ? value : 0.0f;  // NaN -> 0
      act[i] = float_to_bf16(positive * positive);
      const float input = bf16_to_float(p[i]);
      gradient[i] = float_to_bf16(input > 0.0f ? 2.0f * input * value : 0.0f);
    }
  }
};

// Block casts through relu² (CastInput::Relu2 and Relu2Gradient) give the codes and scales of
// the block cast of the bf16 activation or gradient they stand for, both orientations; a
// relu² cast of fp32 input is an error.
TEST(CudaQuantize, BlockRelu2CastsMatchBlockCastOfTheActivation) {
  for (const Shape shape : block_cast_shapes()) {
    const size_t count = static_cast<size_t>(shape.rows * shape.cols);
    const std::vector<bf16> x = random_tensor<bf16>(count, true);
    const std::vector<bf16> p = random_tensor<bf16>(count, true);
    const auto [act, gradient] = Relu2Tensors(x, p);
    const DeviceBuffer<bf16> device_x(x), device_p(p);
    for (BlockScaling scaling : kBlockScalings) {
      const BlockQuantization spec{scaling, Fp8Format::E4M3, true, 0.0f};
      for (const cuda::CastInput input : {cuda::CastInput::Relu2, cuda::CastInput::Relu2Gradient}) {
        const bool is_gradient = input == cuda::CastInput::Relu2Gradient;
        const BlockReference expected(is_gradient ? gradient : act, shape, spec);
        DeviceBuffer<uint8_t> out(std::vector<uint8_t>(count, 0xA5)),
            out_t(std::vector<uint8_t>(count, 0xA5)), scales(expected.scales.size()),
            scales_t(expected.scales_t.size());
        DeviceBuffer<CastHealth> health(std::vector<CastHealth>(1));
        cuda::quantize_blocks(device_x.get(), shape.rows, shape.cols, spec, out.get(), scales.get(),
                              out_t.get(), scales_t.get(), nullptr, health.get(),
                              cuda::BlockScaleOrder::LineMajor, input,
                              is_gradient ? device_p.get() : nullptr);
        const auto where = ::testing::Message()
                           << scaling_name(scaling) << (is_gradient ? " relu² gradient" : " relu²")
                           << " [" << shape.rows << ", " << shape.cols << "]";
        expected.expect_matched_by(out, scales, out_t, scales_t, health, where);
      }
    }
  }
  const DeviceBuffer<float> x32(std::vector<float>(256));
  DeviceBuffer<uint8_t> out(256), scales(64);
  const BlockQuantization spec{BlockScaling::Rows1x128, Fp8Format::E4M3, true, 0.0f};
  EXPECT_THROW(cuda::quantize_blocks(x32.get(), 2, 128, spec, out.get(), scales.get(), nullptr,
                                     nullptr, nullptr, nullptr, cuda::BlockScaleOrder::LineMajor,
                                     cuda::CastInput::Relu2),
               Error);
}

// A 1x128 relu² gradient cast that also makes relu²'s transposed copy (ActivationTCast): the
// gradient's codes and scales as without it, and the activation's those of the Relu2 cast of
// relu²'s input, transposed copy alone (e4m3, the CPU's for line-major scales), both scale
// orders and gradient formats, on full and edge tiles and on several waves of tiles; nothing is
// written past either copy. Refused with other inputs, with other scalings and without scales.
TEST(CudaQuantize, Relu2GradientCastMakesTheActivationsTransposedCopy) {
  std::vector<Shape> shapes = block_cast_shapes();
  shapes.push_back(many_waves_shape());
  for (const Shape shape : shapes) {
    const size_t count = static_cast<size_t>(shape.rows * shape.cols);
    const std::vector<bf16> dy = random_tensor<bf16>(count, true);
    const std::vector<bf16> p = random_tensor<bf16>(count, true);
    const DeviceBuffer<bf16> device_dy(dy), device_p(p);
    const BlockQuantization activation_spec{BlockScaling::Rows1x128, Fp8Format::E4M3, true, 0.0f};
    const BlockReference activation(Relu2Tensors(p, p).act, shape, activation_spec);
    for (const Fp8Format format : {Fp8Format::E4M3, Fp8Format::E5M2}) {
      const BlockQuantization spec{BlockScaling::Rows1x128, format, true, 0.0f};
      for (const auto order :
           {cuda::BlockScaleOrder::LineMajor, cuda::BlockScaleOrder::BlockMajor}) {
        const size_t scale_bytes = activation.scales.size(),
                     scale_t_bytes = activation.scales_t.size();
        // Poisoned outputs, 16 bytes longer than each copy.
        struct Copies {
          DeviceBuffer<uint8_t> out, out_t, scales, scales_t, act_t, act_scales_t;
          Copies(size_t count, size_t scale_bytes, size_t scale_t_bytes)
              : out(std::vector<uint8_t>(count + 16, 0xA5)),
                out_t(std::vector<uint8_t>(count + 16, 0xA5)),
                scales(std::vector<uint8_t>(scale_bytes + 16, 0xA5)),
                scales_t(std::vector<uint8_t>(scale_t_bytes + 16, 0xA5)),
                act_t(std::vector<uint8_t>(count + 16, 0xA5)),
                act_scales_t(std::vector<uint8_t>(scale_t_bytes + 16, 0xA5)) {}
        };
        Copies fused(count, scale_bytes, scale_t_bytes), apart(count, scale_bytes, scale_t_bytes);
        cuda::quantize_blocks(
            device_dy.get(), shape.rows, shape.cols, spec, fused.out.get(), fused.scales.get(),
            fused.out_t.get(), fused.scales_t.get(), nullptr, nullptr, order,
            cuda::CastInput::Relu2Gradient, device_p.get(), 0,
            {fused.act_t.get(), reinterpret_cast<float*>(fused.act_scales_t.get())});
        cuda::quantize_blocks(device_dy.get(), shape.rows, shape.cols, spec, apart.out.get(),
                              apart.scales.get(), apart.out_t.get(), apart.scales_t.get(), nullptr,
                              nullptr, order, cuda::CastInput::Relu2Gradient, device_p.get());
        cuda::quantize_blocks(device_p.get(), shape.rows, shape.cols, activation_spec, nullptr,
                              nullptr, apart.act_t.get(), apart.act_scales_t.get(), nullptr,
                              nullptr, order, cuda::CastInput::Relu2);
        const auto where = ::testing::Message()
                           << format_name(format)
                           << (order == cuda::BlockScaleOrder::BlockMajor ? " block-major"
                                                                          : " line-major")
                           << " [" << shape.rows << ", " << shape.cols << "]";
        EXPECT_IDENTICAL(fused.out.download(), apart.out.download(), where << " gradient");
        EXPECT_IDENTICAL(fused.scales.download(), apart.scales.download(),
                         where << " gradient scales");
        EXPECT_IDENTICAL(fused.out_t.download(), apart.out_t.download(),
                         where << " gradient transposed");
        EXPECT_IDENTICAL(fused.scales_t.download(), apart.scales_t.download(),
                         where << " gradient transposed scales");
        EXPECT_IDENTICAL(fused.act_t.download(), apart.act_t.download(),
                         where << " relu² transposed");
        EXPECT_IDENTICAL(fused.act_scales_t.download(), apart.act_scales_t.download(),
                         where << " relu² transposed scales");
        if (order == cuda::BlockScaleOrder::LineMajor) {
          std::vector<uint8_t> want = activation.codes_t, want_scales = activation.scales_t;
          want.resize(want.size() + 16, 0xA5);
          want_scales.resize(want_scales.size() + 16, 0xA5);
          EXPECT_IDENTICAL(fused.act_t.download(), want, where << " relu² transposed, CPU");
          EXPECT_IDENTICAL(fused.act_scales_t.download(), want_scales,
                           where << " relu² transposed scales, CPU");
        }
      }
    }
  }
  const DeviceBuffer<bf16> x(std::vector<bf16>(256 * 128)), p(std::vector<bf16>(256 * 128));
  DeviceBuffer<uint8_t> out(256 * 128), out_t(256 * 128), act_t(256 * 128);
  DeviceBuffer<float> scales(1024), scales_t(1024), act_scales_t(1024);
  const BlockQuantization rows_spec{BlockScaling::Rows1x128, Fp8Format::E5M2, true, 0.0f};
  const BlockQuantization tile_spec{BlockScaling::Tile128x128, Fp8Format::E5M2, true, 0.0f};
  const cuda::ActivationTCast activation_t{act_t.get(), act_scales_t.get()};
  const auto cast = [&](const BlockQuantization& spec, cuda::CastInput input,
                        const cuda::ActivationTCast& target) {
    cuda::quantize_blocks(x.get(), 256, 128, spec, out.get(), scales.get(), out_t.get(),
                          scales_t.get(), nullptr, nullptr, cuda::BlockScaleOrder::LineMajor, input,
                          input == cuda::CastInput::Relu2Gradient ? p.get() : nullptr, 0, target);
  };
  EXPECT_THROW(cast(rows_spec, cuda::CastInput::Relu2, activation_t), Error) << "relu² input";
  EXPECT_THROW(cast(rows_spec, cuda::CastInput::Value, activation_t), Error) << "plain input";
  EXPECT_THROW(cast(tile_spec, cuda::CastInput::Relu2Gradient, activation_t), Error) << "tiles";
  EXPECT_THROW(cast(rows_spec, cuda::CastInput::Relu2Gradient, {act_t.get(), nullptr}), Error)
      << "codes without scales";
  cast(rows_spec, cuda::CastInput::Relu2Gradient, activation_t);
  FP8T_CUDA_CHECK(cudaDeviceSynchronize());
}

// A tensor of several waves of blocks (at least twelve tiles per SM), with edge tiles among the
// full ones: every input kind and scaling gives the CPU's codes, scales and counts in both
// orientations.
TEST(CudaQuantize, BlockCastsOfManyWavesOfTilesMatchReference) {
  const Shape shape = many_waves_shape();
  const size_t count = static_cast<size_t>(shape.rows * shape.cols);
  const std::vector<bf16> x = random_tensor<bf16>(count, true);
  const std::vector<bf16> p = random_tensor<bf16>(count, true);
  const std::vector<float> x32 = random_tensor<float>(count, true);
  const Relu2Tensors relu2(x, p);
  const DeviceBuffer<bf16> device_x(x), device_p(p);
  const DeviceBuffer<float> device_x32(x32);
  for (BlockScaling scaling : kBlockScalings) {
    const BlockQuantization spec{scaling, Fp8Format::E4M3, true, 0.0f};
    for (const char* kind : {"bf16", "fp32", "relu²", "relu² gradient"}) {
      const std::string name = kind;
      const cuda::CastInput input = name == "relu²"            ? cuda::CastInput::Relu2
                                    : name == "relu² gradient" ? cuda::CastInput::Relu2Gradient
                                                               : cuda::CastInput::Value;
      const BlockReference expected =
          name == "fp32" ? BlockReference(x32, shape, spec)
                         : BlockReference(input == cuda::CastInput::Relu2           ? relu2.act
                                          : input == cuda::CastInput::Relu2Gradient ? relu2.gradient
                                                                                    : x,
                                          shape, spec);
      DeviceBuffer<uint8_t> out(std::vector<uint8_t>(count, 0xA5)),
          out_t(std::vector<uint8_t>(count, 0xA5)),
          scales(std::vector<uint8_t>(expected.scales.size(), 0xA5)),
          scales_t(std::vector<uint8_t>(expected.scales_t.size(), 0xA5));
      DeviceBuffer<CastHealth> health(std::vector<CastHealth>(1));
      if (name == "fp32") {
        cuda::quantize_blocks(device_x32.get(), shape.rows, shape.cols, spec, out.get(),
                              scales.get(), out_t.get(), scales_t.get(), nullptr, health.get());
      } else {
        cuda::quantize_blocks(device_x.get(), shape.rows, shape.cols, spec, out.get(), scales.get(),
                              out_t.get(), scales_t.get(), nullptr, health.get(),
                              cuda::BlockScaleOrder::LineMajor, input,
                              input == cuda::CastInput::Relu2Gradient ? device_p.get() : nullptr);
      }
      const auto where = ::testing::Message() << scaling_name(scaling) << " " << name << " ["
                                              << shape.rows << ", " << shape.cols << "]";
      expected.expect_matched_by(out, scales, out_t, scales_t, health, where);
    }
  }
}

// Magnitudes from 1e-8 to 1e3, either sign, so that every block holds values that underflow;
// with a few infinities (the only values that saturate under E8M0 and power-of-two scales) and
// NaNs (an MX block's NaN scale, whose codes count as neither).
template <typename T>
std::vector<T> wide_magnitude_tensor(size_t count) {
  std::uniform_real_distribution<float> decimal_exponent(-8.0f, 3.0f);
  std::bernoulli_distribution negative(0.5);
  std::vector<T> x(count);
  for (T& value : x) {
    const float magnitude = std::pow(10.0f, decimal_exponent(rng()));
    value = from_float<T>(negative(rng()) ? -magnitude : magnitude);
  }
  std::uniform_int_distribution<size_t> position(0, count - 1);
  const float inf = std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < count / 512 + 1; ++i)
    x[position(rng())] = from_float<T>(i % 2 == 0 ? inf : -inf);
  for (size_t i = 0; i < count / 2048 + 1; ++i)
    x[position(rng())] = from_float<T>(std::numeric_limits<float>::quiet_NaN());
  return x;
}

// The block casts' saturation and underflow counts, those of the row-wise codes, equal the
// CPU's with and without the transposed copy, on full and edge tiles, and add up over calls;
// the codes and scales are still the CPU's.
TYPED_TEST(CudaQuantize, BlockCastHealthCountsMatchTheCpu) {
  std::vector<Shape> shapes = {{5, 160}, {217, 256}, {128, 384}, {1, 1}, {130, 129}};
  std::uniform_int_distribution<int64_t> extent(1, 700);
  for (int i = 0; i < 3; ++i)
    shapes.push_back({extent(rng()), extent(rng())});
  for (const Shape shape : shapes) {
    const size_t count = static_cast<size_t>(shape.rows * shape.cols);
    const std::vector<TypeParam> x = wide_magnitude_tensor<TypeParam>(count);
    DeviceBuffer<TypeParam> device_x(x);
    for (BlockScaling scaling : kBlockScalings) {
      for (Fp8Format format : kDataFormats) {
        for (bool power_of_2 : {false, true}) {
          if (scaling == BlockScaling::Mx1x32 && !power_of_2) continue;
          const BlockQuantization spec{scaling, format, power_of_2, 0.0f};
          const ScaleBuffers grid(scaling, shape.rows, shape.cols);
          const ScaleBuffers grid_t(scaling, shape.cols, shape.rows);
          const std::string where =
              fmt::format("{} {}{} [{}, {}]", scaling_name(scaling), format_name(format),
                          power_of_2 ? " pow2" : "", shape.rows, shape.cols);
          std::vector<uint8_t> expected(count), expected_t(count), expected_scales(grid.bytes),
              expected_scales_t(grid_t.bytes);
          CastHealth expected_health;
          quantize_transpose_blocks(x.data(), shape.rows, shape.cols, spec, expected.data(),
                                    expected_scales.data(), expected_t.data(),
                                    expected_scales_t.data(), &expected_health);
          if (count >= 4096) {  // the test must see both kinds
            EXPECT_GT(expected_health.saturated, 0u) << where;
            EXPECT_GT(expected_health.underflow, 0u) << where;
          }

          DeviceBuffer<uint8_t> out(count), out_t(count), scales(grid.bytes),
              scales_t(grid_t.bytes);
          DeviceBuffer<CastHealth> health(std::vector<CastHealth>(1));
          cuda::quantize_blocks(device_x.get(), shape.rows, shape.cols, spec, out.get(),
                                scales.get(), out_t.get(), scales_t.get(), nullptr, health.get());
          EXPECT_IDENTICAL(out.download(), expected, where);
          EXPECT_IDENTICAL(scales.download(), expected_scales, where << " scales");
          EXPECT_IDENTICAL(out_t.download(), expected_t, where << " transposed");
          EXPECT_IDENTICAL(scales_t.download(), expected_scales_t, where << " transposed scales");
          expect_health(health, expected_health, where + " with the transposed copy");

          DeviceBuffer<uint8_t> alone(count), alone_scales(grid.bytes);
          cuda::quantize_blocks(device_x.get(), shape.rows, shape.cols, spec, alone.get(),
                                alone_scales.get(), nullptr, nullptr, nullptr, health.get());
          EXPECT_IDENTICAL(alone.download(), expected, where << " without the transposed copy");
          EXPECT_IDENTICAL(alone_scales.download(), expected_scales,
                           where << " scales without the transposed copy");
          CastHealth twice = expected_health;
          twice.saturated *= 2;
          twice.underflow *= 2;
          expect_health(health, twice, where + " twice");
        }
      }
    }
  }
}

TEST(CudaQuantize, RejectsBadArguments) {
  DeviceBuffer<float> x(16);
  DeviceBuffer<uint8_t> out(16);
  DeviceBuffer<float> scale(std::vector<float>{1.0f});
  EXPECT_THROW(
      cuda::quantize(x.get(), 16, scale.get(), Fp8Format::E8M0, out.get(), nullptr, nullptr),
      Error);
  EXPECT_THROW(
      cuda::quantize(x.get(), -1, scale.get(), Fp8Format::E4M3, out.get(), nullptr, nullptr),
      Error);
  EXPECT_THROW(
      cuda::quantize<float>(nullptr, 16, scale.get(), Fp8Format::E4M3, out.get(), nullptr, nullptr),
      Error);
  EXPECT_THROW(cuda::quantize_transpose(x.get(), -4, 4, scale.get(), Fp8Format::E4M3, out.get(),
                                        out.get(), nullptr, nullptr),
               Error);

  const BlockQuantization rows{BlockScaling::Rows1x128, Fp8Format::E4M3, true, 0.0f};
  const BlockQuantization tiles{BlockScaling::Tile128x128, Fp8Format::E4M3, true, 0.0f};
  DeviceBuffer<float> scales(1), scales_t(4);
  DeviceBuffer<CastHealth> health(std::vector<CastHealth>(1));
  EXPECT_THROW(
      cuda::quantize_blocks(x.get(), 4, 4, rows, nullptr, nullptr, nullptr, nullptr, nullptr),
      Error);  // nothing to write
  EXPECT_THROW(
      cuda::quantize_blocks(x.get(), 4, 4, rows, out.get(), nullptr, nullptr, nullptr, nullptr),
      Error);  // codes without scales
  EXPECT_THROW(cuda::quantize_blocks(x.get(), 4, 4, rows, nullptr, nullptr, out.get(),
                                     scales_t.get(), nullptr, health.get()),
               Error);  // counts of a row-wise copy that is not written
  EXPECT_THROW(cuda::quantize_blocks(x.get(), 4, 4, tiles, out.get(), scales.get(), nullptr,
                                     nullptr, nullptr, nullptr, cuda::BlockScaleOrder::BlockMajor),
               Error);  // block-major 128x128 scales
}

}  // namespace
}  // namespace fp8t
