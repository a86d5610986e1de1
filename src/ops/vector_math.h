// Small vector helpers shared by the CPU ops.
#pragma once

#include <cstdint>

namespace fp8t::ops {

// sum a[i] * b[i], accumulated in T.
template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T sum = 0;
  for (int64_t i = 0; i < n; ++i)
    sum += a[i] * b[i];
  return sum;
}

}  // namespace fp8t::ops
