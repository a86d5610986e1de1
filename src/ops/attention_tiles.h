// Internal to the CPU attention ops (attention.cpp, attention_fp8.cpp): the shape check, the
// offsets into attention's tensors, and the query tiles both ops run their passes over, with
// each tile's probabilities. Layouts as in ops/attention.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/error.h"
#include "core/non_deduced.h"
#include "gemm/cpu_gemm.h"
#include "ops/attention.h"

namespace fp8t::ops::detail {

inline void check_attention_shape(const AttentionShape& shape) {
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
// seq_len] log-sum-exp, and the tensors' sizes.
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
  int64_t q_count() const { return shape.batch * shape.seq_len * shape.heads * shape.head_dim; }
  int64_t kv_count() const { return shape.batch * shape.seq_len * shape.kv_heads * shape.head_dim; }
  // The keys query t sees: first_key(t) .. last_key(t).
  int64_t first_key(int64_t t) const {
    return shape.causal ? std::max<int64_t>(0, t - shape.window) : 0;
  }
  int64_t last_key(int64_t t) const { return shape.causal ? t : shape.seq_len - 1; }
};

// The passes work on tiles of kQueryTile queries of one head against the keys the tile sees,
// with GEMMs for the score and value products; entries outside a query's window get
// probability 0. The [tile, keys] score buffers are the only temporaries.
inline constexpr int64_t kQueryTile = 64;

// A tile of one (batch, head), and where it starts in attention's tensors.
struct AttentionTile {
  int64_t t0, rows;  // queries t0 .. t0 + rows - 1
  int64_t k0, keys;  // keys k0 .. k0 + keys - 1: what any query of the tile sees
  int64_t q_row;     // query t0's row in q (and out, dq)
  int64_t kv_row;    // key k0's row in k and v (and dk, dv)
  int64_t lse;       // query t0's log-sum-exp
};

// Calls visit(tile) for every tile of every (batch, head), in order.
template <typename Visit>
void for_each_tile(const AttentionIndex& index, const Visit& visit) {
  const AttentionShape& shape = index.shape;
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t h = 0; h < shape.heads; ++h) {
      const int64_t kv_head = index.kv_head_of(h);
      for (int64_t t0 = 0; t0 < shape.seq_len; t0 += kQueryTile) {
        const int64_t rows = std::min(kQueryTile, shape.seq_len - t0);
        const int64_t k0 = index.first_key(t0);
        visit(AttentionTile{t0, rows, k0, index.last_key(t0 + rows - 1) + 1 - k0,
                            index.q_row(b, t0, h), index.kv_row(b, k0, kv_head),
                            index.lse(b, h, t0)});
      }
    }
  }
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

}  // namespace fp8t::ops::detail
