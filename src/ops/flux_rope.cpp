#include "ops/flux_rope.h"

#include <cmath>

#include "core/error.h"

namespace fp8t::ops {

void flux_rope_tables(float* cos, float* sin, const float* ids, int64_t tokens,
                      const std::array<int, 3>& axes_dim, double theta) {
  FP8T_CHECK(tokens >= 0, "expected tokens >= 0, found {}", tokens);
  FP8T_CHECK(theta > 0.0, "expected theta > 0, found {}", theta);
  int64_t pairs = 0;
  for (int axis : axes_dim) {
    FP8T_CHECK(axis >= 2 && axis % 2 == 0, "expected even axes of at least 2, found {}", axis);
    pairs += axis / 2;
  }
  for (int64_t n = 0; n < tokens; ++n) {
    int64_t pair = 0;
    for (size_t axis = 0; axis < axes_dim.size(); ++axis) {
      const int width = axes_dim[axis];
      const double position = ids[n * 3 + static_cast<int64_t>(axis)];
      for (int j = 0; j < width / 2; ++j, ++pair) {
        const double omega = 1.0 / std::pow(theta, double(2 * j) / double(width));
        const double angle = position * omega;
        cos[n * pairs + pair] = static_cast<float>(std::cos(angle));
        sin[n * pairs + pair] = static_cast<float>(std::sin(angle));
      }
    }
  }
}

namespace {

// The rotation of every pair by its angle, or by the opposite angle (the backward).
template <typename T, bool kAdd>
void rotate(T* out, const T* inp, const float* cos, const float* sin, T direction, int64_t tokens,
            int64_t heads, int64_t head_dim) {
  FP8T_CHECK(tokens >= 0 && heads >= 1, "expected tokens >= 0 and heads >= 1, found {} and {}",
             tokens, heads);
  FP8T_CHECK(head_dim >= 2 && head_dim % 2 == 0, "expected an even head_dim, found {}", head_dim);
  const int64_t pairs = head_dim / 2;
  for (int64_t n = 0; n < tokens; ++n) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (n * heads + h) * head_dim;
      for (int64_t i = 0; i < pairs; ++i) {
        const T c = cos[n * pairs + i], s = direction * T(sin[n * pairs + i]);
        const T x0 = inp[base + 2 * i], x1 = inp[base + 2 * i + 1];
        const T y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
        if constexpr (kAdd) {
          out[base + 2 * i] += y0;
          out[base + 2 * i + 1] += y1;
        } else {
          out[base + 2 * i] = y0;
          out[base + 2 * i + 1] = y1;
        }
      }
    }
  }
}

}  // namespace

template <typename T>
void flux_rope_forward(T* out, const T* inp, const float* cos, const float* sin, int64_t tokens,
                       int64_t heads, int64_t head_dim) {
  rotate<T, false>(out, inp, cos, sin, T(1), tokens, heads, head_dim);
}

template <typename T>
void flux_rope_backward(T* dinp, const T* dout, const float* cos, const float* sin, int64_t tokens,
                        int64_t heads, int64_t head_dim) {
  rotate<T, true>(dinp, dout, cos, sin, T(-1), tokens, heads, head_dim);
}

template void flux_rope_forward<float>(float*, const float*, const float*, const float*, int64_t,
                                       int64_t, int64_t);
template void flux_rope_forward<double>(double*, const double*, const float*, const float*, int64_t,
                                        int64_t, int64_t);
template void flux_rope_backward<float>(float*, const float*, const float*, const float*, int64_t,
                                        int64_t, int64_t);
template void flux_rope_backward<double>(double*, const double*, const float*, const float*,
                                         int64_t, int64_t, int64_t);

}  // namespace fp8t::ops
