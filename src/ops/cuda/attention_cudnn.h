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
// FP8 (forward_fp8, backward_fp8): cuDNN's FP8 SDPA on FP8 codes, with the quantization points
// of ops/attention_fp8.h. On Hopper it reads and writes FP8 only and needs head_dim 128. Its
// scales, descales and amaxes live in one device array per attention (AttentionFp8Slot).
//
// CUDA builds only. The cuDNN frontend headers stay inside attention_cudnn.cpp.
#pragma once

#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "numerics/float_bits.h"
#include "numerics/formats.h"
#include "ops/attention.h"

namespace fp8t::ops::cuda {

// The tensors FP8 attention quantizes, and where their scale, descale (1 / scale) and amax sit in
// the attention's float array: scale at t, descale at kAttentionFp8Tensors + t, amax at
// 2 * kAttentionFp8Tensors + t.
enum AttentionFp8Tensor : int {
  kFp8Q,
  kFp8K,
  kFp8V,
  kFp8P,  // the probabilities before P·V
  kFp8O,
  kFp8Dout,
  kFp8Ds,  // the score gradient (cuDNN's dP) after the attention scale
  kFp8Dq,
  kFp8Dk,
  kFp8Dv,
  kAttentionFp8Tensors
};
constexpr int attention_fp8_scale_slot(AttentionFp8Tensor t) {
  return t;
}
constexpr int attention_fp8_descale_slot(AttentionFp8Tensor t) {
  return kAttentionFp8Tensors + t;
}
constexpr int attention_fp8_amax_slot(AttentionFp8Tensor t) {
  return 2 * kAttentionFp8Tensors + t;
}
inline constexpr int kAttentionFp8Floats = 3 * kAttentionFp8Tensors;

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

  // FP8: q, k, v and out hold codes in `forward_format`. Reads the descales of Q, K, V and P
  // and the scales of P and O from `floats` (kAttentionFp8Floats); writes the amaxes of P and O.
  void forward_fp8(uint8_t* out, float* stats, const uint8_t* q, const uint8_t* k, const uint8_t* v,
                   float* floats, const AttentionShape& shape, float scale,
                   Fp8Format forward_format, cudaStream_t stream);

  // FP8: dout, dq, dk and dv hold codes in `backward_format`, the forward's tensors in
  // `forward_format`. Reads the descales of Q, K, V, P, O, dO and dS and the scales of P, dS,
  // dQ, dK and dV; writes the amaxes of dS, dQ, dK and dV.
  void backward_fp8(uint8_t* dq, uint8_t* dk, uint8_t* dv, const uint8_t* dout, const uint8_t* q,
                    const uint8_t* k, const uint8_t* v, const uint8_t* out, const float* stats,
                    float* floats, const AttentionShape& shape, float scale,
                    Fp8Format forward_format, Fp8Format backward_format, cudaStream_t stream);

  // Graphs built so far (forward and backward together): a repeated shape builds nothing.
  int64_t graphs_built() const;
  // The cuDNN library version (e.g. 91000 for 9.10.0), for messages.
  static int64_t cudnn_version();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace fp8t::ops::cuda
