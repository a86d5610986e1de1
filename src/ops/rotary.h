// Rotary position embedding as nanochat applies it to q and k: each head's channels pair the
// first half with the second half (x1 = x[:D/2], x2 = x[D/2:]) and rotate by -theta:
// y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos.
//
// Backward ADDS (+=) into its gradient buffer, like every op in src/ops.
#pragma once

#include <cstdint>

namespace fp8t::ops {

inline constexpr float kRotaryBase = 100000.0f;

// The cos and sin tables, [seq_len, head_dim / 2] each, computed in float the way torch does
// for nanochat: inv_freq[j] = 1 / base^(2j / head_dim), angle[t, j] = t * inv_freq[j].
// Equal to nanochat's fp32 tables up to the last-bit rounding of the libm's pow, cos and sin.
void rotary_tables(float* cos, float* sin, int64_t seq_len, int64_t head_dim,
                   float base = kRotaryBase);

// Rotates x [batch, seq_len, heads, head_dim] by the tables' first seq_len rows (position t
// uses row t). out may be inp (the rotation runs in place). head_dim must be even.
template <typename T>
void rotary_forward(T* out, const T* inp, const float* cos, const float* sin, int64_t batch,
                    int64_t seq_len, int64_t heads, int64_t head_dim);

// dinp += the transposed rotation of dout: dx1 = dy1 cos - dy2 sin, dx2 = dy1 sin + dy2 cos.
// dinp must not alias dout.
template <typename T>
void rotary_backward(T* dinp, const T* dout, const float* cos, const float* sin, int64_t batch,
                     int64_t seq_len, int64_t heads, int64_t head_dim);

}  // namespace fp8t::ops
