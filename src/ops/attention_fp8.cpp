#include "ops/attention_fp8.h"

#include <array>
#include <cmath>
#include <vector>

#include "gemm/cpu_gemm.h"
#include "numerics/quantize.h"
#include "ops/attention_tiles.h"
#include "ops/vector_math.h"

namespace fp8t::ops {
namespace {

// One quantization point: x is stored as encode_saturating(x · scale) (saturating like
// quantize() in numerics/quantize.h: a scale that is too large clips at the format's maximum
// instead of giving inf) and read back as decode(code) / scale, in T. The 256 read-back values
// are computed once.
template <typename T>
class Fp8Point {
 public:
  Fp8Point(float scale, Fp8Format format) : scale_(scale), format_(format) {
    for (int code = 0; code < 256; ++code)
      values_[size_t(code)] = T(decode(uint8_t(code), format)) / T(scale);
  }

  T operator()(T x) const {
    return values_[encode(static_cast<float>(x * T(scale_)), format_, Saturation::Saturate)];
  }
  std::vector<T> operator()(const T* x, int64_t count) const {
    std::vector<T> result(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i)
      result[size_t(i)] = (*this)(x[i]);
    return result;
  }

 private:
  float scale_;
  Fp8Format format_;
  std::array<T, 256> values_;
};

// max(amax, |x|); a NaN sticks, as in fp8t::amax.
template <typename T>
void update_amax(T& amax, T x) {
  x = std::fabs(x);
  if (x > amax || std::isnan(x)) amax = x;
}

template <typename T>
float max_abs(const std::vector<T>& x) {
  T amax = 0;
  for (const T value : x)
    update_amax(amax, value);
  return static_cast<float>(amax);
}

}  // namespace

template <typename T>
void attention_fp8_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                           const AttentionShape& shape, NonDeduced<T> scale,
                           const AttentionFp8Formats& formats, const AttentionFp8Scales& scales,
                           AttentionFp8Amaxes* amaxes) {
  detail::check_attention_shape(shape);
  const detail::AttentionIndex index{shape};
  const int64_t dim = shape.head_dim, q_count = index.q_count(), kv_count = index.kv_count();
  const int64_t q_stride = shape.heads * dim, kv_stride = shape.kv_heads * dim;
  const Fp8Format format = formats.forward;
  const std::vector<T> q_fp8 = Fp8Point<T>(scales.q, format)(q, q_count);
  const std::vector<T> k_fp8 = Fp8Point<T>(scales.k, format)(k, kv_count);
  const std::vector<T> v_fp8 = Fp8Point<T>(scales.v, format)(v, kv_count);
  const Fp8Point<T> p_point(scales.p, format), o_point(scales.o, format);
  std::vector<T> o(static_cast<size_t>(q_count), T(0));
  std::vector<T> probabilities(static_cast<size_t>(detail::kQueryTile * shape.seq_len));
  T amax_p = 0;
  detail::for_each_tile(index, [&](const detail::AttentionTile& tile) {
    detail::tile_probabilities(probabilities.data(), index, tile, q_fp8.data() + tile.q_row,
                               k_fp8.data() + tile.kv_row, T(scale), nullptr, lse + tile.lse);
    for (int64_t i = 0; i < tile.rows * tile.keys; ++i) {
      update_amax(amax_p, probabilities[size_t(i)]);
      probabilities[size_t(i)] = p_point(probabilities[size_t(i)]);
    }
    gemm::dgrad_dyw(tile.rows, tile.keys, dim, probabilities.data(), tile.keys,
                    v_fp8.data() + tile.kv_row, kv_stride, o.data() + tile.q_row, q_stride);
  });
  if (amaxes != nullptr) {
    amaxes->p = static_cast<float>(amax_p);
    amaxes->o = max_abs(o);
  }
  for (int64_t i = 0; i < q_count; ++i)
    out[i] = o_point(o[size_t(i)]);
}

template <typename T>
void attention_fp8_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                            const T* out, const T* lse, const AttentionShape& shape,
                            NonDeduced<T> scale, const AttentionFp8Formats& formats,
                            const AttentionFp8Scales& scales, AttentionFp8Amaxes* amaxes) {
  detail::check_attention_shape(shape);
  const detail::AttentionIndex index{shape};
  const int64_t dim = shape.head_dim, q_count = index.q_count(), kv_count = index.kv_count();
  const int64_t q_stride = shape.heads * dim, kv_stride = shape.kv_heads * dim;
  const Fp8Format forward = formats.forward, backward = formats.backward;
  const std::vector<T> q_fp8 = Fp8Point<T>(scales.q, forward)(q, q_count);
  const std::vector<T> k_fp8 = Fp8Point<T>(scales.k, forward)(k, kv_count);
  const std::vector<T> v_fp8 = Fp8Point<T>(scales.v, forward)(v, kv_count);
  const std::vector<T> out_fp8 = Fp8Point<T>(scales.o, forward)(out, q_count);
  const std::vector<T> dout_fp8 = Fp8Point<T>(scales.dout, backward)(dout, q_count);
  const Fp8Point<T> p_point(scales.p, forward), ds_point(scales.ds, backward);
  // The gradients are quantized as whole tensors: each is complete (summed over the tiles and,
  // for dK and dV, over the query heads of a kv head) before it is.
  std::vector<T> dq_full(static_cast<size_t>(q_count), T(0));
  std::vector<T> dk_full(static_cast<size_t>(kv_count), T(0));
  std::vector<T> dv_full(static_cast<size_t>(kv_count), T(0));
  const size_t tile_entries = static_cast<size_t>(detail::kQueryTile * shape.seq_len);
  std::vector<T> probabilities(tile_entries), probabilities_fp8(tile_entries);
  std::vector<T> dscores(tile_entries);
  T amax_ds = 0;
  detail::for_each_tile(index, [&](const detail::AttentionTile& tile) {
    const int64_t row = tile.q_row, key = tile.kv_row;
    const int64_t rows = tile.rows, keys = tile.keys;
    detail::tile_probabilities(probabilities.data(), index, tile, q_fp8.data() + row,
                               k_fp8.data() + key, T(scale), lse + tile.lse, nullptr);
    for (int64_t i = 0; i < rows * keys; ++i)
      probabilities_fp8[size_t(i)] = p_point(probabilities[size_t(i)]);
    gemm::wgrad_dytx(rows, keys, dim, probabilities_fp8.data(), keys, dout_fp8.data() + row,
                     q_stride, dv_full.data() + key, kv_stride);
    // dP = dÔ·V̂ᵀ; dS = P ∘ (dP − Δ) · scale with Δ = rowsum(dÔ ∘ Ô), the softmax's
    // contraction taken from the output as the flash kernels do.
    gemm::forward_xwt(rows, keys, dim, dout_fp8.data() + row, q_stride, v_fp8.data() + key,
                      kv_stride, dscores.data(), keys, false);
    for (int64_t r = 0; r < rows; ++r) {
      const T* o_row = out_fp8.data() + row + r * q_stride;
      const T* do_row = dout_fp8.data() + row + r * q_stride;
      const T delta = dot(do_row, o_row, dim);
      T* ds = dscores.data() + r * keys;
      const T* p = probabilities.data() + r * keys;
      for (int64_t j = 0; j < keys; ++j) {
        ds[j] = p[j] * (ds[j] - delta) * T(scale);
        update_amax(amax_ds, ds[j]);
        ds[j] = ds_point(ds[j]);
      }
    }
    gemm::dgrad_dyw(rows, keys, dim, dscores.data(), keys, k_fp8.data() + key, kv_stride,
                    dq_full.data() + row, q_stride);
    gemm::wgrad_dytx(rows, keys, dim, dscores.data(), keys, q_fp8.data() + row, q_stride,
                     dk_full.data() + key, kv_stride);
  });
  if (amaxes != nullptr) {
    amaxes->ds = static_cast<float>(amax_ds);
    amaxes->dq = max_abs(dq_full);
    amaxes->dk = max_abs(dk_full);
    amaxes->dv = max_abs(dv_full);
  }
  const Fp8Point<T> dq_point(scales.dq, backward), dk_point(scales.dk, backward),
      dv_point(scales.dv, backward);
  for (int64_t i = 0; i < q_count; ++i)
    dq[i] += dq_point(dq_full[size_t(i)]);
  for (int64_t i = 0; i < kv_count; ++i) {
    dk[i] += dk_point(dk_full[size_t(i)]);
    dv[i] += dv_point(dv_full[size_t(i)]);
  }
}

template void attention_fp8_forward<float>(float*, float*, const float*, const float*, const float*,
                                           const AttentionShape&, float, const AttentionFp8Formats&,
                                           const AttentionFp8Scales&, AttentionFp8Amaxes*);
template void attention_fp8_forward<double>(double*, double*, const double*, const double*,
                                            const double*, const AttentionShape&, double,
                                            const AttentionFp8Formats&, const AttentionFp8Scales&,
                                            AttentionFp8Amaxes*);
template void attention_fp8_backward<float>(float*, float*, float*, const float*, const float*,
                                            const float*, const float*, const float*, const float*,
                                            const AttentionShape&, float,
                                            const AttentionFp8Formats&, const AttentionFp8Scales&,
                                            AttentionFp8Amaxes*);
template void attention_fp8_backward<double>(double*, double*, double*, const double*,
                                             const double*, const double*, const double*,
                                             const double*, const double*, const AttentionShape&,
                                             double, const AttentionFp8Formats&,
                                             const AttentionFp8Scales&, AttentionFp8Amaxes*);

void AttentionFp8::forward(float* out, float* lse, const float* q, const float* k, const float* v,
                           const AttentionShape& shape, float scale) {
  const detail::AttentionIndex index{shape};
  attention_fp8_forward_scales(scales_, amax(q, index.q_count()), amax(k, index.kv_count()),
                               amax(v, index.kv_count()), formats_);
  attention_fp8_forward(out, lse, q, k, v, shape, scale, formats_, scales_, nullptr);
}

void AttentionFp8::backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                            const float* k, const float* v, const float* out, const float* lse,
                            const AttentionShape& shape, float scale) {
  const detail::AttentionIndex index{shape};
  const float amax_dout = amax(dout, index.q_count());
  const auto pass = [&](float* dq_to, float* dk_to, float* dv_to) {
    attention_fp8_backward_scales(scales_, amax_dout, gradient_amaxes_, formats_);
    attention_fp8_backward(dq_to, dk_to, dv_to, dout, q, k, v, out, lse, shape, scale, formats_,
                           scales_, &gradient_amaxes_);
  };
  if (!measured_) {
    // Two measuring passes (header comment): the first measures dS, the second dQ, dK and dV.
    // What they add to the scratch is not read; the amaxes are taken before it is added.
    gradient_amaxes_ = {};
    std::vector<float> scratch(static_cast<size_t>(index.q_count() + 2 * index.kv_count()));
    float* scratch_dk = scratch.data() + index.q_count();
    for (int measuring = 0; measuring < 2; ++measuring)
      pass(scratch.data(), scratch_dk, scratch_dk + index.kv_count());
    measured_ = amax_dout > 0.0f;
  }
  pass(dq, dk, dv);
}

}  // namespace fp8t::ops
