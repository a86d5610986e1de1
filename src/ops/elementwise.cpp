#include "ops/elementwise.h"
#include "ops/vector_math.h"

#include <cmath>

#include "core/error.h"

namespace fp8t::ops {
namespace {

void check_count(int64_t n) {
  FP8T_CHECK(n >= 0, "expected n >= 0, found {}", n);
}

template <typename T>
T sigmoid(T z) {
  return T(1) / (T(1) + std::exp(-z));
}

// The value gate is 3 sigmoid(z): range (0, 3), neutral (1.5) at z = 0.
constexpr double kValueGateRange = 3.0;

}  // namespace

void check_value_gate_shape(const ValueGateShape& shape) {
  FP8T_CHECK(shape.tokens >= 0, "expected tokens >= 0, found {}", shape.tokens);
  FP8T_CHECK(shape.kv_heads > 0, "expected kv_heads > 0, found {}", shape.kv_heads);
  FP8T_CHECK(shape.head_dim > 0, "expected head_dim > 0, found {}", shape.head_dim);
  FP8T_CHECK(shape.gate_channels > 0 && shape.gate_channels <= shape.channels,
             "expected gate_channels in [1, channels = {}], found {}", shape.channels,
             shape.gate_channels);
}

void check_smear_shape(const SmearShape& shape) {
  FP8T_CHECK(shape.batch >= 0, "expected batch >= 0, found {}", shape.batch);
  FP8T_CHECK(shape.seq_len >= 0, "expected seq_len >= 0, found {}", shape.seq_len);
  FP8T_CHECK(shape.gate_channels > 0 && shape.gate_channels <= shape.channels,
             "expected gate_channels in [1, channels = {}], found {}", shape.channels,
             shape.gate_channels);
}

template <typename T>
void relu2_forward(T* out, const T* inp, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) {
    const T r = inp[i] > T(0) ? inp[i] : T(0);
    out[i] = r * r;
  }
}

template <typename T>
void relu2_backward(T* dinp, const T* dout, const T* inp, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) {
    if (inp[i] > T(0)) dinp[i] += T(2) * inp[i] * dout[i];
  }
}

template <typename T>
void value_gate_forward(T* v, T* gate, const T* x_norm, const T* value_embed, const T* gate_weight,
                        const ValueGateShape& shape) {
  check_value_gate_shape(shape);
  const int64_t kv_dim = shape.kv_heads * shape.head_dim;
  for (int64_t n = 0; n < shape.tokens; ++n) {
    const T* x_row = x_norm + n * shape.channels;
    for (int64_t h = 0; h < shape.kv_heads; ++h) {
      const T z = dot(x_row, gate_weight + h * shape.gate_channels, shape.gate_channels);
      const T g = static_cast<T>(kValueGateRange) * sigmoid(z);
      gate[n * shape.kv_heads + h] = g;
      const int64_t offset = n * kv_dim + h * shape.head_dim;
      for (int64_t d = 0; d < shape.head_dim; ++d)
        v[offset + d] += g * value_embed[offset + d];
    }
  }
}

template <typename T>
void value_gate_backward(T* dx_norm, T* dgate_weight, T* dvalue_embed, const T* dv, const T* x_norm,
                         const T* value_embed, const T* gate_weight, const T* gate,
                         const ValueGateShape& shape) {
  check_value_gate_shape(shape);
  const int64_t kv_dim = shape.kv_heads * shape.head_dim;
  for (int64_t n = 0; n < shape.tokens; ++n) {
    const T* x_row = x_norm + n * shape.channels;
    T* dx_row = dx_norm + n * shape.channels;
    for (int64_t h = 0; h < shape.kv_heads; ++h) {
      const T g = gate[n * shape.kv_heads + h];
      const int64_t offset = n * kv_dim + h * shape.head_dim;
      const T dgate = dot(dv + offset, value_embed + offset, shape.head_dim);
      for (int64_t d = 0; d < shape.head_dim; ++d)
        dvalue_embed[offset + d] += g * dv[offset + d];
      // g = 3 s with s = sigmoid(z): dg/dz = 3 s (1 - s) = g (1 - g / 3).
      const T dz = dgate * g * (T(1) - g / static_cast<T>(kValueGateRange));
      const T* w_row = gate_weight + h * shape.gate_channels;
      T* dw_row = dgate_weight + h * shape.gate_channels;
      for (int64_t c = 0; c < shape.gate_channels; ++c) {
        dw_row[c] += dz * x_row[c];
        dx_row[c] += dz * w_row[c];
      }
    }
  }
}

template <typename T>
void smear_forward(T* out, T* gate, const T* inp, const T* gate_weight, NonDeduced<T> smear_lambda,
                   const SmearShape& shape) {
  check_smear_shape(shape);
  const int64_t channels = shape.channels;
  for (int64_t b = 0; b < shape.batch; ++b) {
    const T* x = inp + b * shape.seq_len * channels;
    T* y = out + b * shape.seq_len * channels;
    T* g = gate + b * shape.seq_len;
    // Last position first: row t reads rows t and t - 1 of inp, which an in-place smear has
    // not overwritten yet.
    for (int64_t t = shape.seq_len - 1; t >= 1; --t) {
      g[t] = sigmoid(dot(x + t * channels, gate_weight, shape.gate_channels));
      const T mix = smear_lambda * g[t];
      for (int64_t c = 0; c < channels; ++c)
        y[t * channels + c] = x[t * channels + c] + mix * x[(t - 1) * channels + c];
    }
    if (shape.seq_len > 0) {
      g[0] = 0;
      if (y != x) {
        for (int64_t c = 0; c < channels; ++c)
          y[c] = x[c];
      }
    }
  }
}

template <typename T>
void smear_backward(T* dinp, T* dgate_weight, T* dsmear_lambda, const T* dout, const T* inp,
                    const T* gate, const T* gate_weight, NonDeduced<T> smear_lambda,
                    const SmearShape& shape) {
  check_smear_shape(shape);
  const int64_t channels = shape.channels;
  double dlambda = 0.0;
  for (int64_t b = 0; b < shape.batch; ++b) {
    const T* x = inp + b * shape.seq_len * channels;
    const T* dy = dout + b * shape.seq_len * channels;
    T* dx = dinp + b * shape.seq_len * channels;
    const T* g = gate + b * shape.seq_len;
    for (int64_t t = 0; t < shape.seq_len; ++t) {
      for (int64_t c = 0; c < channels; ++c)
        dx[t * channels + c] += dy[t * channels + c];
    }
    for (int64_t t = 1; t < shape.seq_len; ++t) {
      const T* dy_row = dy + t * channels;
      const T* x_prev = x + (t - 1) * channels;
      const T mix = smear_lambda * g[t];
      for (int64_t c = 0; c < channels; ++c)
        dx[(t - 1) * channels + c] += mix * dy_row[c];
      const T dy_dot_prev = dot(dy_row, x_prev, channels);
      dlambda += static_cast<double>(g[t] * dy_dot_prev);
      // d(sigmoid)/dz = s (1 - s).
      const T dz = smear_lambda * dy_dot_prev * g[t] * (T(1) - g[t]);
      for (int64_t c = 0; c < shape.gate_channels; ++c) {
        dgate_weight[c] += dz * x[t * channels + c];
        dx[t * channels + c] += dz * gate_weight[c];
      }
    }
  }
  *dsmear_lambda += static_cast<T>(dlambda);
}

template <typename T>
void residual_mix_forward(T* out, const T* x, const T* x0, NonDeduced<T> resid_lambda,
                          NonDeduced<T> x0_lambda, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i)
    out[i] = resid_lambda * x[i] + x0_lambda * x0[i];
}

template <typename T>
void residual_mix_backward(T* dx, T* dx0, T* dresid_lambda, T* dx0_lambda, const T* dout,
                           const T* x, const T* x0, NonDeduced<T> resid_lambda,
                           NonDeduced<T> x0_lambda, int64_t n) {
  check_count(n);
  double dresid = 0.0;
  double dx0_scalar = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    dx[i] += resid_lambda * dout[i];
    dx0[i] += x0_lambda * dout[i];
    dresid += static_cast<double>(dout[i]) * static_cast<double>(x[i]);
    dx0_scalar += static_cast<double>(dout[i]) * static_cast<double>(x0[i]);
  }
  *dresid_lambda += static_cast<T>(dresid);
  *dx0_lambda += static_cast<T>(dx0_scalar);
}

template <typename T>
void backout_forward(T* out, const T* x, const T* x_backout, NonDeduced<T> backout_lambda,
                     int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i)
    out[i] = x[i] - backout_lambda * x_backout[i];
}

template <typename T>
void backout_backward(T* dx, T* dx_backout, T* dbackout_lambda, const T* dout, const T* x_backout,
                      NonDeduced<T> backout_lambda, int64_t n) {
  check_count(n);
  double dlambda = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    dx[i] += dout[i];
    dx_backout[i] -= backout_lambda * dout[i];
    dlambda -= static_cast<double>(dout[i]) * static_cast<double>(x_backout[i]);
  }
  *dbackout_lambda += static_cast<T>(dlambda);
}

#define FP8T_INSTANTIATE_ELEMENTWISE(T)                                                      \
  template void relu2_forward<T>(T*, const T*, int64_t);                                     \
  template void relu2_backward<T>(T*, const T*, const T*, int64_t);                          \
  template void value_gate_forward<T>(T*, T*, const T*, const T*, const T*,                  \
                                      const ValueGateShape&);                                \
  template void value_gate_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,   \
                                       const T*, const ValueGateShape&);                     \
  template void smear_forward<T>(T*, T*, const T*, const T*, T, const SmearShape&);          \
  template void smear_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, T,     \
                                  const SmearShape&);                                        \
  template void residual_mix_forward<T>(T*, const T*, const T*, T, T, int64_t);              \
  template void residual_mix_backward<T>(T*, T*, T*, T*, const T*, const T*, const T*, T, T, \
                                         int64_t);                                           \
  template void backout_forward<T>(T*, const T*, const T*, T, int64_t);                      \
  template void backout_backward<T>(T*, T*, T*, const T*, const T*, T, int64_t);

FP8T_INSTANTIATE_ELEMENTWISE(float)
FP8T_INSTANTIATE_ELEMENTWISE(double)
#undef FP8T_INSTANTIATE_ELEMENTWISE

}  // namespace fp8t::ops
