// BF16 self-attention, causal with a left window or without a mask (shape.causal), through
// cuDNN's fused SDPA (flash attention),
// forward and backward, in the layout of the CPU op (ops/attention.h): q [batch, seq_len, heads,
// head_dim], k and v [batch, seq_len, kv_heads, head_dim], out like q, heads not transposed.
// Causal: query t sees keys j with t - window <= j <= t (window >= seq_len - 1: full causal).
// Without the mask every query sees every key and the window is ignored.
//
// stats [batch, heads, seq_len] fp32 is cuDNN's generate_stats output: for each query the
// natural log of the sum over its visible keys of exp(scale * q.k), i.e. the log-sum-exp of
// the scaled, masked scores (max + log(sum exp(score - max))) — the CPU op's lse.
//
// Unlike the CPU op, backward WRITES (does not add into) dq, dk and dv.
//
// CUDA builds only. The cuDNN frontend headers stay inside attention_cudnn.cpp.
#pragma once

#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "numerics/float_bits.h"
#include "ops/attention.h"

namespace fp8t::ops::cuda {

// Owns a cuDNN handle, the built graphs (one per direction and per (batch, seq_len, heads,
// kv_heads, head_dim, window or no mask, scale)) and one workspace that grows to the largest need.
// Not thread-safe; calls on different streams must not overlap (they share the workspace). Every
// failure throws fp8t::Error naming the cuDNN call, the shape and cuDNN's message; a configuration
// cuDNN cannot run throws "... not supported ..." with cuDNN's reason.
class CudnnAttention {
 public:
  CudnnAttention();
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // out [batch, seq_len, heads, head_dim]; stats [batch, heads, seq_len] (see above).
  void forward(bf16* out, float* stats, const bf16* q, const bf16* k, const bf16* v,
               const AttentionShape& shape, float scale, cudaStream_t stream);

  // dq like q, dk and dv like k and v: the gradients of sum(out * dout), written. out and
  // stats are the forward's.
  void backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                const bf16* v, const bf16* out, const float* stats, const AttentionShape& shape,
                float scale, cudaStream_t stream);

  // Graphs built so far (forward and backward together): a repeated shape builds nothing.
  int64_t graphs_built() const;
  // The cuDNN library version (e.g. 91000 for 9.10.0), for messages.
  static int64_t cudnn_version();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace fp8t::ops::cuda
