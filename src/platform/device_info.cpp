#include "platform/device_info.h"

#include <dlfcn.h>

#include <cstddef>
#include <initializer_list>
#include <memory>
#include <optional>

#include <fmt/format.h>

#if FP8TRAIN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#endif

namespace fp8t {

std::string GpuInfo::architecture() const {
  return fmt::format("sm_{}{}", compute_capability_major, compute_capability_minor);
}

bool GpuInfo::has_fp8_gemm() const {
  return compute_capability_major > 8 ||
         (compute_capability_major == 8 && compute_capability_minor >= 9);
}

std::string fp8_architecture(const std::vector<GpuInfo>& gpus) {
  return gpus.empty() ? std::string("cpu") : gpus.front().architecture();
}

namespace {

struct LibraryCloser {
  void operator()(void* handle) const { dlclose(handle); }
};
using LibraryHandle = std::unique_ptr<void, LibraryCloser>;

// Calls a version function found by dlsym: its version code, or nothing when it reports failure.
using VersionCall = std::optional<long long> (*)(void* function);

std::optional<long long> call_size_t_version(void* function) {  // cublasLt/cudnnGetVersion
  return static_cast<long long>(reinterpret_cast<size_t (*)()>(function)());
}

std::optional<long long> call_nccl_version(void* function) {
  int code = 0;
  const int result = reinterpret_cast<int (*)(int*)>(function)(&code);
  if (result != 0) return std::nullopt;  // not ncclSuccess
  return code;
}

// These libraries encode major * unit + minor * 100 + patch, where the unit grew from 1000 to
// 10000 at some release (cuBLAS 12, cuDNN 9, NCCL 2.9); codes from `first_wide_code` on use 10000.
LibraryVersion find_library(std::initializer_list<const char*> sonames, const char* version_symbol,
                            VersionCall call_version, long long first_wide_code) {
  for (const char* soname : sonames) {
    const LibraryHandle handle(dlopen(soname, RTLD_LAZY | RTLD_LOCAL));
    if (!handle) continue;
    void* version_function = dlsym(handle.get(), version_symbol);
    if (version_function == nullptr) continue;
    const std::optional<long long> code = call_version(version_function);
    if (!code) continue;
    const long long unit = *code >= first_wide_code ? 10000 : 1000;
    return {soname, fmt::format("{}.{}.{}", *code / unit, *code % unit / 100, *code % 100)};
  }
  return {};
}

#if FP8TRAIN_WITH_CUDA
// The CUDA runtime and driver encode versions as major * 1000 + minor * 10.
std::string cuda_version_text(int code) {
  return fmt::format("{}.{}", code / 1000, code % 1000 / 10);
}
#endif

}  // namespace

std::vector<GpuInfo> query_gpus() {
#if FP8TRAIN_WITH_CUDA
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver) {
    // No GPU is a supported configuration, not an error; clear the runtime's last error so that
    // a later launch check does not report it.
    static_cast<void>(cudaGetLastError());
    return {};
  }
  if (status != cudaSuccess) throw_cuda_failure(__FILE__, __LINE__, "cudaGetDeviceCount", status);
  std::vector<GpuInfo> gpus;
  for (int index = 0; index < count; ++index) {
    cudaDeviceProp properties{};
    FP8T_CUDA_CHECK(cudaGetDeviceProperties(&properties, index));
    gpus.push_back({.index = index,
                    .name = properties.name,
                    .compute_capability_major = properties.major,
                    .compute_capability_minor = properties.minor,
                    .memory_bytes = properties.totalGlobalMem,
                    .sm_count = properties.multiProcessorCount});
  }
  return gpus;
#else
  return {};
#endif
}

LibraryVersions query_library_versions() {
  return {
      .cublaslt = find_library({"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"},
                               "cublasLtGetVersion", call_size_t_version, 100000),
      .cudnn = find_library({"libcudnn.so.9", "libcudnn.so"}, "cudnnGetVersion",
                            call_size_t_version, 10000),
      .nccl =
          find_library({"libnccl.so.2", "libnccl.so"}, "ncclGetVersion", call_nccl_version, 10000),
  };
}

DeviceInfo query_device_info() {
  DeviceInfo info;
#if FP8TRAIN_WITH_CUDA
  info.built_with_cuda = true;
  int runtime_version = 0;
  int driver_version = 0;
  FP8T_CUDA_CHECK(cudaRuntimeGetVersion(&runtime_version));
  FP8T_CUDA_CHECK(cudaDriverGetVersion(&driver_version));  // 0 when no driver is installed
  info.cuda_runtime_version = cuda_version_text(runtime_version);
  if (driver_version != 0) info.cuda_driver_version = cuda_version_text(driver_version);
#endif
  info.gpus = query_gpus();
  info.libraries = query_library_versions();
  return info;
}

}  // namespace fp8t
