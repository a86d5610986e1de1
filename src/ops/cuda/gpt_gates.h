// The GPU counterparts of the GPT's gates and small pointwise ops (ops/elementwise.h): the
// value-embedding gate, the smear of the previous token, the backout of the mid-layer residual,
// plus an in-place fp32 scale. Conventions as ops/cuda/ops_cuda.h: bf16
// activations and activation gradients, fp32 parameters, parameter gradients and gates, fp32
// math; the scalar parameters (smear_lambda, backout_lambda) are read on the device; host
// launchers check their arguments (throwing fp8t::Error) and launch on the given stream.
//
// Parameter gradients are added to, and their sums over tokens are deterministic: fp32 partial
// sums per block in a workspace, then one pass adds the blocks' partials in block order, in
// double. The grid depends only on the shape and the GPU, so the bits repeat run to run.
//
// C++17, compiles in host C++ translation units.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "numerics/float_bits.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/elementwise.h"

namespace fp8t::ops::cuda {

// --- Value-embedding gate: v, value_embed, dv, dvalue_embed [tokens, kv_heads * head_dim];
// x_norm, dx_norm [tokens, channels]; gate_weight, dgate_weight fp32 [kv_heads, gate_channels];
// gate fp32 [tokens, kv_heads]. ---

// v += gate * value_embed (v updated in place), with gate[n, h] =
// 3 sigmoid(x_norm[n, :gate_channels] . gate_weight[h, :]) written for the backward.
void value_gate_forward(bf16* v, float* gate, const bf16* x_norm, const bf16* value_embed,
                        const float* gate_weight, const ValueGateShape& shape, cudaStream_t stream);

// The backward accumulates each warp's share of dgate_weight in shared memory, which bounds
// kv_heads * gate_channels; its workspace holds one partial dgate_weight per block.
inline constexpr int64_t kValueGateMaxWeights = 1024;
inline constexpr int64_t kValueGateWorkspaceFloats = int64_t{1} << 18;  // 1 MiB

// dvalue_embed = gate * dv (writes); dx_norm[:, :gate_channels] += dz * gate_weight and
// dgate_weight += sum over tokens of dz * x_norm[:, :gate_channels] (adds), with
// dz = (dv . value_embed) * gate * (1 - gate / 3) per token and kv head. The other channels of
// dx_norm are left alone; dv itself is the gradient of v before the gate (the caller passes it
// on). workspace: kValueGateWorkspaceFloats floats, contents irrelevant.
void value_gate_backward(bf16* dx_norm, float* dgate_weight, bf16* dvalue_embed, const bf16* dv,
                         const bf16* x_norm, const bf16* value_embed, const float* gate_weight,
                         const float* gate, const ValueGateShape& shape, float* workspace,
                         cudaStream_t stream);

// --- Smear: inp, out, dinp, dout [batch, seq_len, channels]; gate_weight, dgate_weight fp32
// [gate_channels]; gate fp32 [batch, seq_len]; smear_lambda, dsmear_lambda one fp32 each. ---

// out[t] = inp[t] + *smear_lambda * gate[t] * inp[t - 1] for t >= 1, out[0] = inp[0] (writes),
// with gate[t] = sigmoid(inp[t, :gate_channels] . gate_weight), gate[0] = 0 (written for the
// backward). out must not overlap inp: rows run in parallel.
void smear_forward(bf16* out, float* gate, const bf16* inp, const float* gate_weight,
                   const float* smear_lambda, const SmearShape& shape, cudaStream_t stream);

// As for the value gate: per-warp accumulators in shared memory bound gate_channels, and the
// workspace holds one partial (dgate_weight, dsmear_lambda) per block.
inline constexpr int64_t kSmearMaxGateChannels = 1024;
inline constexpr int64_t kSmearWorkspaceFloats = int64_t{1} << 18;  // 1 MiB

// dinp (store) = the CPU op's gradient; dgate_weight and *dsmear_lambda are added to.
// workspace: kSmearWorkspaceFloats floats, contents irrelevant.
void smear_backward(bf16* dinp, float* dgate_weight, float* dsmear_lambda, const bf16* dout,
                    const bf16* inp, const float* gate, const float* gate_weight,
                    const float* smear_lambda, const SmearShape& shape, GradStore store,
                    float* workspace, cudaStream_t stream);

// --- Backout and the plain pointwise ops, over n elements ---

// out = x - *backout_lambda * x_backout (writes); out may be x.
void backout_forward(bf16* out, const bf16* x, const bf16* x_backout, const float* backout_lambda,
                     int64_t n, cudaStream_t stream);

// fp32 scratch that backout_backward needs: one partial sum per block.
inline constexpr int64_t kBackoutMaxBlocks = 1024;
inline constexpr int64_t kBackoutWorkspaceFloats = kBackoutMaxBlocks;

// dx (dx_store) = dout; dx_backout (dx_backout_store) = -*backout_lambda * dout;
// *dbackout_lambda -= sum(dout * x_backout) (deterministic).
// workspace: kBackoutWorkspaceFloats floats, contents irrelevant.
void backout_backward(bf16* dx, bf16* dx_backout, float* dbackout_lambda, const bf16* dout,
                      const bf16* x_backout, const float* backout_lambda, int64_t n,
                      GradStore dx_store, GradStore dx_backout_store, float* workspace,
                      cudaStream_t stream);

// x *= factor in place (e.g. fp32 gradients averaged over micro-batches).
void scale_f32(float* x, float factor, int64_t n, cudaStream_t stream);

}  // namespace fp8t::ops::cuda
