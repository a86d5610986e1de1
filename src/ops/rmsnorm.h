// RMSNorm without a learnable weight (nanochat's norm(): F.rms_norm over the last dim), used
// after the embedding, before attention and MLP, on q and k per head, and before lm_head.
//
// Backward ADDS (+=) into its gradient buffer, like every op in src/ops.
#pragma once

#include <cstdint>
#include <limits>

#include "core/non_deduced.h"

namespace fp8t::ops {

// F.rms_norm with eps=None takes the machine epsilon of the computation type, which is float
// for fp32 and bf16 inputs alike: 1.1920929e-07.
inline constexpr double kRmsNormEps = std::numeric_limits<float>::epsilon();

// y = x * rstd with rstd = 1 / sqrt(mean(x^2) + eps), row by row.
// inp, out: [rows, dim] (out may be inp: the normalization runs in place);
// rstd: [rows], saved for the backward.
template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, int64_t rows, int64_t dim,
                     NonDeduced<T> eps = kRmsNormEps);

// dinp += rstd * (dout - out * mean(dout * out)), row by row. It needs the forward's output
// and rstd, not its input, so an in-place forward loses nothing the backward needs.
// dinp, dout, out: [rows, dim]; rstd: [rows]. dinp must not alias dout or out.
template <typename T>
void rmsnorm_backward(T* dinp, const T* dout, const T* out, const T* rstd, int64_t rows,
                      int64_t dim);

}  // namespace fp8t::ops
