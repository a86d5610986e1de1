#include "ops/embedding.h"

#include "core/error.h"

namespace fp8t::ops {
namespace {

void check_embedding_args(const int32_t* ids, int64_t num_tokens, int64_t vocab, int64_t dim) {
  FP8T_CHECK(num_tokens >= 0, "expected num_tokens >= 0, found {}", num_tokens);
  FP8T_CHECK(vocab > 0, "expected vocab > 0, found {}", vocab);
  FP8T_CHECK(dim > 0, "expected dim > 0, found {}", dim);
  // Checked up front so that a bad id leaves the outputs untouched.
  for (int64_t n = 0; n < num_tokens; ++n) {
    FP8T_CHECK(ids[n] >= 0 && ids[n] < vocab, "expected token ids in [0, {}), found {} at {}",
               vocab, ids[n], n);
  }
}

}  // namespace

template <typename T>
void embedding_forward(T* out, const int32_t* ids, const T* table, int64_t num_tokens,
                       int64_t vocab, int64_t dim) {
  check_embedding_args(ids, num_tokens, vocab, dim);
  for (int64_t n = 0; n < num_tokens; ++n) {
    const T* row = table + ids[n] * dim;
    T* out_row = out + n * dim;
    for (int64_t i = 0; i < dim; ++i)
      out_row[i] = row[i];
  }
}

template <typename T>
void embedding_backward(T* dtable, const T* dout, const int32_t* ids, int64_t num_tokens,
                        int64_t vocab, int64_t dim) {
  check_embedding_args(ids, num_tokens, vocab, dim);
  for (int64_t n = 0; n < num_tokens; ++n) {
    T* drow = dtable + ids[n] * dim;
    const T* dout_row = dout + n * dim;
    for (int64_t i = 0; i < dim; ++i)
      drow[i] += dout_row[i];
  }
}

template void embedding_forward<float>(float*, const int32_t*, const float*, int64_t, int64_t,
                                       int64_t);
template void embedding_forward<double>(double*, const int32_t*, const double*, int64_t, int64_t,
                                        int64_t);
template void embedding_backward<float>(float*, const float*, const int32_t*, int64_t, int64_t,
                                        int64_t);
template void embedding_backward<double>(double*, const double*, const int32_t*, int64_t, int64_t,
                                         int64_t);

}  // namespace fp8t::ops
