#include "core/tensor.h"

namespace fp8t {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::E4M3:
    case DType::E5M2:
    case DType::E4M3FNUZ:
    case DType::E5M2FNUZ:
      return 1;
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::E4M3:
      return "e4m3";
    case DType::E5M2:
      return "e5m2";
    case DType::E4M3FNUZ:
      return "e4m3fnuz";
    case DType::E5M2FNUZ:
      return "e5m2fnuz";
    case DType::I32:
      return "i32";
    case DType::I64:
      return "i64";
  }
  return "?";
}

std::optional<Fp8Format> fp8_format_of(DType dtype) {
  switch (dtype) {
    case DType::E4M3:
      return Fp8Format::E4M3;
    case DType::E5M2:
      return Fp8Format::E5M2;
    case DType::E4M3FNUZ:
      return Fp8Format::E4M3FNUZ;
    case DType::E5M2FNUZ:
      return Fp8Format::E5M2FNUZ;
    default:
      return std::nullopt;
  }
}

DType dtype_of(Fp8Format format) {
  switch (format) {
    case Fp8Format::E4M3:
      return DType::E4M3;
    case Fp8Format::E5M2:
      return DType::E5M2;
    case Fp8Format::E4M3FNUZ:
      return DType::E4M3FNUZ;
    case Fp8Format::E5M2FNUZ:
      return DType::E5M2FNUZ;
    case Fp8Format::E8M0:
      break;
  }
  throw Error("e8m0 is a scale format: no tensor stores e8m0 data");
}

TensorView::TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device)
    : TensorView(data, dtype, shape.begin(), static_cast<int>(shape.size()), device) {}

TensorView::TensorView(void* data, DType dtype, const int64_t* shape, int rank, Device device)
    : data_(data), dtype_(dtype), device_(device), rank_(rank) {
  FP8T_CHECK(rank >= 0 && rank <= kMaxRank, "expected a rank of at most {}, found {}", kMaxRank,
             rank);
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    FP8T_CHECK(shape[i] >= 0, "expected non-negative dimensions, found {} at dimension {}",
               shape[i], i);
    shape_[static_cast<size_t>(i)] = shape[i];
    strides_[static_cast<size_t>(i)] = stride;
    stride *= shape[i];
  }
}

int64_t TensorView::dim(int index) const {
  FP8T_CHECK(index >= 0 && index < rank_, "expected a dimension index below {}, found {}", rank_,
             index);
  return shape_[static_cast<size_t>(index)];
}

int64_t TensorView::stride(int index) const {
  FP8T_CHECK(index >= 0 && index < rank_, "expected a dimension index below {}, found {}", rank_,
             index);
  return strides_[static_cast<size_t>(index)];
}

int64_t TensorView::numel() const {
  int64_t count = 1;
  for (int i = 0; i < rank_; ++i)
    count *= shape_[static_cast<size_t>(i)];
  return count;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int i = rank_ - 1; i >= 0; --i) {
    if (shape_[static_cast<size_t>(i)] != 1 && strides_[static_cast<size_t>(i)] != stride)
      return false;
    stride *= shape_[static_cast<size_t>(i)];
  }
  return true;
}

uint8_t* TensorView::fp8_data() const {
  FP8T_CHECK(fp8_format_of(dtype_).has_value(), "expected an FP8 dtype, found {}",
             dtype_name(dtype_));
  return static_cast<uint8_t*>(data_);
}

TensorView TensorView::reshaped(std::initializer_list<int64_t> shape) const {
  FP8T_CHECK(is_contiguous(), "reshaped() needs a contiguous view");
  TensorView view(data_, dtype_, shape, device_);
  FP8T_CHECK(view.numel() == numel(), "expected {} elements in the new shape, found {}", numel(),
             view.numel());
  view.fp8_ = fp8_;
  return view;
}

}  // namespace fp8t
