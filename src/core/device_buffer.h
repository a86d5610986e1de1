// Device memory owned by one scope (CUDA builds only). It starts poisoned, so that an output a
// kernel fails to write cannot match an expected value by chance.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"

namespace fp8t {

template <typename T>
class DeviceBuffer {
 public:
  static constexpr unsigned char kPoison = 0xA5;

  explicit DeviceBuffer(size_t count) : count_(count) {
    const size_t bytes = std::max<size_t>(1, count) * sizeof(T);
    const cudaError_t status = cudaMalloc(reinterpret_cast<void**>(&data_), bytes);
    if (status != cudaSuccess) {
      throw_allocation_failure(fmt::format("a buffer of {} elements", count), bytes, status);
    }
    poison();
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    upload(host.data());
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return data_; }
  size_t count() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  void poison() {
    FP8T_CUDA_CHECK(cudaMemset(data_, kPoison, std::max<size_t>(1, count_) * sizeof(T)));
  }
  void zero() { FP8T_CUDA_CHECK(cudaMemset(data_, 0, bytes())); }
  void upload(const T* host) {
    FP8T_CUDA_CHECK(cudaMemcpy(data_, host, bytes(), cudaMemcpyHostToDevice));
  }
  // Waits for all device work first, so that kernels on any stream have finished writing.
  std::vector<T> download() const {
    std::vector<T> host(count_);
    FP8T_CUDA_CHECK(cudaDeviceSynchronize());
    FP8T_CUDA_CHECK(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t count_;
};

}  // namespace fp8t
