#include "core/arena.h"

#include <algorithm>
#include <new>

namespace fp8t {

void Arena::AlignedFree::operator()(std::byte* pointer) const {
  ::operator delete[](pointer, std::align_val_t{kAlignment});
}

Arena::Arena(std::string name, size_t bytes) : name_(std::move(name)), capacity_(bytes) {
  try {
    memory_.reset(static_cast<std::byte*>(
        ::operator new[](std::max<size_t>(bytes, 1), std::align_val_t{kAlignment})));
  } catch (const std::bad_alloc&) {
    throw Error(fmt::format("cannot allocate {:.1f} MiB of host memory for {}",
                            double(bytes) / (1 << 20), name_));
  }
}

size_t Arena::footprint(DType dtype, int64_t numel) {
  const size_t bytes = static_cast<size_t>(numel) * dtype_size(dtype);
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

TensorView Arena::allocate(DType dtype, std::initializer_list<int64_t> shape) {
  TensorView view(nullptr, dtype, shape);
  const size_t size = footprint(dtype, view.numel());
  if (used_ + size > capacity_) {
    throw Error(fmt::format("{}: the plan left {} bytes, a [{}] {} tensor needs {}", name_,
                            capacity_ - used_, fmt::join(shape, ", "), dtype_name(dtype), size));
  }
  TensorView placed(memory_.get() + used_, dtype, shape);
  used_ += size;
  return placed;
}

}  // namespace fp8t
