// Checking of CUDA runtime calls and kernel launches (CUDA builds only).
#pragma once

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
