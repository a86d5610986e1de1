#include "ops/attention.h"
#include "ops/vector_math.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace fp8t::ops {
namespace {

void check_attention_shape(const AttentionShape& shape) {
  FP8T_CHECK(shape.batch >= 0, "expected batch >= 0, found {}", shape.batch);
  FP8T_CHECK(shape.seq_len >= 0, "expected seq_len >= 0, found {}", shape.seq_len);
  FP8T_CHECK(shape.kv_heads > 0, "expected kv_heads > 0, found {}", shape.kv_heads);
  FP8T_CHECK(shape.heads > 0 && shape.heads % shape.kv_heads == 0,
             "expected heads a positive multiple of kv_heads ({}), found {}", shape.kv_heads,
             shape.heads);
  FP8T_CHECK(shape.head_dim > 0, "expected head_dim > 0, found {}", shape.head_dim);
  FP8T_CHECK(shape.window >= 0, "expected window >= 0 (>= seq_len for full causal), found {}",
             shape.window);
}

// Row offsets into the [batch, seq_len, heads, head_dim] tensors and the [batch, heads,
// seq_len] log-sum-exp.
struct AttentionIndex {
  const AttentionShape& shape;

  int64_t q_row(int64_t b, int64_t t, int64_t h) const {
    return ((b * shape.seq_len + t) * shape.heads + h) * shape.head_dim;
  }
  int64_t kv_row(int64_t b, int64_t t, int64_t kv_head) const {
    return ((b * shape.seq_len + t) * shape.kv_heads + kv_head) * shape.head_dim;
  }
  int64_t lse(int64_t b, int64_t h, int64_t t) const {
    return (b * shape.heads + h) * shape.seq_len + t;
  }
  int64_t kv_head_of(int64_t h) const { return h / (shape.heads / shape.kv_heads); }
  int64_t first_key(int64_t t) const { return std::max<int64_t>(0, t - shape.window); }
};

}  // namespace

template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                       const AttentionShape& shape, std::type_identity_t<T> scale) {
  check_attention_shape(shape);
  const AttentionIndex index{shape};
  const int64_t dim = shape.head_dim;
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t h = 0; h < shape.heads; ++h) {
      const int64_t kv_head = index.kv_head_of(h);
      for (int64_t t = 0; t < shape.seq_len; ++t) {
        const T* q_row = q + index.q_row(b, t, h);
        T* out_row = out + index.q_row(b, t, h);
        const int64_t first = index.first_key(t);
        // Two passes over the keys (max, then exp-sum and the weighted values) instead of a
        // buffer of scores: the dot products are recomputed, nothing is allocated.
        T max_score = -std::numeric_limits<T>::infinity();
        for (int64_t j = first; j <= t; ++j) {
          max_score = std::max(max_score, scale * dot(q_row, k + index.kv_row(b, j, kv_head), dim));
        }
        std::fill(out_row, out_row + dim, T(0));
        T sum = 0;
        for (int64_t j = first; j <= t; ++j) {
          const T p =
              std::exp(scale * dot(q_row, k + index.kv_row(b, j, kv_head), dim) - max_score);
          sum += p;
          const T* v_row = v + index.kv_row(b, j, kv_head);
          for (int64_t d = 0; d < dim; ++d)
            out_row[d] += p * v_row[d];
        }
        for (int64_t d = 0; d < dim; ++d)
          out_row[d] /= sum;
        lse[index.lse(b, h, t)] = max_score + std::log(sum);
      }
    }
  }
}

template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* out, const T* lse, const AttentionShape& shape,
                        std::type_identity_t<T> scale) {
  check_attention_shape(shape);
  const AttentionIndex index{shape};
  const int64_t dim = shape.head_dim;
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t h = 0; h < shape.heads; ++h) {
      const int64_t kv_head = index.kv_head_of(h);
      for (int64_t t = 0; t < shape.seq_len; ++t) {
        const int64_t row = index.q_row(b, t, h);
        const T* q_row = q + row;
        const T* dout_row = dout + row;
        T* dq_row = dq + row;
        const T row_lse = lse[index.lse(b, h, t)];
        // d(softmax)/d(score) contracts to p * (dp - sum_j p_j dp_j), and
        // sum_j p_j dp_j = sum_j p_j (dout . v_j) = dout . out.
        const T dout_dot_out = dot(dout_row, out + row, dim);
        for (int64_t j = index.first_key(t); j <= t; ++j) {
          const int64_t key = index.kv_row(b, j, kv_head);
          const T p = std::exp(scale * dot(q_row, k + key, dim) - row_lse);
          const T dp = dot(dout_row, v + key, dim);
          const T dscore = p * (dp - dout_dot_out) * scale;
          for (int64_t d = 0; d < dim; ++d) {
            dv[key + d] += p * dout_row[d];
            dq_row[d] += dscore * k[key + d];
            dk[key + d] += dscore * q_row[d];
          }
        }
      }
    }
  }
}

template void attention_forward<float>(float*, float*, const float*, const float*, const float*,
                                       const AttentionShape&, float);
template void attention_forward<double>(double*, double*, const double*, const double*,
                                        const double*, const AttentionShape&, double);
template void attention_backward<float>(float*, float*, float*, const float*, const float*,
                                        const float*, const float*, const float*, const float*,
                                        const AttentionShape&, float);
template void attention_backward<double>(double*, double*, double*, const double*, const double*,
                                         const double*, const double*, const double*, const double*,
                                         const AttentionShape&, double);

}  // namespace fp8t::ops
