// Flux's adaptive modulation (BFL flux1's modulate and gated residual): per sample b, vectors
// shift, scale and gate [batch, dim] (chunks of the modulation linear's output) act on every
// token of that sample's sequence x [batch, tokens, dim].
//
// Backward ADDS (+=) into every gradient buffer, like every op in src/ops.
#pragma once

#include <cstdint>

namespace fp8t::ops {

struct ModulationShape {
  int64_t batch;
  int64_t tokens;  // per sample
  int64_t dim;
};

// out = x_norm · (1 + scale) + shift. out may be x_norm. scale and shift are rows of a
// [batch, stride] buffer (stride >= dim), so the chunks of one modulation output serve as is.
template <typename T>
void modulate_forward(T* out, const T* x_norm, const T* scale, const T* shift, int64_t stride,
                      const ModulationShape& shape);

// dx_norm += dout · (1 + scale); dscale += Σ_tokens dout · x_norm; dshift += Σ_tokens dout.
// dscale and dshift have the stride of scale and shift.
template <typename T>
void modulate_backward(T* dx_norm, T* dscale, T* dshift, const T* dout, const T* x_norm,
                       const T* scale, int64_t stride, const ModulationShape& shape);

// residual += gate · branch (in place).
template <typename T>
void gated_residual_forward(T* residual, const T* branch, const T* gate, int64_t stride,
                            const ModulationShape& shape);

// dbranch += gate · dresidual; dgate += Σ_tokens dresidual · branch. The residual's own
// gradient passes through unchanged (nothing to do).
template <typename T>
void gated_residual_backward(T* dbranch, T* dgate, const T* dresidual, const T* branch,
                             const T* gate, int64_t stride, const ModulationShape& shape);

}  // namespace fp8t::ops
