#include "core/parallel_copy.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace fp8t {

void parallel_copy(const float* from, int64_t count, float* to) {
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads = std::clamp<int64_t>(count / kParallelCopyChunk, 1,
                                              std::min<int64_t>(kParallelCopyThreads, cores));
  const int64_t per_thread = (count + threads - 1) / threads;
  const auto copy_part = [&](int64_t part) {
    const int64_t first = part * per_thread, last = std::min(count, first + per_thread);
    if (last > first) std::memcpy(to + first, from + first, size_t(last - first) * sizeof(float));
  };
  {
    std::vector<std::jthread> helpers;  // joined on the way out, also when one fails to start
    helpers.reserve(size_t(threads - 1));
    for (int64_t part = 1; part < threads; ++part)
      helpers.emplace_back(copy_part, part);
    copy_part(0);
  }
}

}  // namespace fp8t
