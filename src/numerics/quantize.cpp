#include "numerics/quantize.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "numerics/scaling.h"

namespace fp8t {

namespace {

template <typename T>
uint32_t amax_bits(const T* x, int64_t count) {
  uint32_t result = 0;
  for (int64_t i = 0; i < count; ++i)
    result = std::max(result, abs_bits(to_float(x[i])));
  return result;
}

void check_shape(int64_t rows, int64_t cols) {
  FP8T_CHECK(rows >= 0 && cols >= 0, "expected a non-negative shape, found [{}, {}]", rows, cols);
}

template <typename T>
std::vector<T> transposed(const T* x, int64_t rows, int64_t cols) {
  std::vector<T> result(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      result[static_cast<size_t>(c * rows + r)] = x[r * cols + c];
  }
  return result;
}

}  // namespace

template <typename T>
float amax(const T* x, int64_t count) {
  return bits_to_float(amax_bits(x, count));
}

template <typename T>
void quantize(const T* x, int64_t count, float scale, Fp8Format format, uint8_t* out,
              float* amax_out, CastHealth* health) {
  const float maximum = format_max(format);
  for (int64_t i = 0; i < count; ++i) {
    const float value = to_float(x[i]);
    const float scaled = value * scale;
    out[i] = encode(scaled, format, Saturation::Saturate);
    if (health != nullptr) {
      health->saturated += cast_saturates(scaled, maximum) ? 1 : 0;
      health->underflow += cast_underflows(value, out[i]) ? 1 : 0;
    }
  }
  if (amax_out != nullptr) {
    *amax_out = bits_to_float(std::max(abs_bits(*amax_out), amax_bits(x, count)));
  }
}

template <typename T>
void quantize_transpose(const T* x, int64_t rows, int64_t cols, float scale, Fp8Format format,
                        uint8_t* out, uint8_t* out_t, float* amax_out, CastHealth* health) {
  check_shape(rows, cols);
  quantize(x, rows * cols, scale, format, out, amax_out, health);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      out_t[c * rows + r] = out[r * cols + c];
  }
}

void dequantize(const uint8_t* q, int64_t count, float scale_inv, Fp8Format format, float* out) {
  for (int64_t i = 0; i < count; ++i)
    out[i] = decode(q[i], format) * scale_inv;
}

template <typename T>
void quantize_blocks(const T* x, int64_t rows, int64_t cols, const BlockQuantization& spec,
                     uint8_t* out, void* scales, CastHealth* health) {
  check_shape(rows, cols);
  FP8T_CHECK(spec.format != Fp8Format::E8M0, "E8M0 is a scale format, not a data format");
  const BlockShape block = block_shape(spec.scaling);
  const BlockShape grid = scale_grid(spec.scaling, rows, cols);
  const float format_maximum = format_max(spec.format);
  for (int64_t br = 0; br < grid.rows; ++br) {
    for (int64_t bc = 0; bc < grid.cols; ++bc) {
      const int64_t r0 = br * block.rows, r1 = std::min(rows, r0 + block.rows);
      const int64_t c0 = bc * block.cols, c1 = std::min(cols, c0 + block.cols);
      uint32_t block_amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        block_amax = std::max(block_amax, amax_bits(x + r * cols + c0, c1 - c0));
      const float amax_value = bits_to_float(block_amax);
      const int64_t scale_index = br * grid.cols + bc;
      float multiplier;
      if (spec.scaling == BlockScaling::Mx1x32) {
        const uint8_t code = mx_scale_from_amax(amax_value, format_maximum);
        static_cast<uint8_t*>(scales)[scale_index] = code;
        multiplier = mx_inverse_scale(code);
      } else {
        multiplier =
            scale_from_amax(amax_value, format_maximum, spec.power_of_2_scales, spec.amax_epsilon);
        static_cast<float*>(scales)[scale_index] = 1.0f / multiplier;
      }
      // A NaN multiplier (an MX block holding a NaN) makes every code NaN: nothing to count.
      CastHealth* block_health = std::isnan(multiplier) ? nullptr : health;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float value = to_float(x[r * cols + c]);
          const float scaled = value * multiplier;
          const uint8_t code = encode(scaled, spec.format, Saturation::Saturate);
          out[r * cols + c] = code;
          if (block_health != nullptr) {
            block_health->saturated += cast_saturates(scaled, format_maximum) ? 1 : 0;
            block_health->underflow += cast_underflows(value, code) ? 1 : 0;
          }
        }
      }
    }
  }
}

template <typename T>
void quantize_transpose_blocks(const T* x, int64_t rows, int64_t cols,
                               const BlockQuantization& spec, uint8_t* out, void* scales,
                               uint8_t* out_t, void* scales_t, CastHealth* health) {
  check_shape(rows, cols);
  quantize_blocks(x, rows, cols, spec, out, scales, health);
  const std::vector<T> x_t = transposed(x, rows, cols);
  quantize_blocks(x_t.data(), cols, rows, spec, out_t, scales_t);
}

void dequantize_blocks(const uint8_t* q, int64_t rows, int64_t cols, const BlockQuantization& spec,
                       const void* scales, float* out) {
  check_shape(rows, cols);
  const BlockShape block = block_shape(spec.scaling);
  const BlockShape grid = scale_grid(spec.scaling, rows, cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t scale_index = (r / block.rows) * grid.cols + c / block.cols;
      const float scale_inv =
          spec.scaling == BlockScaling::Mx1x32
              ? decode(static_cast<const uint8_t*>(scales)[scale_index], Fp8Format::E8M0)
              : static_cast<const float*>(scales)[scale_index];
      out[r * cols + c] = decode(q[r * cols + c], spec.format) * scale_inv;
    }
  }
}

#define FP8T_INSTANTIATE_QUANTIZE(T)                                                               \
  template float amax<T>(const T*, int64_t);                                                       \
  template void quantize<T>(const T*, int64_t, float, Fp8Format, uint8_t*, float*, CastHealth*);   \
  template void quantize_transpose<T>(const T*, int64_t, int64_t, float, Fp8Format, uint8_t*,      \
                                      uint8_t*, float*, CastHealth*);                              \
  template void quantize_blocks<T>(const T*, int64_t, int64_t, const BlockQuantization&, uint8_t*, \
                                   void*, CastHealth*);                                            \
  template void quantize_transpose_blocks<T>(const T*, int64_t, int64_t, const BlockQuantization&, \
                                             uint8_t*, void*, uint8_t*, void*, CastHealth*);

FP8T_INSTANTIATE_QUANTIZE(float)
FP8T_INSTANTIATE_QUANTIZE(bf16)

}  // namespace fp8t
