// What this machine offers for FP8 training: the GPUs, the CUDA runtime and driver, and the
// NVIDIA libraries present at run time. Plain C++ (no CUDA headers), so every target can use it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp8t {

struct GpuInfo {
  int index = 0;
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  uint64_t memory_bytes = 0;
  int sm_count = 0;

  std::string architecture() const;  // "sm_90"
  // FP8 tensor-core GEMMs need compute capability 8.9 (Ada) or newer.
  bool has_fp8_gemm() const;
};

// A shared library looked up with dlopen; found() is false when no candidate name loaded.
struct LibraryVersion {
  std::string soname;   // the name that loaded, e.g. "libcublasLt.so.13"
  std::string version;  // "13.1.0"

  bool found() const { return !soname.empty(); }
};

struct LibraryVersions {
  LibraryVersion cublaslt;
  LibraryVersion cudnn;
  LibraryVersion nccl;
};

struct DeviceInfo {
  bool built_with_cuda = false;
  std::string cuda_runtime_version;  // "13.0"; empty without CUDA in the build
  std::string cuda_driver_version;   // the CUDA version the driver supports; empty without one
  std::vector<GpuInfo> gpus;         // empty without CUDA in the build or without a GPU
  LibraryVersions libraries;
};

// The GPUs the CUDA runtime sees: none without CUDA in the build, without a driver or without
// a device. Throws fp8t::Error when the runtime fails for any other reason.
std::vector<GpuInfo> query_gpus();

// cuBLASLt, cuDNN and NCCL, loaded by soname and asked for their version.
LibraryVersions query_library_versions();

DeviceInfo query_device_info();

// The architecture name fp8t::resolve_family() takes: GPU 0's "sm_NN", or "cpu" without a GPU.
std::string fp8_architecture(const std::vector<GpuInfo>& gpus);

}  // namespace fp8t
