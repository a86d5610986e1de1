// One allocation per memory category, sized up front from a plan and cut into tensors, so
// that a run never allocates in its loop and can say what it uses before it starts.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace fp8t {

class Arena {
 public:
  static constexpr size_t kAlignment = 256;  // cuBLASLt and vector loads want aligned bases

  // Host memory (Device::Cpu); the CUDA path adds device arenas.
  Arena(std::string name, size_t bytes);
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // The next aligned piece; throws, naming the arena, when the plan was too small.
  TensorView allocate(DType dtype, std::initializer_list<int64_t> shape);

  const std::string& name() const { return name_; }
  size_t capacity() const { return capacity_; }
  size_t used() const { return used_; }

  // Bytes a tensor takes in an arena, alignment included: what a plan adds up.
  static size_t footprint(DType dtype, int64_t numel);

 private:
  struct AlignedFree {
    void operator()(std::byte* pointer) const;
  };
  std::string name_;
  size_t capacity_;
  size_t used_ = 0;
  std::unique_ptr<std::byte, AlignedFree> memory_;
};

}  // namespace fp8t
