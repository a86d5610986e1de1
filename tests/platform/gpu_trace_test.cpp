// What a GPU timeline says: the idle gaps between the GPU's records, which of them waited for
// the host, the time per kernel and per API call, and the Chrome trace of it.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <random>
#include <string>
#include <vector>

#include "platform/gpu_trace.h"

namespace fp8t {
namespace {

using Kind = TraceRecord::Kind;

constexpr uint64_t kMicrosecond = 1000;  // ns
constexpr double kUs = 1e-3;             // ms

TraceRecord record(Kind kind, std::string name, uint64_t start_us, uint64_t end_us, uint32_t lane,
                   uint32_t correlation) {
  return {kind, std::move(name), start_us * kMicrosecond, end_us * kMicrosecond, lane, correlation};
}

// A timeline with two gaps, starting at `origin` µs: kernels a [0, 10) and b [15, 25) on stream
// 7, a memset [25, 30), then kernel c [40, 50) on stream 7 beside a copy [45, 60) on stream 8.
// b's runtime call began at 11, after the GPU went idle at 10: that gap waited for the host.
// c's driver call began at 20, long before its gap: it did not.
std::vector<TraceRecord> two_gap_timeline(uint64_t origin) {
  const auto at = [origin](uint64_t us) { return origin + us; };
  return {
      record(Kind::Api, "cuLaunchKernel", at(0) - 5, at(0) - 2, 1, 1),
      record(Kind::Kernel, "void fp8t::(anonymous namespace)::a<float, 4>(float*, int)", at(0),
             at(10), 7, 1),
      record(Kind::Api, "cuLaunchKernel", at(12), at(14), 1, 2),
      // The runtime call around it, begun earlier: b's issue.
      record(Kind::Api, "cudaLaunchKernel", at(11), at(14), 1, 2),
      record(Kind::Kernel, "b_kernel", at(15), at(25), 7, 2),
      record(Kind::Api, "cuMemsetD8Async", at(1), at(3), 1, 3),
      record(Kind::Memset, "memset", at(25), at(30), 7, 3),
      record(Kind::Api, "cuLaunchKernel", at(20), at(22), 1, 4),
      record(Kind::Kernel, "void fp8t::(anonymous namespace)::a<float, 8>(float*, int)", at(40),
             at(50), 7, 4),
      record(Kind::Api, "cuMemcpyAsync", at(21), at(23), 1, 5),
      record(Kind::Memcpy, "memcpy DtoD", at(45), at(60), 8, 5),
      record(Kind::Api, "cudaStreamSynchronize", at(30), at(60), 1, 6),
  };
}

TEST(GpuTrace, SummaryFindsTheGapsAndWhichWaitedForTheHost) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 generator(seed);
  const uint64_t origin = 1000 + generator() % 1000000;
  std::vector<TraceRecord> records = two_gap_timeline(origin);
  std::shuffle(records.begin(), records.end(), generator);  // any order
  const TraceSummary summary = summarize_trace(records);

  EXPECT_NEAR(summary.span_ms, 60 * kUs, 1e-9);
  EXPECT_NEAR(summary.idle_ms, 15 * kUs, 1e-9);  // [10, 15) and [30, 40)
  EXPECT_NEAR(summary.busy_ms, 45 * kUs, 1e-9);
  EXPECT_EQ(summary.gaps, 2);
  EXPECT_NEAR(summary.idle_waiting_for_host_ms, 5 * kUs, 1e-9);  // all of [10, 15)
  EXPECT_EQ(summary.kernels, 3);
  EXPECT_NEAR(summary.kernel_ms, 30 * kUs, 1e-9);
  EXPECT_EQ(summary.memsets, 1);
  EXPECT_NEAR(summary.memset_ms, 5 * kUs, 1e-9);
  EXPECT_EQ(summary.memcpys, 1);
  EXPECT_NEAR(summary.memcpy_ms, 15 * kUs, 1e-9);

  // Kernels by their short names: both instances of a together, first.
  ASSERT_EQ(summary.top_kernels.size(), 2u);
  EXPECT_EQ(summary.top_kernels[0].name, "fp8t::a");
  EXPECT_EQ(summary.top_kernels[0].count, 2);
  EXPECT_NEAR(summary.top_kernels[0].ms, 20 * kUs, 1e-9);
  EXPECT_EQ(summary.top_kernels[1].name, "b_kernel");

  // The GPU waited 10 µs to start a, 5 to start b.
  ASSERT_EQ(summary.top_waits.size(), 2u);
  EXPECT_EQ(summary.top_waits[0].name, "fp8t::a");
  EXPECT_NEAR(summary.top_waits[0].ms, 10 * kUs, 1e-9);
  EXPECT_EQ(summary.top_waits[1].name, "b_kernel");
  EXPECT_NEAR(summary.top_waits[1].ms, 5 * kUs, 1e-9);

  ASSERT_GE(summary.top_api.size(), 2u);
  EXPECT_EQ(summary.top_api[0].name, "cudaStreamSynchronize");
  EXPECT_NEAR(summary.top_api[0].ms, 30 * kUs, 1e-9);
  EXPECT_EQ(summary.top_api[1].name, "cuLaunchKernel");
  EXPECT_EQ(summary.top_api[1].count, 3);

  // `top` cuts every list.
  const TraceSummary one = summarize_trace(records, 1);
  EXPECT_EQ(one.top_kernels.size(), 1u);
  EXPECT_EQ(one.top_waits.size(), 1u);
  EXPECT_EQ(one.top_api.size(), 1u);
}

TEST(GpuTrace, OverlappingRecordsLeaveNoGap) {
  // Two streams covering each other's holes: busy throughout.
  const std::vector<TraceRecord> records = {
      record(Kind::Kernel, "x", 100, 200, 1, 0),
      record(Kind::Kernel, "y", 150, 400, 2, 0),
      record(Kind::Kernel, "z", 210, 300, 1, 0),
  };
  const TraceSummary summary = summarize_trace(records);
  EXPECT_EQ(summary.gaps, 0);
  EXPECT_EQ(summary.idle_ms, 0.0);
  EXPECT_NEAR(summary.span_ms, 300 * kUs, 1e-9);
  EXPECT_NEAR(summary.busy_ms, 300 * kUs, 1e-9);
  EXPECT_EQ(summary.idle_waiting_for_host_ms, 0.0);

  const TraceSummary empty = summarize_trace({});
  EXPECT_EQ(empty.span_ms, 0.0);
  EXPECT_TRUE(empty.top_kernels.empty());
}

TEST(GpuTrace, ShortKernelNamesDropTypesArgumentsAndParameters) {
  EXPECT_EQ(short_kernel_name("void fp8t::ops::cuda::(anonymous namespace)::rows_kernel<fp8t::"
                              "Gelu<(int)4>, true>(float const*, int)"),
            "fp8t::ops::cuda::rows_kernel");
  EXPECT_EQ(short_kernel_name("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT"),
            "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT");
  EXPECT_EQ(short_kernel_name("cudnn::fusion::kernel()"), "cudnn::fusion::kernel");
}

TEST(GpuTrace, ChromeTraceHoldsEveryRecordFromTheFirst) {
  const uint64_t origin = 5000;
  const std::vector<TraceRecord> records = two_gap_timeline(origin);
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json(records));
  const nlohmann::json& events = trace.at("traceEvents");
  std::vector<nlohmann::json> spans;
  for (const nlohmann::json& event : events) {
    if (event.at("ph") == "X") spans.push_back(event);
  }
  ASSERT_EQ(spans.size(), records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    const TraceRecord& expected = records[i];
    EXPECT_EQ(spans[i].at("name"), expected.name);
    // The earliest record (the first API call, 5 µs before the origin) is at 0.
    EXPECT_NEAR(spans[i].at("ts").get<double>(),
                double(expected.start_ns) / 1e3 - double(origin - 5), 1e-6);
    EXPECT_NEAR(spans[i].at("dur").get<double>(), double(expected.end_ns - expected.start_ns) / 1e3,
                1e-6);
    EXPECT_EQ(spans[i].at("pid"), expected.on_gpu() ? 0 : 1);
    EXPECT_EQ(spans[i].at("tid"), expected.lane);
    EXPECT_EQ(spans[i].at("cat"), expected.kind == Kind::Api      ? "api"
                                  : expected.kind == Kind::Kernel ? "kernel"
                                  : expected.kind == Kind::Memcpy ? "memcpy"
                                                                  : "memset");
  }
}

}  // namespace
}  // namespace fp8t
