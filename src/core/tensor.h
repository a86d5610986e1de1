// A non-owning view of device or host memory with a dtype, a shape and strides. FP8 tensors
// carry their scaling metadata. Memory comes from an Arena sized up front from a plan.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "core/error.h"
#include "numerics/float_bits.h"
#include "numerics/formats.h"

namespace fp8t {

enum class DType : uint8_t { F32, BF16, E4M3, E5M2, E4M3FNUZ, E5M2FNUZ, I32, I64 };
enum class Device : uint8_t { Cpu, Cuda };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);
std::optional<Fp8Format> fp8_format_of(DType dtype);  // nothing for non-FP8 dtypes
DType dtype_of(Fp8Format format);                     // the storage dtype of an FP8 data format

template <typename T>
constexpr DType dtype_for();
template <>
constexpr DType dtype_for<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_for<bf16>() {
  return DType::BF16;
}
template <>
constexpr DType dtype_for<int32_t>() {
  return DType::I32;
}
template <>
constexpr DType dtype_for<int64_t>() {
  return DType::I64;
}

// The scaling state that travels with FP8 data: a per-tensor scale_inv and amax, or block
// scales, and an optional transposed copy (for the dgrad and wgrad GEMMs) with its own scales.
struct Fp8Meta {
  float* scale_inv = nullptr;     // per-tensor recipes
  float* amax = nullptr;          // per-tensor recipes
  void* block_scales = nullptr;   // blockwise (fp32 scale_inv) or mxfp8 (E8M0 bytes)
  uint8_t* transposed = nullptr;  // [cols, rows] copy, when made
  void* transposed_scales = nullptr;
};

class TensorView {
 public:
  static constexpr int kMaxRank = 4;

  TensorView() = default;
  // A contiguous (row-major) view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape,
             Device device = Device::Cpu);
  TensorView(void* data, DType dtype, const int64_t* shape, int rank, Device device = Device::Cpu);

  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int rank() const { return rank_; }
  int64_t dim(int index) const;
  int64_t stride(int index) const;
  int64_t numel() const;
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;

  void* raw() const { return data_; }
  // Typed access; throws when T does not match the dtype.
  template <typename T>
  T* data() const {
    FP8T_CHECK(dtype_for<T>() == dtype_, "expected dtype {}, found {}", dtype_name(dtype_for<T>()),
               dtype_name(dtype_));
    return static_cast<T*>(data_);
  }
  uint8_t* fp8_data() const;  // FP8 dtypes only

  // The same memory under another contiguous shape with the same element count.
  TensorView reshaped(std::initializer_list<int64_t> shape) const;

  const Fp8Meta& fp8() const { return fp8_; }
  Fp8Meta& fp8() { return fp8_; }

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Device device_ = Device::Cpu;
  int rank_ = 0;
  std::array<int64_t, kMaxRank> shape_{};
  std::array<int64_t, kMaxRank> strides_{};
  Fp8Meta fp8_;
};

// A tensor under the name a checkpoint keeps it by (parameters, optimizer and scaling state).
struct NamedTensor {
  std::string name;
  TensorView view;
};

}  // namespace fp8t
