// Host work spread over a few threads, for the loops the GPU waits on between steps: copying a
// micro-batch's inputs into pinned memory before their upload, drawing its noise. One thread
// moves or draws a few hundred MB/s to a few GB/s, which for a Flux micro-batch is milliseconds.
#pragma once

#include <cstdint>
#include <functional>

namespace fp8t {

// work(first, last) over [0, count) cut into consecutive runs of at least `min_per_thread`
// items, one per thread, up to kHostThreads threads (as many as the machine has); the caller's
// thread takes the first run, and the call returns once every run is done. A count below two
// runs' worth runs on the caller's thread alone. `work` must not throw on the other threads.
inline constexpr unsigned kHostThreads = 8;
void parallel_runs(int64_t count, int64_t min_per_thread,
                   const std::function<void(int64_t first, int64_t last)>& work);

// to[0 .. count) = from[0 .. count); the ranges must not overlap. kParallelCopyChunk floats or
// more per thread.
inline constexpr int64_t kParallelCopyChunk = int64_t(1) << 20;  // 4 MiB of floats
void parallel_copy(const float* from, int64_t count, float* to);

}  // namespace fp8t
