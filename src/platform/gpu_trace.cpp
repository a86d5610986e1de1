#include "platform/gpu_trace.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include <nlohmann/json.hpp>

namespace fp8t {

namespace {

constexpr double kNsPerMs = 1e6;

double ms_between(uint64_t start_ns, uint64_t end_ns) {
  return end_ns > start_ns ? double(end_ns - start_ns) / kNsPerMs : 0.0;
}

// Adds `ms` to `name`'s entry.
void add_time(std::map<std::string, NamedTime>& times, const std::string& name, double ms) {
  NamedTime& entry = times[name];
  entry.name = name;
  ++entry.count;
  entry.ms += ms;
}

std::vector<NamedTime> largest(const std::map<std::string, NamedTime>& times, size_t top) {
  std::vector<NamedTime> sorted;
  sorted.reserve(times.size());
  for (const auto& [name, entry] : times)
    sorted.push_back(entry);
  // Longest first; equal times in name order, as the map holds them.
  std::sort(sorted.begin(), sorted.end(), [](const NamedTime& a, const NamedTime& b) {
    return a.ms != b.ms ? a.ms > b.ms : a.name < b.name;
  });
  if (sorted.size() > top) sorted.resize(top);
  return sorted;
}

std::string display_name(const TraceRecord& record) {
  return record.kind == TraceRecord::Kind::Kernel ? short_kernel_name(record.name) : record.name;
}

}  // namespace

std::string short_kernel_name(const std::string& name) {
  std::string text = name;
  static constexpr std::string_view kAnonymous = "(anonymous namespace)::";
  for (size_t at = text.find(kAnonymous); at != std::string::npos; at = text.find(kAnonymous))
    text.erase(at, kAnonymous.size());
  // Template arguments and parameter lists, at any depth, go; so does what precedes the name.
  std::string cut;
  int angle_depth = 0;
  for (const char c : text) {
    if (c == '<') {
      ++angle_depth;
    } else if (c == '>' && angle_depth > 0) {
      --angle_depth;
    } else if (angle_depth == 0) {
      if (c == '(') break;
      cut.push_back(c);
    }
  }
  const size_t space = cut.rfind(' ');
  return space == std::string::npos ? cut : cut.substr(space + 1);
}

TraceSummary summarize_trace(const std::vector<TraceRecord>& records, size_t top) {
  TraceSummary summary;
  std::vector<const TraceRecord*> gpu;
  std::unordered_map<uint32_t, const TraceRecord*> api_by_correlation;
  std::map<std::string, NamedTime> kernel_times, api_times, wait_times;
  for (const TraceRecord& record : records) {
    const double ms = ms_between(record.start_ns, record.end_ns);
    switch (record.kind) {
      case TraceRecord::Kind::Kernel:
        summary.kernel_ms += ms;
        ++summary.kernels;
        add_time(kernel_times, display_name(record), ms);
        break;
      case TraceRecord::Kind::Memcpy:
        summary.memcpy_ms += ms;
        ++summary.memcpys;
        break;
      case TraceRecord::Kind::Memset:
        summary.memset_ms += ms;
        ++summary.memsets;
        break;
      case TraceRecord::Kind::Api:
        add_time(api_times, record.name, ms);
        if (record.correlation != 0) {
          const TraceRecord*& issue = api_by_correlation[record.correlation];
          if (issue == nullptr || record.start_ns < issue->start_ns) issue = &record;
        }
        break;
    }
    if (record.on_gpu()) gpu.push_back(&record);
  }
  summary.top_kernels = largest(kernel_times, top);
  summary.top_api = largest(api_times, top);
  if (gpu.empty()) return summary;

  std::sort(gpu.begin(), gpu.end(),
            [](const TraceRecord* a, const TraceRecord* b) { return a->start_ns < b->start_ns; });
  const uint64_t first = gpu.front()->start_ns;
  uint64_t busy_until = first;  // the end of the busy interval being merged
  for (const TraceRecord* record : gpu) {
    if (record->start_ns > busy_until) {  // a gap: the GPU ran nothing in between
      const double gap_ms = ms_between(busy_until, record->start_ns);
      summary.idle_ms += gap_ms;
      ++summary.gaps;
      add_time(wait_times, display_name(*record), gap_ms);
      const auto issued = api_by_correlation.find(record->correlation);
      if (issued != api_by_correlation.end() && issued->second->start_ns > busy_until)
        summary.idle_waiting_for_host_ms += gap_ms;
    }
    busy_until = std::max(busy_until, record->end_ns);
  }
  summary.span_ms = ms_between(first, busy_until);
  summary.busy_ms = summary.span_ms - summary.idle_ms;
  summary.top_waits = largest(wait_times, top);
  return summary;
}

std::string chrome_trace_json(const std::vector<TraceRecord>& records) {
  uint64_t origin = UINT64_MAX;
  for (const TraceRecord& record : records)
    origin = std::min(origin, record.start_ns);
  constexpr int kGpuProcess = 0, kHostProcess = 1;
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", kGpuProcess},
                    {"args", {{"name", "GPU (one row per stream)"}}}});
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", kHostProcess},
                    {"args", {{"name", "host CUDA calls (one row per thread)"}}}});
  for (const TraceRecord& record : records) {
    static constexpr const char* kCategories[] = {"kernel", "memcpy", "memset", "api"};
    events.push_back({{"name", record.name},
                      {"cat", kCategories[static_cast<int>(record.kind)]},
                      {"ph", "X"},
                      {"ts", double(record.start_ns - origin) / 1e3},
                      {"dur", ms_between(record.start_ns, record.end_ns) * 1e3},
                      {"pid", record.on_gpu() ? kGpuProcess : kHostProcess},
                      {"tid", record.lane},
                      {"args", {{"correlation", record.correlation}}}});
  }
  return nlohmann::json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
}

}  // namespace fp8t
