#if FP8TRAIN_WITH_CUDA

#include "platform/cuda_trace.h"

#include <cxxabi.h>
#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>

#include <cuda_runtime_api.h>
#include <cupti.h>
#include <fmt/format.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "core/error.h"

namespace fp8t {

namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;
constexpr size_t kBufferAlignment = 8;  // CUPTI's records need 8-byte alignment

// CUPTI hands completed buffers to plain functions: the records of the one live trace gather
// here.
std::mutex records_mutex;
std::vector<TraceRecord>* active_records = nullptr;

// CUPTI's functions, from libcupti loaded on the first trace: only `--trace` needs it, so the
// binary starts where CUPTI is not on the loader's path (the toolkit keeps it apart at times).
struct Cupti {
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks;
  decltype(&cuptiActivityEnable) enable;
  decltype(&cuptiActivityDisable) disable;
  decltype(&cuptiActivityFlushAll) flush_all;
  decltype(&cuptiActivityGetNextRecord) next_record;
  decltype(&cuptiGetCallbackName) callback_name;
  decltype(&cuptiGetResultString) result_string;
};

const Cupti& cupti() {
  static const Cupti functions = [] {
    const std::string versioned = fmt::format("libcupti.so.{}", CUDART_VERSION / 1000);
    void* library = nullptr;
    std::string why;
    for (const char* name : {versioned.c_str(), "libcupti.so"}) {
      library = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (library != nullptr) break;
      const char* error = dlerror();
      why = error != nullptr ? error : name;
    }
    if (library == nullptr) {
      throw Error(fmt::format(
          "a GPU trace needs CUPTI ({} or libcupti.so), which did not load ({}): add the CUDA "
          "toolkit's folder that holds it (lib64, or extras/CUPTI/lib64) to LD_LIBRARY_PATH",
          versioned, why));
    }
    // Sets `function` to the library's function of that name.
    const auto find = [library](auto& function, const char* name) {
      void* found = dlsym(library, name);
      if (found == nullptr) throw Error(fmt::format("CUPTI: {} not found in libcupti", name));
      function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(found);
    };
    Cupti found;
    find(found.register_callbacks, "cuptiActivityRegisterCallbacks");
    find(found.enable, "cuptiActivityEnable");
    find(found.disable, "cuptiActivityDisable");
    find(found.flush_all, "cuptiActivityFlushAll");
    find(found.next_record, "cuptiActivityGetNextRecord");
    find(found.callback_name, "cuptiGetCallbackName");
    find(found.result_string, "cuptiGetResultString");
    return found;
  }();
  return functions;
}

void check_cupti(CUptiResult result, const char* call) {
  if (result == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cupti().result_string(result, &text);
  throw Error(fmt::format("CUPTI: {} failed: {}", call, text != nullptr ? text : "unknown error"));
}
#define FP8T_CUPTI_CHECK(call) check_cupti((call), #call)

constexpr CUpti_ActivityKind kRecordedKinds[] = {
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
    CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};

std::string demangled(const char* name) {
  if (name == nullptr) return "kernel";
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> text(
      abi::__cxa_demangle(name, nullptr, nullptr, &status), &std::free);
  return status == 0 && text ? std::string(text.get()) : std::string(name);
}

const char* copy_kind_name(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
      return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
      return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
      return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH:
      return "memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP:
      return "memcpy PtoP";
    default:
      return "memcpy";
  }
}

std::string api_name(const CUpti_ActivityAPI& api) {
  const CUpti_CallbackDomain domain = api.kind == CUPTI_ACTIVITY_KIND_RUNTIME
                                          ? CUPTI_CB_DOMAIN_RUNTIME_API
                                          : CUPTI_CB_DOMAIN_DRIVER_API;
  const char* name = nullptr;
  if (cupti().callback_name(domain, api.cbid, &name) != CUPTI_SUCCESS || name == nullptr)
    return fmt::format("CUDA call {}", api.cbid);
  // CUPTI names the version a call came with ("cudaMemsetAsync_v3020"); the call is enough.
  std::string text = name;
  const size_t version = text.rfind("_v");
  if (version != std::string::npos && version + 2 < text.size() &&
      text.find_first_not_of("0123456789", version + 2) == std::string::npos)
    text.erase(version);
  return text;
}

std::optional<TraceRecord> to_record(const CUpti_Activity& activity) {
  switch (activity.kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const auto& kernel = reinterpret_cast<const CUpti_ActivityKernel10&>(activity);
      return TraceRecord{
          TraceRecord::Kind::Kernel, demangled(kernel.name), kernel.start, kernel.end,
          kernel.streamId,           kernel.correlationId};
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto& copy = reinterpret_cast<const CUpti_ActivityMemcpy6&>(activity);
      return TraceRecord{TraceRecord::Kind::Memcpy,
                         copy_kind_name(copy.copyKind),
                         copy.start,
                         copy.end,
                         copy.streamId,
                         copy.correlationId};
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const auto& set = reinterpret_cast<const CUpti_ActivityMemset4&>(activity);
      return TraceRecord{TraceRecord::Kind::Memset, "memset", set.start, set.end, set.streamId,
                         set.correlationId};
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
      const auto& api = reinterpret_cast<const CUpti_ActivityAPI&>(activity);
      return TraceRecord{TraceRecord::Kind::Api, api_name(api),    api.start, api.end,
                         api.threadId,           api.correlationId};
    }
    default:
      return std::nullopt;
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kBufferAlignment, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid_bytes) {
  {
    std::lock_guard<std::mutex> lock(records_mutex);
    CUpti_Activity* activity = nullptr;
    while (active_records != nullptr &&
           cupti().next_record(buffer, valid_bytes, &activity) == CUPTI_SUCCESS) {
      if (std::optional<TraceRecord> record = to_record(*activity))
        active_records->push_back(std::move(*record));
    }
  }
  std::free(buffer);
}

void stop_recording() {
  for (const CUpti_ActivityKind kind : kRecordedKinds)
    cupti().disable(kind);
}

// Stops recording and hands the buffers still held to buffer_completed, then detaches the records
// of the trace, whatever fails on the way.
void end_trace() {
  struct Detach {
    ~Detach() {
      std::lock_guard<std::mutex> lock(records_mutex);
      active_records = nullptr;
    }
  } detach;
  stop_recording();
  FP8T_CUPTI_CHECK(cupti().flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
}

}  // namespace

CudaTrace::CudaTrace() {
  const Cupti& functions = cupti();
  {
    std::lock_guard<std::mutex> lock(records_mutex);
    FP8T_CHECK(active_records == nullptr, "expected one CUDA trace at a time, found two");
    active_records = &records_;
  }
  try {
    FP8T_CUPTI_CHECK(functions.register_callbacks(buffer_requested, buffer_completed));
    for (const CUpti_ActivityKind kind : kRecordedKinds)
      FP8T_CUPTI_CHECK(functions.enable(kind));
    // CUPTI sets itself up on the first calls it records, milliseconds in which the GPU would
    // look idle before the traced work: a throwaway buffer (its allocation, memset and free)
    // takes that time first, and its records are dropped.
    { const DeviceBuffer<uint8_t> scratch(1); }
    FP8T_CUDA_CHECK(cudaDeviceSynchronize());
    FP8T_CUPTI_CHECK(functions.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
    std::lock_guard<std::mutex> lock(records_mutex);
    records_.clear();
  } catch (...) {
    stop_recording();
    functions.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);  // none left for the next trace
    std::lock_guard<std::mutex> lock(records_mutex);
    active_records = nullptr;
    throw;
  }
}

CudaTrace::~CudaTrace() {
  if (!recording_) return;
  try {
    end_trace();
  } catch (const Error&) {  // a destructor does not throw; the trace is being dropped anyway
  }
}

std::vector<TraceRecord> CudaTrace::finish() {
  FP8T_CHECK(recording_, "expected a recording CUDA trace, found it finished");
  FP8T_CUDA_CHECK(cudaDeviceSynchronize());
  recording_ = false;
  end_trace();
  return std::move(records_);
}

}  // namespace fp8t

#endif
