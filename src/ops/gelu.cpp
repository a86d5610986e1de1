#include "ops/gelu.h"

#include <cmath>

#include "core/error.h"

namespace fp8t::ops {

namespace {

template <typename T>
constexpr T kSqrt2OverPi = static_cast<T>(0.79788456080286535588);  // √(2/π)
template <typename T>
constexpr T kCubic = static_cast<T>(0.044715);

}  // namespace

template <typename T>
void gelu_tanh_forward(T* out, const T* inp, int64_t n) {
  FP8T_CHECK(n >= 0, "expected n >= 0, found {}", n);
  for (int64_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T t = std::tanh(kSqrt2OverPi<T> * (x + kCubic<T> * x * x * x));
    out[i] = T(0.5) * x * (T(1) + t);
  }
}

template <typename T>
void gelu_tanh_backward(T* dinp, const T* dout, const T* inp, int64_t n) {
  FP8T_CHECK(n >= 0, "expected n >= 0, found {}", n);
  for (int64_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T t = std::tanh(kSqrt2OverPi<T> * (x + kCubic<T> * x * x * x));
    const T inner_derivative = kSqrt2OverPi<T> * (T(1) + T(3) * kCubic<T> * x * x);
    const T derivative = T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * inner_derivative;
    dinp[i] += derivative * dout[i];
  }
}

template void gelu_tanh_forward<float>(float*, const float*, int64_t);
template void gelu_tanh_forward<double>(double*, const double*, int64_t);
template void gelu_tanh_backward<float>(float*, const float*, const float*, int64_t);
template void gelu_tanh_backward<double>(double*, const double*, const double*, int64_t);

}  // namespace fp8t::ops
