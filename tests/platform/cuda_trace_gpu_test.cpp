// CUPTI's timeline of real work: the kernels, memsets and copies a stream ran, tied to the CUDA
// calls that issued them, and a host pause between two launches seen as a gap in which the GPU
// waited for the host.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "ops/cuda/gpt_gates.h"
#include "platform/cuda_trace.h"

namespace fp8t {
namespace {

int count_of(const std::vector<TraceRecord>& records, TraceRecord::Kind kind) {
  int count = 0;
  for (const TraceRecord& record : records)
    count += record.kind == kind ? 1 : 0;
  return count;
}

TEST(CudaTrace, RecordsTheStreamsWorkAndTheHostsPause) {
  constexpr int64_t kCount = 1 << 20;
  constexpr auto kPause = std::chrono::milliseconds(30);
  CudaStream stream;
  DeviceBuffer<float> values(kCount), copy(kCount);
  // Work before the trace is not in it.
  FP8T_CUDA_CHECK(cudaMemsetAsync(values.get(), 0, kCount * sizeof(float), stream.get()));
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream.get()));

  CudaTrace trace;
  FP8T_CUDA_CHECK(cudaMemsetAsync(values.get(), 0, kCount * sizeof(float), stream.get()));
  ops::cuda::scale_f32(values.get(), 2.0f, kCount, stream.get());
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
  std::this_thread::sleep_for(kPause);  // the GPU has nothing to do
  ops::cuda::scale_f32(values.get(), 0.5f, kCount, stream.get());
  FP8T_CUDA_CHECK(cudaMemcpyAsync(copy.get(), values.get(), kCount * sizeof(float),
                                  cudaMemcpyDeviceToDevice, stream.get()));
  const std::vector<TraceRecord> records = trace.finish();

  EXPECT_EQ(count_of(records, TraceRecord::Kind::Kernel), 2);
  EXPECT_EQ(count_of(records, TraceRecord::Kind::Memset), 1);
  EXPECT_EQ(count_of(records, TraceRecord::Kind::Memcpy), 1);
  std::vector<uint32_t> api_calls;
  bool saw_synchronize = false;
  for (const TraceRecord& record : records) {
    EXPECT_LE(record.start_ns, record.end_ns) << record.name;
    if (record.kind == TraceRecord::Kind::Api && record.correlation != 0)
      api_calls.push_back(record.correlation);
    saw_synchronize |= record.name == "cudaStreamSynchronize";
    if (record.kind == TraceRecord::Kind::Kernel) {  // demangled, template arguments and all
      EXPECT_NE(record.name.find("ScaleF32"), std::string::npos) << record.name;
    }
  }
  EXPECT_TRUE(saw_synchronize);
  std::vector<uint32_t> streams;
  for (const TraceRecord& record : records) {
    if (!record.on_gpu()) continue;
    streams.push_back(record.lane);
    EXPECT_NE(std::find(api_calls.begin(), api_calls.end(), record.correlation), api_calls.end())
        << record.name << " is tied to no CUDA call";
  }
  ASSERT_EQ(streams.size(), 4u);
  EXPECT_EQ(std::count(streams.begin(), streams.end(), streams[0]), 4) << "one stream";

  const TraceSummary summary = summarize_trace(records);
  const double pause_ms = std::chrono::duration<double, std::milli>(kPause).count();
  EXPECT_GE(summary.idle_ms, pause_ms);
  EXPECT_GE(summary.idle_waiting_for_host_ms, pause_ms);
  EXPECT_LE(summary.idle_ms, summary.span_ms);
  ASSERT_EQ(summary.top_kernels.size(), 1u);  // both scalings, by their short name
  EXPECT_EQ(summary.top_kernels[0].count, 2);
}

TEST(CudaTrace, OneAtATime) {
  CudaTrace first;
  EXPECT_THROW(CudaTrace second, Error);
  first.finish();
  EXPECT_THROW(first.finish(), Error);
  // Finished, it leaves room for the next, which starts empty.
  CudaTrace next;
  EXPECT_EQ(count_of(next.finish(), TraceRecord::Kind::Kernel), 0);
}

}  // namespace
}  // namespace fp8t
