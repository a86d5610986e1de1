// A parameter type that template argument deduction skips, as C++20's std::type_identity_t,
// spelled so that the C++17 CUDA sources can include the headers that use it.
#pragma once

namespace fp8t {

template <typename T>
struct NonDeducedHolder {
  using type = T;
};
template <typename T>
using NonDeduced = typename NonDeducedHolder<T>::type;

}  // namespace fp8t
