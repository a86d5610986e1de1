// Small owners of CUDA resources the GPU engines and benchmarks share (CUDA builds only): a
// stream, timing events, pinned host floats for results read after a synchronization, and the
// device memory in use.
#pragma once

#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"

namespace fp8t {

// The current device's multiprocessor count.
inline int multiprocessor_count() {
  int device = 0;
  FP8T_CUDA_CHECK(cudaGetDevice(&device));
  int count = 0;
  FP8T_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

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

// Events recorded on a stream to time the work between them.
class TimingEvents {
 public:
  explicit TimingEvents(int count) : events_(static_cast<size_t>(count)) {
    for (cudaEvent_t& event : events_)
      FP8T_CUDA_CHECK(cudaEventCreate(&event));
  }
  ~TimingEvents() {
    for (cudaEvent_t event : events_)
      cudaEventDestroy(event);
  }
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;
  void record(int index, cudaStream_t stream) {
    FP8T_CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(index)], stream));
  }
  void synchronize(int index) const {
    FP8T_CUDA_CHECK(cudaEventSynchronize(events_[static_cast<size_t>(index)]));
  }
  // Milliseconds from event `from` to event `to`, both recorded and complete.
  double ms(int from, int to) const {
    float elapsed = 0.0f;
    FP8T_CUDA_CHECK(cudaEventElapsedTime(&elapsed, events_[static_cast<size_t>(from)],
                                         events_[static_cast<size_t>(to)]));
    return elapsed;
  }

 private:
  std::vector<cudaEvent_t> events_;
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
