#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "gemm/cpu_gemm.h"
#include "ops/vector_math.h"

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
  FP8T_CHECK(!shape.causal || shape.window >= 0,
             "expected window >= 0 (>= seq_len for full causal), found {}", shape.window);
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
  // The keys query t sees: first_key(t) .. last_key(t).
  int64_t first_key(int64_t t) const {
    return shape.causal ? std::max<int64_t>(0, t - shape.window) : 0;
  }
  int64_t last_key(int64_t t) const { return shape.causal ? t : shape.seq_len - 1; }
};

// Both passes work on tiles of kQueryTile queries of one head against the keys the tile sees,
// with GEMMs for the score and value products; entries outside a query's window get
// probability 0. The [tile, keys] score buffers are the only temporaries.
constexpr int64_t kQueryTile = 64;

struct AttentionTile {
  int64_t t0, rows;  // queries t0 .. t0 + rows - 1
  int64_t k0, keys;  // keys k0 .. k0 + keys - 1: what any query of the tile sees
};

AttentionTile tile_at(const AttentionIndex& index, int64_t t0) {
  const int64_t rows = std::min(kQueryTile, index.shape.seq_len - t0);
  const int64_t k0 = index.first_key(t0);
  return {t0, rows, k0, index.last_key(t0 + rows - 1) + 1 - k0};
}

// probabilities[r, j] = exp(scale * q_r . k_j - lse_r) for the keys query r sees, else 0; with
// lse null, the row's own log-sum-exp is computed first and written to row_lse.
template <typename T>
void tile_probabilities(T* probabilities, const AttentionIndex& index, const AttentionTile& tile,
                        const T* q_tile, const T* k_tile, T scale, NonDeduced<const T*> lse,
                        NonDeduced<T*> row_lse) {
  const AttentionShape& shape = index.shape;
  gemm::forward_xwt(tile.rows, tile.keys, shape.head_dim, q_tile, shape.heads * shape.head_dim,
                    k_tile, shape.kv_heads * shape.head_dim, probabilities, tile.keys, false);
  for (int64_t r = 0; r < tile.rows; ++r) {
    T* row = probabilities + r * tile.keys;
    const int64_t t = tile.t0 + r;
    const int64_t first = index.first_key(t) - tile.k0, last = index.last_key(t) - tile.k0;
    std::fill(row, row + first, T(0));
    std::fill(row + last + 1, row + tile.keys, T(0));
    T offset;
    if (lse != nullptr) {
      offset = lse[r];
    } else {
      T max_score = -std::numeric_limits<T>::infinity();
      for (int64_t j = first; j <= last; ++j)
        max_score = std::max(max_score, scale * row[j]);
      T sum = 0;
      for (int64_t j = first; j <= last; ++j)
        sum += std::exp(scale * row[j] - max_score);
      offset = max_score + std::log(sum);
      row_lse[r] = offset;
    }
    for (int64_t j = first; j <= last; ++j)
      row[j] = std::exp(scale * row[j] - offset);
  }
}

}  // namespace

template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                       const AttentionShape& shape, NonDeduced<T> scale) {
  check_attention_shape(shape);
  const AttentionIndex index{shape};
  const int64_t dim = shape.head_dim, q_stride = shape.heads * dim;
  const int64_t kv_stride = shape.kv_heads * dim;
  std::vector<T> probabilities(size_t(kQueryTile * shape.seq_len));
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t h = 0; h < shape.heads; ++h) {
      const int64_t kv_head = index.kv_head_of(h);
      for (int64_t t0 = 0; t0 < shape.seq_len; t0 += kQueryTile) {
        const AttentionTile tile = tile_at(index, t0);
        const int64_t key = index.kv_row(b, tile.k0, kv_head);
        T* out_tile = out + index.q_row(b, t0, h);
        tile_probabilities(probabilities.data(), index, tile, q + index.q_row(b, t0, h), k + key,
                           T(scale), nullptr, lse + index.lse(b, h, t0));
        for (int64_t r = 0; r < tile.rows; ++r)
          std::fill(out_tile + r * q_stride, out_tile + r * q_stride + dim, T(0));
        gemm::dgrad_dyw(tile.rows, tile.keys, dim, probabilities.data(), tile.keys, v + key,
                        kv_stride, out_tile, q_stride);
      }
    }
  }
}

template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* lse, const AttentionShape& shape, NonDeduced<T> scale) {
  check_attention_shape(shape);
  const AttentionIndex index{shape};
  const int64_t dim = shape.head_dim, q_stride = shape.heads * dim;
  const int64_t kv_stride = shape.kv_heads * dim;
  std::vector<T> probabilities(size_t(kQueryTile * shape.seq_len));
  std::vector<T> dscores(probabilities.size());
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t h = 0; h < shape.heads; ++h) {
      const int64_t kv_head = index.kv_head_of(h);
      for (int64_t t0 = 0; t0 < shape.seq_len; t0 += kQueryTile) {
        const AttentionTile tile = tile_at(index, t0);
        const int64_t row = index.q_row(b, t0, h), key = index.kv_row(b, tile.k0, kv_head);
        tile_probabilities(probabilities.data(), index, tile, q + row, k + key, T(scale),
                           lse + index.lse(b, h, t0), nullptr);
        // dp = dout · vᵀ; d(softmax)/d(score) contracts to p * (dp - sum_j p_j dp_j).
        gemm::forward_xwt(tile.rows, tile.keys, dim, dout + row, q_stride, v + key, kv_stride,
                          dscores.data(), tile.keys, false);
        for (int64_t r = 0; r < tile.rows; ++r) {
          T* ds = dscores.data() + r * tile.keys;
          const T* p = probabilities.data() + r * tile.keys;
          const T expected_dp = dot(p, ds, tile.keys);
          for (int64_t j = 0; j < tile.keys; ++j)
            ds[j] = p[j] * (ds[j] - expected_dp) * T(scale);
        }
        gemm::dgrad_dyw(tile.rows, tile.keys, dim, dscores.data(), tile.keys, k + key, kv_stride,
                        dq + row, q_stride);
        gemm::wgrad_dytx(tile.rows, tile.keys, dim, dscores.data(), tile.keys, q + row, q_stride,
                         dk + key, kv_stride);
        gemm::wgrad_dytx(tile.rows, tile.keys, dim, probabilities.data(), tile.keys, dout + row,
                         q_stride, dv + key, kv_stride);
      }
    }
  }
}

template void attention_forward<float>(float*, float*, const float*, const float*, const float*,
                                       const AttentionShape&, float);
template void attention_forward<double>(double*, double*, const double*, const double*,
                                        const double*, const AttentionShape&, double);
template void attention_backward<float>(float*, float*, float*, const float*, const float*,
                                        const float*, const float*, const float*,
                                        const AttentionShape&, float);
template void attention_backward<double>(double*, double*, double*, const double*, const double*,
                                         const double*, const double*, const double*,
                                         const AttentionShape&, double);

}  // namespace fp8t::ops
