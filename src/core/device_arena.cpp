#if FP8TRAIN_WITH_CUDA

#include "core/device_arena.h"

#include <algorithm>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/error.h"

namespace fp8t {

DeviceArena::DeviceArena(std::string name) : name_(std::move(name)) {}

DeviceArena::~DeviceArena() {
  if (memory_ != nullptr) cudaFree(memory_);
}

void DeviceArena::allocate_planned() {
  FP8T_CHECK(memory_ == nullptr, "{}: allocated twice", name_);
  void* memory = nullptr;
  const cudaError_t status = cudaMalloc(&memory, std::max<size_t>(planned_, 1));
  if (status != cudaSuccess) {
    throw_allocation_failure(name_, planned_, status,
                             "lower micro_batch_size, sequence_len or depth");
  }
  memory_ = static_cast<std::byte*>(memory);
  used_ = 0;
}

void* DeviceArena::take_bytes(size_t bytes) {
  const size_t size = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (memory_ == nullptr) {
    planned_ += size;
    return nullptr;
  }
  FP8T_CHECK(used_ + size <= planned_, "{}: the plan left {} bytes, {} were asked for", name_,
             planned_ - used_, bytes);
  void* piece = memory_ + used_;
  used_ += size;
  return piece;
}

}  // namespace fp8t

#endif  // FP8TRAIN_WITH_CUDA
