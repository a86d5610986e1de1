// LayerNorm without learnable parameters (Flux's norms before modulation: elementwise_affine
// False, eps 1e-6), row by row.
//
// Backward ADDS (+=) into its gradient buffer, like every op in src/ops.
#pragma once

#include <cstdint>

#include "core/non_deduced.h"

namespace fp8t::ops {

inline constexpr double kFluxLayerNormEps = 1e-6;

// y = (x - mean(x)) * rstd with rstd = 1 / sqrt(var(x) + eps) (biased variance, as
// torch.nn.LayerNorm). inp, out: [rows, dim] (out may be inp); rstd: [rows], saved for the
// backward.
template <typename T>
void layernorm_forward(T* out, T* rstd, const T* inp, int64_t rows, int64_t dim,
                       NonDeduced<T> eps = static_cast<NonDeduced<T>>(kFluxLayerNormEps));

// dinp += rstd * (dout - mean(dout) - out * mean(dout * out)), from the forward's output and
// rstd. dinp must not alias dout or out.
template <typename T>
void layernorm_backward(T* dinp, const T* dout, const T* out, const T* rstd, int64_t rows,
                        int64_t dim);

}  // namespace fp8t::ops
