// Small owners of CUDA resources the GPU engines and benchmarks share (CUDA builds only): a
// stream, pinned host floats for results read after a synchronization, and the device memory in
// use.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"

namespace fp8t {

// Device memory in use (the CUDA context and the libraries' workspaces included).
inline double device_memory_in_use() {
  size_t free = 0, total = 0;
  FP8T_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return double(total - free);
}

class CudaStream {
 public:
  CudaStream() { FP8T_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~CudaStream() { cudaStreamDestroy(stream_); }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// A few floats the device writes and the host reads after a synchronization.
class PinnedFloats {
 public:
  explicit PinnedFloats(size_t count) {
    FP8T_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&data_), count * sizeof(float)));
  }
  ~PinnedFloats() { cudaFreeHost(data_); }
  PinnedFloats(const PinnedFloats&) = delete;
  PinnedFloats& operator=(const PinnedFloats&) = delete;
  float* data() const { return data_; }

 private:
  float* data_ = nullptr;
};

}  // namespace fp8t
