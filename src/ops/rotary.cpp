#include "ops/rotary.h"

#include <cmath>

#include "core/error.h"

namespace fp8t::ops {
namespace {

void check_rotary_args(int64_t batch, int64_t seq_len, int64_t heads, int64_t head_dim) {
  FP8T_CHECK(batch >= 0, "expected batch >= 0, found {}", batch);
  FP8T_CHECK(seq_len >= 0, "expected seq_len >= 0, found {}", seq_len);
  FP8T_CHECK(heads > 0, "expected heads > 0, found {}", heads);
  FP8T_CHECK(head_dim > 0 && head_dim % 2 == 0, "expected an even head_dim > 0, found {}",
             head_dim);
}

}  // namespace

void rotary_tables(float* cos, float* sin, int64_t seq_len, int64_t head_dim, float base) {
  FP8T_CHECK(seq_len >= 0, "expected seq_len >= 0, found {}", seq_len);
  FP8T_CHECK(head_dim > 0 && head_dim % 2 == 0, "expected an even head_dim > 0, found {}",
             head_dim);
  FP8T_CHECK(base > 0.0f, "expected base > 0, found {}", base);
  const int64_t half = head_dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    // Every step in float, as torch does with float32 tensors: arange(0, D, 2) / D, pow, 1 / x.
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(head_dim);
    const float inv_freq = 1.0f / std::pow(base, exponent);
    for (int64_t t = 0; t < seq_len; ++t) {
      const float angle = static_cast<float>(t) * inv_freq;
      cos[t * half + j] = std::cos(angle);
      sin[t * half + j] = std::sin(angle);
    }
  }
}

namespace {

// Rotates each (x1, x2) = (first half, second half) pair of every head by the table's angle:
// y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos. The backward is the transposed rotation (the
// negated angle) and adds into its output.
template <bool kBackward, typename T>
void rotate(T* out, const T* inp, const float* cos, const float* sin, int64_t batch,
            int64_t seq_len, int64_t heads, int64_t head_dim) {
  check_rotary_args(batch, seq_len, heads, head_dim);
  const int64_t half = head_dim / 2;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq_len; ++t) {
      const float* cos_row = cos + t * half;
      const float* sin_row = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t offset = ((b * seq_len + t) * heads + h) * head_dim;
        const T* x = inp + offset;
        T* y = out + offset;
        for (int64_t j = 0; j < half; ++j) {
          const T c = static_cast<T>(cos_row[j]);
          const T s = kBackward ? -static_cast<T>(sin_row[j]) : static_cast<T>(sin_row[j]);
          const T x1 = x[j];  // read both before writing: out may be inp
          const T x2 = x[j + half];
          if constexpr (kBackward) {
            y[j] += x1 * c + x2 * s;
            y[j + half] += -x1 * s + x2 * c;
          } else {
            y[j] = x1 * c + x2 * s;
            y[j + half] = -x1 * s + x2 * c;
          }
        }
      }
    }
  }
}

}  // namespace

template <typename T>
void rotary_forward(T* out, const T* inp, const float* cos, const float* sin, int64_t batch,
                    int64_t seq_len, int64_t heads, int64_t head_dim) {
  rotate<false>(out, inp, cos, sin, batch, seq_len, heads, head_dim);
}

template <typename T>
void rotary_backward(T* dinp, const T* dout, const float* cos, const float* sin, int64_t batch,
                     int64_t seq_len, int64_t heads, int64_t head_dim) {
  rotate<true>(dinp, dout, cos, sin, batch, seq_len, heads, head_dim);
}

template void rotary_forward<float>(float*, const float*, const float*, const float*, int64_t,
                                    int64_t, int64_t, int64_t);
template void rotary_forward<double>(double*, const double*, const float*, const float*, int64_t,
                                     int64_t, int64_t, int64_t);
template void rotary_backward<float>(float*, const float*, const float*, const float*, int64_t,
                                     int64_t, int64_t, int64_t);
template void rotary_backward<double>(double*, const double*, const float*, const float*, int64_t,
                                      int64_t, int64_t, int64_t);

}  // namespace fp8t::ops
