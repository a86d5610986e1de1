// FP8 attention on the GPU (`fp8_dot_product_attention`): bf16 in, bf16 out, cuDNN's FP8 SDPA
// (ops/cuda/attention_cudnn.h) in between, with the quantization points and scale rules of the
// CPU reference (ops/attention_fp8.h). The scales are computed on the device from amaxes, so a
// step needs no host sync:
//   forward   amax(q, k, v) → scales; q, k, v cast to FP8 (kept for the backward); the FP8
//             graph writes the FP8 output (kept) and cuDNN's amaxes of P and O; out = the FP8
//             output read back in bf16.
//   backward  amax(dout) → its scale, and the gradient scales from the amaxes the previous
//             backward of this attention measured; dout cast to FP8; the FP8 graph; dq, dk and
//             dv read back in bf16. Until a backward with a non-zero dout has run, a backward
//             runs the graph twice more first, to measure, and reads dout's amax back (a sync).
// CUDA builds only.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "numerics/float_bits.h"
#include "ops/attention_fp8.h"
#include "ops/cuda/attention_cudnn.h"

namespace fp8t::ops::cuda {

// What one attention keeps from its forward for its backward, and its scaling state. The
// buffers are the caller's: q and out sized like q, k and v like k, floats kAttentionFp8Floats
// (zeroed before the first forward).
struct Fp8AttentionSaved {
  uint8_t *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
  float* floats = nullptr;
  bool measured = false;  // a backward with a non-zero dout measured the gradients' amaxes
};

// The backward's FP8 temporaries: dout and dq sized like q, dk and dv like k.
struct Fp8AttentionScratch {
  uint8_t *dout = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
};

class CudaFp8Attention {
 public:
  CudaFp8Attention(CudnnAttention& attention, const AttentionFp8Formats& formats);

  // out [batch, seq_len, heads, head_dim] bf16 and stats as CudnnAttention::forward.
  void forward(bf16* out, float* stats, const bf16* q, const bf16* k, const bf16* v,
               Fp8AttentionSaved& saved, const AttentionShape& shape, float scale,
               cudaStream_t stream);

  // dq, dk, dv written (bf16): the gradients of sum(out * dout), from the forward's saved
  // tensors and stats.
  void backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, Fp8AttentionSaved& saved,
                const float* stats, const Fp8AttentionScratch& scratch, const AttentionShape& shape,
                float scale, cudaStream_t stream);

  // out = the saved FP8 output read back in bf16: the forward's `out` again, bit for bit.
  void read_output(bf16* out, const Fp8AttentionSaved& saved, const AttentionShape& shape,
                   cudaStream_t stream) const;

  const AttentionFp8Formats& formats() const { return formats_; }

 private:
  void backward_graph(const Fp8AttentionSaved& saved, const float* stats,
                      const Fp8AttentionScratch& scratch, const AttentionShape& shape, float scale,
                      cudaStream_t stream);

  CudnnAttention& attention_;
  AttentionFp8Formats formats_;
};

}  // namespace fp8t::ops::cuda
