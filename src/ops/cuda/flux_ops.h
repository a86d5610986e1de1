// The GPU counterparts of the Flux CPU ops (ops/layernorm.h, modulation.h, gelu.h, flux_rope.h,
// the QK norm of models/flux_model.cpp, SiLU, bias gradients and the rectified-flow MSE of
// models/flux_objective.h) and the row copies between the streams and the joint sequence, fused
// where the model runs them back to back. Conventions as ops/cuda/ops_cuda.h: bf16 activations
// and activation gradients, fp32 statistics, parameters, parameter gradients and modulation
// gradients, fp32 math inside the kernels; host launchers check their arguments (throwing
// fp8t::Error) and launch on the given stream.
//
// Sums over tokens (modulation, QK-norm scale and bias gradients, the loss) are deterministic:
// per-block partial sums in a workspace, then one pass adds them in block order. The workspace
// of each launcher is sized by flux_reduction_workspace_floats().
//
// Layouts: a stream's activations are [batch, tokens, dim] row-major; modulation vectors are
// rows of a [batch, mod_stride] buffer (the chunks of one modulation linear's output, used in
// place), their gradients rows of an fp32 [batch, dmod_stride] buffer.
//
// C++17, compiles in host C++ translation units.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "numerics/float_bits.h"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::ops::cuda {

// fp32 floats of the workspace every reducing launcher below needs (one size for all).
int64_t flux_reduction_workspace_floats();
// The most samples the per-sample reductions (modulation gradients, 2·dim floats per sample in
// the workspace; a grid dimension per sample) take at hidden size `dim`.
int64_t flux_max_batch(int64_t dim);

// A stream's tokens: batch samples of `tokens` rows of `dim` values. x_sample_rows (>= tokens):
// the distance in rows between samples of the tensor x / dx the LayerNorm reads and writes, so
// that it can read the image tokens inside the joint [txt; img] sequence (then x points at the
// first image row of sample 0 and x_sample_rows is the joint length); equal to tokens when
// contiguous. Every other tensor of a call is contiguous [batch, tokens, dim].
struct StreamShape {
  int64_t batch;
  int64_t tokens;
  int64_t dim;
  int64_t x_sample_rows;
};

// --- LayerNorm (no affine, eps ops::kFluxLayerNormEps) fused with the modulation; a row is one
// block's, so dim <= 8192 ---

// normed = LN(x) (saved for the backward, bf16), rstd [batch * tokens], and
// out = normed · (1 + scale[b]) + shift[b], from the fp32 values (normed is not rounded first).
// `cast` (ops_cuda.h): the FP8 copy and/or the amax of out in the same pass (the input of an FP8
// linear), rows counted over batch · tokens; it needs dim a multiple of 8 (of 128 for block
// scales) and 16-byte aligned rows.
void layernorm_modulate_forward(bf16* out, bf16* normed, float* rstd, const bf16* x,
                                const bf16* shift, const bf16* scale, int64_t mod_stride,
                                const StreamShape& shape, cudaStream_t stream,
                                const FusedCast& cast = {});

// With d = dout · (1 + scale[b]):  dx (store) = rstd · (d − mean(d) − normed · mean(d · normed)),
// dscale[b] += Σ_tokens dout · normed, dshift[b] += Σ_tokens dout (fp32 rows of stride
// dmod_stride).
void layernorm_modulate_backward(bf16* dx, float* dshift, float* dscale, int64_t dmod_stride,
                                 const bf16* dout, const bf16* normed, const float* rstd,
                                 const bf16* scale, int64_t mod_stride, const StreamShape& shape,
                                 GradStore store, float* workspace, cudaStream_t stream);

// --- The gated residual: x += gate[b] · branch (in place); x and dx follow x_sample_rows, as the
// LayerNorm's (the residual stream may sit inside the joint sequence) ---

void gated_residual_forward(bf16* x, const bf16* branch, const bf16* gate, int64_t mod_stride,
                            const StreamShape& shape, cudaStream_t stream);

// dbranch (writes) = gate[b] · dx; dgate[b] += Σ_tokens dx · branch. dx passes through to the
// residual unchanged (nothing to do).
void gated_residual_backward(bf16* dbranch, float* dgate, int64_t dmod_stride, const bf16* dx,
                             const bf16* branch, const bf16* gate, int64_t mod_stride,
                             const StreamShape& shape, float* workspace, cudaStream_t stream);

// --- Row copies between a stream and the joint sequence (or any row-strided tensors) ---

// Rows of values: row r of sample b at data + (b · sample_rows + r) · ld.
template <typename T>
struct SampleRows {
  T* data;
  int64_t ld;
  int64_t sample_rows;
};

// For each of `samples` samples, its `rows` rows of `width` values from src to dst, in one launch
// (the strides of one sample's rows and of the samples may differ between the two). amax (not
// null): the largest magnitude copied is folded into *amax (fp32 bits, NaN above inf), for the
// per-tensor FP8 cast of the tensor it writes (CudaLinear::fused_input_amax).
void copy_rows(const SampleRows<bf16>& dst, const SampleRows<const bf16>& src, int64_t samples,
               int64_t rows, int64_t width, cudaStream_t stream, float* amax = nullptr);

// --- tanh-GELU over [rows, cols] with row strides (so that a single block's MLP half of
// linear1's output and linear2's input are read and written in place) ---

// amax (not null): the largest magnitude of the bf16 outputs is folded into *amax, as copy_rows'.
void gelu_tanh_forward(bf16* out, int64_t out_ld, const bf16* in, int64_t in_ld, int64_t rows,
                       int64_t cols, cudaStream_t stream, float* amax = nullptr);

// din (writes) = gelu'(in) · dout.
void gelu_tanh_backward(bf16* din, int64_t din_ld, const bf16* dout, int64_t dout_ld,
                        const bf16* in, int64_t in_ld, int64_t rows, int64_t cols,
                        cudaStream_t stream);

// --- SiLU over n elements (the embedders' and the modulations' input) ---

void silu_forward(bf16* out, const bf16* in, int64_t n, cudaStream_t stream);
// din (store) = dout · σ(in) · (1 + in · (1 − σ(in))).
void silu_backward(bf16* din, const bf16* dout, const bf16* in, int64_t n, GradStore store,
                   cudaStream_t stream);

// --- The QK norm and the rotary embedding of one stream's q or k, into the joint sequence;
// head_dim even and at most 256 ---

// Where a stream's tokens sit in the joint [batch, joint_tokens, heads, head_dim] q, k and v:
// rows first .. first + tokens of each sample (the text first, then the image).
struct JointRows {
  int64_t batch;
  int64_t tokens;
  int64_t first;
  int64_t joint_tokens;
};

// raw: the stream's q (or k) [batch, tokens, heads · head_dim] with row stride raw_ld (a slice
// of the qkv or linear1 output). Per head: normed = raw · rstd, rstd = 1 / sqrt(mean(raw²) +
// 1e-6) (BFL's QKNorm), normed rounded to bf16 and saved; out = the adjacent-pair rotation of
// normed · scale (scale fp32 [head_dim], the stream's learnable scale) by the joint position's
// cos, sin [joint_tokens, head_dim / 2] (ops::flux_rope_tables). out, normed: joint
// [batch, joint_tokens, heads, head_dim]; rstd joint [batch, joint_tokens, heads]; only the
// stream's rows are written.
void qk_norm_rope_forward(bf16* out, bf16* normed, float* rstd, const bf16* raw, int64_t raw_ld,
                          const float* scale, const float* cos, const float* sin,
                          const JointRows& rows, int64_t heads, int64_t head_dim,
                          cudaStream_t stream);

// From dout (joint, the stream's rows): ds = the inverse rotation of dout; dscale += Σ ds ·
// normed over the stream's tokens and heads; draw (writes, row stride draw_ld) = the RMSNorm
// backward of ds · scale.
void qk_norm_rope_backward(bf16* draw, int64_t draw_ld, float* dscale, const bf16* dout,
                           const bf16* normed, const float* rstd, const float* scale,
                           const float* cos, const float* sin, const JointRows& rows, int64_t heads,
                           int64_t head_dim, float* workspace, cudaStream_t stream);

// --- Linear biases and the loss ---

// dbias[c] += Σ_rows dy[r, c] (dy [rows, cols] bf16, dbias fp32). With amax: also *amax =
// max(*amax, max |dy|) in the same pass (amax bit patterns, as numerics/quantize_cuda.h's amax),
// the per-tensor amax of an FP8 linear's dy (CudaLinear::fused_grad_output_amax).
void bias_backward(float* dbias, const bf16* dy, int64_t rows, int64_t cols, float* workspace,
                   cudaStream_t stream, float* amax = nullptr);

// *loss = mean((pred − target)²) over n >= 1 values (fp32 differences, summed in double, written as
// fp32) and dpred (writes) = dloss · 2 · (pred − target) / n.
void flow_mse_forward_backward(float* loss, bf16* dpred, const bf16* pred, const float* target,
                               int64_t n, float dloss, float* workspace, cudaStream_t stream);

}  // namespace fp8t::ops::cuda
