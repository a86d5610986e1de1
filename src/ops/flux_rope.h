// Flux's rotary embedding over three position axes (BFL flux1's EmbedND, rope and apply_rope):
// each token has ids (0 for text, row, col for image tokens); a head's head_dim channels form
// adjacent pairs (x[2i], x[2i+1]), the first axes_dim[0] / 2 pairs rotated by angles from axis
// 0, the next axes_dim[1] / 2 from axis 1, the rest from axis 2. Pair j of an axis of width d
// turns by id · θ^(-2j/d).
//
// Backward ADDS (+=) into its gradient buffer, like every op in src/ops.
#pragma once

#include <array>
#include <cstdint>

namespace fp8t::ops {

// cos and sin [tokens, head_dim / 2] from ids [tokens, 3] (float positions). The angles and
// their cos and sin are computed in double and rounded to fp32, as the reference does.
void flux_rope_tables(float* cos, float* sin, const float* ids, int64_t tokens,
                      const std::array<int, 3>& axes_dim, double theta);

// x [tokens, heads, head_dim] (q or k with the heads of each token contiguous):
// out = (x0 cos - x1 sin, x0 sin + x1 cos) per pair. out may be inp.
template <typename T>
void flux_rope_forward(T* out, const T* inp, const float* cos, const float* sin, int64_t tokens,
                       int64_t heads, int64_t head_dim);

// dinp += the inverse rotation of dout. dinp must not alias dout.
template <typename T>
void flux_rope_backward(T* dinp, const T* dout, const float* cos, const float* sin, int64_t tokens,
                        int64_t heads, int64_t head_dim);

}  // namespace fp8t::ops
