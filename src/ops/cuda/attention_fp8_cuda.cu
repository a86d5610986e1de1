#include "ops/cuda/attention_fp8_cuda.h"

#include <fmt/format.h>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/phase_timer.h"
#include "numerics/quantize_cuda.h"

namespace fp8t::ops::cuda {

namespace {

__device__ void store_scale(float* floats, AttentionFp8Tensor t, float scale) {
  floats[attention_fp8_scale_slot(t)] = scale;
  floats[attention_fp8_descale_slot(t)] = 1.0f / scale;
}

// One thread: the forward's scales from the amaxes of q, k and v (ops/attention_fp8.h's rule).
__global__ void forward_scales_kernel(float* floats, AttentionFp8Formats formats) {
  AttentionFp8Scales scales;
  attention_fp8_forward_scales(scales, floats[attention_fp8_amax_slot(kFp8Q)],
                               floats[attention_fp8_amax_slot(kFp8K)],
                               floats[attention_fp8_amax_slot(kFp8V)], formats);
  store_scale(floats, kFp8Q, scales.q);
  store_scale(floats, kFp8K, scales.k);
  store_scale(floats, kFp8V, scales.v);
  store_scale(floats, kFp8P, scales.p);
  store_scale(floats, kFp8O, scales.o);
}

// One thread: the backward's scales from dout's amax and the amaxes the previous backward's
// graph wrote.
__global__ void backward_scales_kernel(float* floats, AttentionFp8Formats formats) {
  AttentionFp8Amaxes previous;
  previous.ds = floats[attention_fp8_amax_slot(kFp8Ds)];
  previous.dq = floats[attention_fp8_amax_slot(kFp8Dq)];
  previous.dk = floats[attention_fp8_amax_slot(kFp8Dk)];
  previous.dv = floats[attention_fp8_amax_slot(kFp8Dv)];
  AttentionFp8Scales scales;
  attention_fp8_backward_scales(scales, floats[attention_fp8_amax_slot(kFp8Dout)], previous,
                                formats);
  store_scale(floats, kFp8Dout, scales.dout);
  store_scale(floats, kFp8Ds, scales.ds);
  store_scale(floats, kFp8Dq, scales.dq);
  store_scale(floats, kFp8Dk, scales.dk);
  store_scale(floats, kFp8Dv, scales.dv);
}

// Zeroes the amaxes of tensors first .. last (consecutive slots).
void zero_amaxes(float* floats, AttentionFp8Tensor first, AttentionFp8Tensor last,
                 cudaStream_t stream) {
  FP8T_CUDA_CHECK(cudaMemsetAsync(floats + attention_fp8_amax_slot(first), 0,
                                  sizeof(float) * static_cast<size_t>(last - first + 1), stream));
}

// A cuDNN failure names the option that asked for FP8 attention.
template <typename Call>
void naming_the_option(Call&& call) {
  try {
    call();
  } catch (const Error& error) {
    throw Error(fmt::format("fp8_dot_product_attention: {}", error.what()));
  }
}

int64_t q_elements(const AttentionShape& s) {
  return s.batch * s.seq_len * s.heads * s.head_dim;
}
int64_t kv_elements(const AttentionShape& s) {
  return s.batch * s.seq_len * s.kv_heads * s.head_dim;
}

}  // namespace

CudaFp8Attention::CudaFp8Attention(CudnnAttention& attention, const AttentionFp8Formats& formats)
    : attention_(attention), formats_(formats) {}

void CudaFp8Attention::forward(bf16* out, float* stats, const bf16* q, const bf16* k, const bf16* v,
                               Fp8AttentionSaved& saved, const AttentionShape& shape, float scale,
                               cudaStream_t stream) {
  FP8T_CHECK(out && q && k && v && saved.q && saved.k && saved.v && saved.out && saved.floats,
             "FP8 attention forward: expected non-null pointers");
  float* floats = saved.floats;
  const int64_t q_count = q_elements(shape), kv_count = kv_elements(shape);
  {
    const PhaseScope timed(StepPhase::Quantization, stream);
    zero_amaxes(floats, kFp8Q, kFp8V, stream);
    fp8t::cuda::amax(q, q_count, floats + attention_fp8_amax_slot(kFp8Q), stream);
    fp8t::cuda::amax(k, kv_count, floats + attention_fp8_amax_slot(kFp8K), stream);
    fp8t::cuda::amax(v, kv_count, floats + attention_fp8_amax_slot(kFp8V), stream);
    forward_scales_kernel<<<1, 1, 0, stream>>>(floats, formats_);
    FP8T_CUDA_CHECK_LAUNCH();
    fp8t::cuda::quantize(q, q_count, floats + attention_fp8_scale_slot(kFp8Q), formats_.forward,
                         saved.q, nullptr, stream);
    fp8t::cuda::quantize(k, kv_count, floats + attention_fp8_scale_slot(kFp8K), formats_.forward,
                         saved.k, nullptr, stream);
    fp8t::cuda::quantize(v, kv_count, floats + attention_fp8_scale_slot(kFp8V), formats_.forward,
                         saved.v, nullptr, stream);
    zero_amaxes(floats, kFp8P, kFp8O, stream);
  }
  naming_the_option([&] {
    attention_.forward_fp8(saved.out, stats, saved.q, saved.k, saved.v, floats, shape, scale,
                           formats_.forward, stream);
  });
  read_output(out, saved, shape, stream);
}

void CudaFp8Attention::read_output(bf16* out, const Fp8AttentionSaved& saved,
                                   const AttentionShape& shape, cudaStream_t stream) const {
  const PhaseScope timed(StepPhase::Quantization, stream);
  fp8t::cuda::dequantize(saved.out, q_elements(shape),
                         saved.floats + attention_fp8_descale_slot(kFp8O), formats_.forward, out,
                         stream);
}

void CudaFp8Attention::backward_graph(const Fp8AttentionSaved& saved, const float* stats,
                                      const Fp8AttentionScratch& scratch,
                                      const AttentionShape& shape, float scale,
                                      cudaStream_t stream) {
  zero_amaxes(saved.floats, kFp8Ds, kFp8Dv, stream);
  naming_the_option([&] {
    attention_.backward_fp8(scratch.dq, scratch.dk, scratch.dv, scratch.dout, saved.q, saved.k,
                            saved.v, saved.out, stats, saved.floats, shape, scale, formats_.forward,
                            formats_.backward, stream);
  });
}

void CudaFp8Attention::backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout,
                                Fp8AttentionSaved& saved, const float* stats,
                                const Fp8AttentionScratch& scratch, const AttentionShape& shape,
                                float scale, cudaStream_t stream) {
  FP8T_CHECK(dq && dk && dv && dout && stats && saved.floats && scratch.dout && scratch.dq &&
                 scratch.dk && scratch.dv,
             "FP8 attention backward: expected non-null pointers");
  float* floats = saved.floats;
  const int64_t q_count = q_elements(shape), kv_count = kv_elements(shape);
  {
    const PhaseScope timed(StepPhase::Quantization, stream);
    zero_amaxes(floats, kFp8Dout, kFp8Dout, stream);
    fp8t::cuda::amax(dout, q_count, floats + attention_fp8_amax_slot(kFp8Dout), stream);
    // Nothing measured yet: amax 0 gives scale 1 for the first measuring run.
    if (!saved.measured) zero_amaxes(floats, kFp8Ds, kFp8Dv, stream);
    backward_scales_kernel<<<1, 1, 0, stream>>>(floats, formats_);
    FP8T_CUDA_CHECK_LAUNCH();
    fp8t::cuda::quantize(dout, q_count, floats + attention_fp8_scale_slot(kFp8Dout),
                         formats_.backward, scratch.dout, nullptr, stream);
  }
  if (!saved.measured) {
    // Two measuring runs: the first takes dS's amax (before quantization, whatever its scale);
    // the second, with dS scaled, dQ's, dK's and dV's. The step waits here to read dO's amax:
    // a zero dO (the GPT's zero-initialized projections at step 1) measures nothing.
    for (int run = 0; run < 2; ++run) {
      backward_graph(saved, stats, scratch, shape, scale, stream);
      backward_scales_kernel<<<1, 1, 0, stream>>>(floats, formats_);
      FP8T_CUDA_CHECK_LAUNCH();
    }
    float amax_dout = 0.0f;
    FP8T_CUDA_CHECK(cudaMemcpyAsync(&amax_dout, floats + attention_fp8_amax_slot(kFp8Dout),
                                    sizeof amax_dout, cudaMemcpyDeviceToHost, stream));
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
    saved.measured = amax_dout > 0.0f;
  }
  backward_graph(saved, stats, scratch, shape, scale, stream);
  const PhaseScope timed(StepPhase::Quantization, stream);
  fp8t::cuda::dequantize(scratch.dq, q_count, floats + attention_fp8_descale_slot(kFp8Dq),
                         formats_.backward, dq, stream);
  fp8t::cuda::dequantize(scratch.dk, kv_count, floats + attention_fp8_descale_slot(kFp8Dk),
                         formats_.backward, dk, stream);
  fp8t::cuda::dequantize(scratch.dv, kv_count, floats + attention_fp8_descale_slot(kFp8Dv),
                         formats_.backward, dv, stream);
}

}  // namespace fp8t::ops::cuda
