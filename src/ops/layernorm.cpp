#include "ops/layernorm.h"

#include <cmath>

#include "core/error.h"

namespace fp8t::ops {

template <typename T>
void layernorm_forward(T* out, T* rstd, const T* inp, int64_t rows, int64_t dim,
                       NonDeduced<T> eps) {
  FP8T_CHECK(rows >= 0, "expected rows >= 0, found {}", rows);
  FP8T_CHECK(dim > 0, "expected dim > 0, found {}", dim);
  FP8T_CHECK(eps >= 0, "expected eps >= 0, found {}", eps);
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = inp + r * dim;
    T* y = out + r * dim;
    T sum = 0;
    for (int64_t i = 0; i < dim; ++i)
      sum += x[i];
    const T mean = sum / static_cast<T>(dim);
    T sum_squares = 0;  // two passes: no cancellation for rows far from zero mean
    for (int64_t i = 0; i < dim; ++i)
      sum_squares += (x[i] - mean) * (x[i] - mean);
    const T row_rstd = T(1) / std::sqrt(sum_squares / static_cast<T>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i)
      y[i] = (x[i] - mean) * row_rstd;
    rstd[r] = row_rstd;
  }
}

template <typename T>
void layernorm_backward(T* dinp, const T* dout, const T* out, const T* rstd, int64_t rows,
                        int64_t dim) {
  FP8T_CHECK(rows >= 0, "expected rows >= 0, found {}", rows);
  FP8T_CHECK(dim > 0, "expected dim > 0, found {}", dim);
  for (int64_t r = 0; r < rows; ++r) {
    const T* dy = dout + r * dim;
    const T* y = out + r * dim;
    T* dx = dinp + r * dim;
    T sum_dy = 0, sum_dy_y = 0;
    for (int64_t i = 0; i < dim; ++i) {
      sum_dy += dy[i];
      sum_dy_y += dy[i] * y[i];
    }
    const T mean_dy = sum_dy / static_cast<T>(dim);
    const T mean_dy_y = sum_dy_y / static_cast<T>(dim);
    for (int64_t i = 0; i < dim; ++i)
      dx[i] += rstd[r] * (dy[i] - mean_dy - y[i] * mean_dy_y);
  }
}

template void layernorm_forward<float>(float*, float*, const float*, int64_t, int64_t, float);
template void layernorm_forward<double>(double*, double*, const double*, int64_t, int64_t, double);
template void layernorm_backward<float>(float*, const float*, const float*, const float*, int64_t,
                                        int64_t);
template void layernorm_backward<double>(double*, const double*, const double*, const double*,
                                         int64_t, int64_t);

}  // namespace fp8t::ops
