// A timeline of what the GPU ran during a stretch of work (kernels, copies, memsets) and of the
// CUDA API calls that issued it, as CUPTI records it (platform/cuda_trace.h), and what it says: how
// long the GPU sat idle between its first and last record, and whether it was waiting for the
// host to issue the next piece of work. Plain C++: tests build timelines by hand.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp8t {

struct TraceRecord {
  enum class Kind : uint8_t {
    Kernel,
    Memcpy,
    Memset,
    Api,  // a CUDA runtime or driver call on the host
  };
  Kind kind = Kind::Kernel;
  std::string name;  // the kernel (demangled), "memcpy HtoD", "memset", the API function
  uint64_t start_ns = 0, end_ns = 0;
  // GPU records: the stream; API records: the host thread.
  uint32_t lane = 0;
  // Ties a GPU record to the API call that issued it (0: none known); where several API records
  // share it (a runtime call and a driver call inside it), the one that began first.
  uint32_t correlation = 0;

  bool on_gpu() const { return kind != Kind::Api; }
};

// Time on a name: how often, and how long in all.
struct NamedTime {
  std::string name;
  int64_t count = 0;
  double ms = 0.0;
};

struct TraceSummary {
  double span_ms = 0.0;  // the first GPU record's start to the last one's end
  double busy_ms = 0.0;  // the union of the GPU records within it
  double idle_ms = 0.0;  // span_ms − busy_ms
  // Of idle_ms: the gaps after which the GPU's next record was issued by the host only once the
  // gap had begun, so the GPU waited for the host (launch overhead, host work, synchronization).
  double idle_waiting_for_host_ms = 0.0;
  int64_t gaps = 0;  // idle intervals
  double kernel_ms = 0.0, memcpy_ms = 0.0, memset_ms = 0.0;
  int64_t kernels = 0, memcpys = 0, memsets = 0;
  std::vector<NamedTime> top_kernels;  // by time, the most first
  std::vector<NamedTime> top_api;      // host API calls by time
  // Idle time by the GPU record that ended each gap: what the GPU was waiting to start.
  std::vector<NamedTime> top_waits;
};

// `top` entries per list. Records in any order.
TraceSummary summarize_trace(const std::vector<TraceRecord>& records, size_t top = 10);

// A Chrome trace (the JSON that chrome://tracing and Perfetto open): GPU records per stream,
// API calls per host thread, microseconds from the first record.
std::string chrome_trace_json(const std::vector<TraceRecord>& records);

// A kernel's name cut to what tells kernels apart in a table: no return type, template arguments
// or parameters ("void fp8t::ops::cuda::k<1>(float*)" becomes "fp8t::ops::cuda::k").
std::string short_kernel_name(const std::string& name);

}  // namespace fp8t
