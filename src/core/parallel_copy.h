// A large host copy spread over several threads. The GPU paths copy each micro-batch's inputs
// into pinned memory before they can upload them, and the GPU waits for that copy: one thread
// moves a few GB/s, which for a Flux micro-batch's text embeddings is milliseconds per step.
#pragma once

#include <cstdint>

namespace fp8t {

// to[0 .. count) = from[0 .. count); the ranges must not overlap. Copies of at least
// kParallelCopyChunk floats per thread take up to kParallelCopyThreads threads (as many as the
// machine has), smaller ones the caller's alone.
inline constexpr int64_t kParallelCopyChunk = int64_t(1) << 20;  // 4 MiB of floats
inline constexpr unsigned kParallelCopyThreads = 8;
void parallel_copy(const float* from, int64_t count, float* to);

}  // namespace fp8t
