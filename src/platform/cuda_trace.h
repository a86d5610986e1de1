// What the GPU runs while a CudaTrace lives, recorded through CUPTI's activity API (CUDA builds
// only): every kernel, copy and memset with its GPU timestamps, and every CUDA runtime and
// driver call with its host ones, on one clock. `bench --trace` takes one step this way.
// Recording slows the host's calls a little, so a traced step is not a timed one.
#pragma once

#include <vector>

#include "platform/gpu_trace.h"

namespace fp8t {

class CudaTrace {
 public:
  // Starts recording, after waiting for the device. One trace at a time per process; a second
  // throws fp8t::Error.
  CudaTrace();
  // Stops recording, if finish() has not.
  ~CudaTrace();
  CudaTrace(const CudaTrace&) = delete;
  CudaTrace& operator=(const CudaTrace&) = delete;

  // Waits for the device, stops recording and returns every record since construction, GPU
  // records tied to the runtime or driver calls that issued them (TraceRecord::correlation).
  std::vector<TraceRecord> finish();

 private:
  bool recording_ = true;
  std::vector<TraceRecord> records_;  // filled by CUPTI's buffer callbacks
};

}  // namespace fp8t
