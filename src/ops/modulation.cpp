#include "ops/modulation.h"

#include "core/error.h"

namespace fp8t::ops {

namespace {

void check(int64_t stride, const ModulationShape& shape) {
  FP8T_CHECK(shape.batch >= 0 && shape.tokens >= 0 && shape.dim >= 1,
             "expected a non-negative [batch, tokens] and dim >= 1, found [{}, {}, {}]",
             shape.batch, shape.tokens, shape.dim);
  FP8T_CHECK(stride >= shape.dim, "expected a modulation stride >= dim ({}), found {}", shape.dim,
             stride);
}

// Calls row(b, first) for every token of every sample: first is the token's offset in
// [batch, tokens, dim].
template <typename Row>
void for_each_token(int64_t stride, const ModulationShape& shape, Row&& row) {
  check(stride, shape);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t t = 0; t < shape.tokens; ++t)
      row(b, (b * shape.tokens + t) * shape.dim);
  }
}

}  // namespace

template <typename T>
void modulate_forward(T* out, const T* x_norm, const T* scale, const T* shift, int64_t stride,
                      const ModulationShape& shape) {
  for_each_token(stride, shape, [&](int64_t b, int64_t row) {
    for (int64_t c = 0; c < shape.dim; ++c)
      out[row + c] = x_norm[row + c] * (T(1) + scale[b * stride + c]) + shift[b * stride + c];
  });
}

template <typename T>
void modulate_backward(T* dx_norm, T* dscale, T* dshift, const T* dout, const T* x_norm,
                       const T* scale, int64_t stride, const ModulationShape& shape) {
  for_each_token(stride, shape, [&](int64_t b, int64_t row) {
    for (int64_t c = 0; c < shape.dim; ++c) {
      const T dy = dout[row + c];
      dx_norm[row + c] += dy * (T(1) + scale[b * stride + c]);
      dscale[b * stride + c] += dy * x_norm[row + c];
      dshift[b * stride + c] += dy;
    }
  });
}

template <typename T>
void gated_residual_forward(T* residual, const T* branch, const T* gate, int64_t stride,
                            const ModulationShape& shape) {
  for_each_token(stride, shape, [&](int64_t b, int64_t row) {
    for (int64_t c = 0; c < shape.dim; ++c)
      residual[row + c] += gate[b * stride + c] * branch[row + c];
  });
}

template <typename T>
void gated_residual_backward(T* dbranch, T* dgate, const T* dresidual, const T* branch,
                             const T* gate, int64_t stride, const ModulationShape& shape) {
  for_each_token(stride, shape, [&](int64_t b, int64_t row) {
    for (int64_t c = 0; c < shape.dim; ++c) {
      dbranch[row + c] += gate[b * stride + c] * dresidual[row + c];
      dgate[b * stride + c] += dresidual[row + c] * branch[row + c];
    }
  });
}

#define FP8T_INSTANTIATE_MODULATION(T)                                                    \
  template void modulate_forward<T>(T*, const T*, const T*, const T*, int64_t,            \
                                    const ModulationShape&);                              \
  template void modulate_backward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t,   \
                                     const ModulationShape&);                             \
  template void gated_residual_forward<T>(T*, const T*, const T*, int64_t,                \
                                          const ModulationShape&);                        \
  template void gated_residual_backward<T>(T*, T*, const T*, const T*, const T*, int64_t, \
                                           const ModulationShape&);
FP8T_INSTANTIATE_MODULATION(float)
FP8T_INSTANTIATE_MODULATION(double)
#undef FP8T_INSTANTIATE_MODULATION

}  // namespace fp8t::ops
