#include "ops/attention.h"

#include <algorithm>
#include <vector>

#include "gemm/cpu_gemm.h"
#include "ops/attention_tiles.h"
#include "ops/vector_math.h"

namespace fp8t::ops {

template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                       const AttentionShape& shape, NonDeduced<T> scale) {
  detail::check_attention_shape(shape);
  const detail::AttentionIndex index{shape};
  const int64_t dim = shape.head_dim, q_stride = shape.heads * dim;
  const int64_t kv_stride = shape.kv_heads * dim;
  std::vector<T> probabilities(size_t(detail::kQueryTile * shape.seq_len));
  detail::for_each_tile(index, [&](const detail::AttentionTile& tile) {
    T* out_tile = out + tile.q_row;
    detail::tile_probabilities(probabilities.data(), index, tile, q + tile.q_row, k + tile.kv_row,
                               T(scale), nullptr, lse + tile.lse);
    for (int64_t r = 0; r < tile.rows; ++r)
      std::fill(out_tile + r * q_stride, out_tile + r * q_stride + dim, T(0));
    gemm::dgrad_dyw(tile.rows, tile.keys, dim, probabilities.data(), tile.keys, v + tile.kv_row,
                    kv_stride, out_tile, q_stride);
  });
}

template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                        const T* lse, const AttentionShape& shape, NonDeduced<T> scale) {
  detail::check_attention_shape(shape);
  const detail::AttentionIndex index{shape};
  const int64_t dim = shape.head_dim, q_stride = shape.heads * dim;
  const int64_t kv_stride = shape.kv_heads * dim;
  std::vector<T> probabilities(size_t(detail::kQueryTile * shape.seq_len));
  std::vector<T> dscores(probabilities.size());
  detail::for_each_tile(index, [&](const detail::AttentionTile& tile) {
    const int64_t row = tile.q_row, key = tile.kv_row;
    detail::tile_probabilities(probabilities.data(), index, tile, q + row, k + key, T(scale),
                               lse + tile.lse, nullptr);
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
  });
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
