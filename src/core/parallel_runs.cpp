#include "core/parallel_runs.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace fp8t {

void parallel_runs(int64_t count, int64_t min_per_thread,
                   const std::function<void(int64_t first, int64_t last)>& work) {
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads = std::clamp<int64_t>(count / std::max<int64_t>(1, min_per_thread), 1,
                                              std::min<int64_t>(kHostThreads, cores));
  const int64_t per_thread = (count + threads - 1) / threads;
  std::vector<std::jthread> helpers;  // joined on the way out, also when one fails to start
  helpers.reserve(size_t(threads - 1));
  for (int64_t part = 1; part < threads; ++part) {
    const int64_t first = part * per_thread, last = std::min(count, first + per_thread);
    if (last > first) helpers.emplace_back(work, first, last);
  }
  if (count > 0) work(0, std::min(count, per_thread));
}

void parallel_copy(const float* from, int64_t count, float* to) {
  parallel_runs(count, kParallelCopyChunk, [from, to](int64_t first, int64_t last) {
    std::memcpy(to + first, from + first, size_t(last - first) * sizeof(float));
  });
}

}  // namespace fp8t
