// The small pointwise pieces of the nanochat GPT: relu^2 in the MLP, the value-embedding gate,
// the smear of the previous token's embedding, the per-layer residual mix and the backout of the
// mid-layer residual. (The ×1.2 on q and k is folded into the attention's softmax scale.)
//
// Every backward ADDS (+=) into each gradient buffer it is given, parameter gradients
// included, like every op in src/ops; gradient buffers must not alias the dout they are
// computed from. Sums over all tokens into one scalar gradient accumulate in double.
#pragma once

#include <cstdint>

#include "core/non_deduced.h"

namespace fp8t::ops {

// out = relu(inp)^2 over n elements; out may be inp, but the backward needs inp.
template <typename T>
void relu2_forward(T* out, const T* inp, int64_t n);

// dinp += 2 relu(inp) dout.
template <typename T>
void relu2_backward(T* dinp, const T* dout, const T* inp, int64_t n);

// Sizes of the value-embedding gate. The gate reads the first gate_channels channels of the
// attention input (nanochat: 12, kValueGateChannels).
struct ValueGateShape {
  int64_t tokens;    // batch * seq_len
  int64_t channels;  // row length of x_norm (n_embd)
  int64_t kv_heads;
  int64_t head_dim;
  int64_t gate_channels;  // <= channels
};

// Throws fp8t::Error unless tokens >= 0, kv_heads > 0, head_dim > 0 and gate_channels in
// [1, channels]. The CPU and GPU value gates check their shapes with it.
void check_value_gate_shape(const ValueGateShape& shape);

// v += gate * value_embed, per token and kv head, with
// gate[n, h] = 3 sigmoid(x_norm[n, :gate_channels] . gate_weight[h, :]).
// v, value_embed: [tokens, kv_heads, head_dim]; x_norm: [tokens, channels];
// gate_weight: [kv_heads, gate_channels]; gate: [tokens, kv_heads], saved for the backward.
// v is updated in place.
template <typename T>
void value_gate_forward(T* v, T* gate, const T* x_norm, const T* value_embed, const T* gate_weight,
                        const ValueGateShape& shape);

// Adds into dx_norm (its first gate_channels channels of each row only), dgate_weight and
// dvalue_embed, given dv, the gradient of the gated v. The gradient of v before the gate is dv
// itself (v += ... is additive), so there is nothing to do for it: dv passes through.
template <typename T>
void value_gate_backward(T* dx_norm, T* dgate_weight, T* dvalue_embed, const T* dv, const T* x_norm,
                         const T* value_embed, const T* gate_weight, const T* gate,
                         const ValueGateShape& shape);

// Sizes of the smear. The gate reads the first gate_channels channels of each token
// (nanochat: 24, kSmearGateChannels).
struct SmearShape {
  int64_t batch;
  int64_t seq_len;
  int64_t channels;
  int64_t gate_channels;  // <= channels
};

// Throws fp8t::Error unless batch >= 0, seq_len >= 0 and gate_channels in [1, channels]. The
// CPU and GPU smears check their shapes with it.
void check_smear_shape(const SmearShape& shape);

// For t >= 1 in each batch row: out[t] = inp[t] + smear_lambda * gate[t] * inp[t - 1], with
// gate[t] = sigmoid(inp[t, :gate_channels] . gate_weight); out[0] = inp[0].
// inp, out: [batch, seq_len, channels]; gate_weight: [gate_channels]; gate: [batch, seq_len]
// saved for the backward (the sigmoid alone, without smear_lambda; gate[b, 0] = 0).
// out may be inp: rows are processed from the last position down, so each reads inputs not
// yet overwritten. The backward needs inp, so the caller keeps a copy when smearing in place.
template <typename T>
void smear_forward(T* out, T* gate, const T* inp, const T* gate_weight, NonDeduced<T> smear_lambda,
                   const SmearShape& shape);

// Adds into dinp, dgate_weight [gate_channels] and dsmear_lambda (one scalar).
template <typename T>
void smear_backward(T* dinp, T* dgate_weight, T* dsmear_lambda, const T* dout, const T* inp,
                    const T* gate, const T* gate_weight, NonDeduced<T> smear_lambda,
                    const SmearShape& shape);

// out = resid_lambda * x + x0_lambda * x0 over n elements (the per-layer mix with the
// embedding x0). out may be x, but the backward needs x.
template <typename T>
void residual_mix_forward(T* out, const T* x, const T* x0, NonDeduced<T> resid_lambda,
                          NonDeduced<T> x0_lambda, int64_t n);

// dx += resid_lambda dout; dx0 += x0_lambda dout; dresid_lambda += sum(dout x);
// dx0_lambda += sum(dout x0).
template <typename T>
void residual_mix_backward(T* dx, T* dx0, T* dresid_lambda, T* dx0_lambda, const T* dout,
                           const T* x, const T* x0, NonDeduced<T> resid_lambda,
                           NonDeduced<T> x0_lambda, int64_t n);

// out = x - backout_lambda * x_backout over n elements; out may be x.
template <typename T>
void backout_forward(T* out, const T* x, const T* x_backout, NonDeduced<T> backout_lambda,
                     int64_t n);

// dx += dout; dx_backout -= backout_lambda dout; dbackout_lambda -= sum(dout x_backout).
template <typename T>
void backout_backward(T* dx, T* dx_backout, T* dbackout_lambda, const T* dout, const T* x_backout,
                      NonDeduced<T> backout_lambda, int64_t n);

}  // namespace fp8t::ops
