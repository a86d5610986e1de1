// Checking of CUDA runtime calls and kernel launches (CUDA builds only).
#pragma once

#include <cstddef>
#include <string>

#include <cuda_runtime_api.h>

#include "core/error.h"

namespace fp8t {

[[noreturn]] inline void throw_cuda_failure(const char* file, int line, const char* statement,
                                            cudaError_t status) {
  const std::string message =
      fmt::format("{}:{}: CUDA call '{}' failed: {} ({})", file, line, statement,
                  cudaGetErrorString(status), cudaGetErrorName(status));
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // an allocation's failure is no sticky error: clear it
    throw DeviceOutOfMemory(message);
  }
  throw Error(message);
}

// A failed cudaMalloc of `bytes` for `what`: the bytes asked for, the device's free memory, and
// `advice` when given. DeviceOutOfMemory when the device lacks the memory, else Error.
[[noreturn]] inline void throw_allocation_failure(const std::string& what, size_t bytes,
                                                  cudaError_t status,
                                                  const std::string& advice = {}) {
  size_t free = 0, total = 0;
  cudaGetLastError();  // an allocation's failure is no sticky error: clear it
  cudaMemGetInfo(&free, &total);
  constexpr double kGiB = 1 << 30;
  const std::string message = fmt::format(
      "cannot allocate {:.2f} GiB ({} bytes) of GPU memory for {}: {} ({:.2f} GiB free of {:.2f} "
      "GiB){}{}",
      double(bytes) / kGiB, bytes, what, cudaGetErrorString(status), double(free) / kGiB,
      double(total) / kGiB, advice.empty() ? "" : "; ", advice);
  if (status == cudaErrorMemoryAllocation) throw DeviceOutOfMemory(message);
  throw Error(message);
}

}  // namespace fp8t

#define FP8T_CUDA_CHECK(call)                                              \
  do {                                                                     \
    const cudaError_t fp8t_status_ = (call);                               \
    if (fp8t_status_ != cudaSuccess) {                                     \
      ::fp8t::throw_cuda_failure(__FILE__, __LINE__, #call, fp8t_status_); \
    }                                                                      \
  } while (false)

// After a kernel launch: reports launch-configuration errors at the launch site.
#define FP8T_CUDA_CHECK_LAUNCH() FP8T_CUDA_CHECK(cudaGetLastError())
