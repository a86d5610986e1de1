// The losses of a step's micro-batches on the GPU path (CUDA builds): each is copied to pinned
// host memory as its forward ends and summed once the stream is synchronized anyway, so that the
// micro-batches follow each other on the GPU without waiting for the host between them.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"

namespace fp8t::train {

class MicroBatchLosses {
 public:
  MicroBatchLosses() : host_(kCapacity) {}

  // Queues the copy of the device float `loss` on the stream, behind the forward that wrote it
  // (the next forward may overwrite it). When the buffer is full, first waits and sums it.
  void add(const float* loss, cudaStream_t stream) {
    if (pending_ == kCapacity) sum_ = take(stream);  // carried into the next take()
    FP8T_CUDA_CHECK(cudaMemcpyAsync(host_.data() + pending_, loss, sizeof(float),
                                    cudaMemcpyDeviceToHost, stream));
    ++pending_;
  }

  // Waits for the stream and returns the sum of the losses added since the last take().
  double take(cudaStream_t stream) {
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
    double sum = sum_;
    for (size_t i = 0; i < pending_; ++i)
      sum += host_.data()[i];
    sum_ = 0.0;
    pending_ = 0;
    return sum;
  }

 private:
  static constexpr size_t kCapacity = 64;
  PinnedFloats host_;
  size_t pending_ = 0;
  double sum_ = 0.0;
};

}  // namespace fp8t::train
