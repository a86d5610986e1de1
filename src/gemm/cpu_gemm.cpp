#include "gemm/cpu_gemm.h"

#include <algorithm>
#include <limits>

#include <cblas.h>

#include "core/error.h"

namespace fp8t::gemm {

namespace {

// BLAS takes int sizes (blasint is 32-bit in the OpenBLAS we link): refuse what would wrap.
blasint to_blas(int64_t value, const char* what) {
  FP8T_CHECK(value >= 0 && value <= std::numeric_limits<blasint>::max(),
             "expected {} in [0, {}], found {}", what, std::numeric_limits<blasint>::max(), value);
  return static_cast<blasint>(value);
}

void check_operand(const void* data, int64_t rows, int64_t cols, int64_t ld, const char* name) {
  FP8T_CHECK(ld >= cols, "expected the leading dimension of {} to be >= its {} columns, found {}",
             name, cols, ld);
  FP8T_CHECK(data != nullptr || rows == 0 || cols == 0, "expected {} ([{}, {}]), found null", name,
             rows, cols);
}

void check_sizes(int64_t m, int64_t n, int64_t k) {
  FP8T_CHECK(m >= 0 && n >= 0 && k >= 0, "expected non-negative GEMM sizes, found M={} N={} K={}",
             m, n, k);
}

void call_gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int64_t m, int64_t n, int64_t k,
               const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
               int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a, trans_b, to_blas(m, "M"), to_blas(n, "N"), to_blas(k, "K"),
              1.0f, a, to_blas(lda, "lda"), b, to_blas(ldb, "ldb"), beta, c, to_blas(ldc, "ldc"));
}

void call_gemm(CBLAS_TRANSPOSE trans_a, CBLAS_TRANSPOSE trans_b, int64_t m, int64_t n, int64_t k,
               const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
               int64_t ldc) {
  cblas_dgemm(CblasRowMajor, trans_a, trans_b, to_blas(m, "M"), to_blas(n, "N"), to_blas(k, "K"),
              1.0, a, to_blas(lda, "lda"), b, to_blas(ldb, "ldb"), beta, c, to_blas(ldc, "ldc"));
}

template <typename T>
void forward_impl(int64_t m, int64_t n, int64_t k, const T* x, int64_t ldx, const T* w, int64_t ldw,
                  T* y, int64_t ldy, bool accumulate) {
  check_sizes(m, n, k);
  check_operand(x, m, k, ldx, "x");
  check_operand(w, n, k, ldw, "W");
  check_operand(y, m, n, ldy, "y");
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum; BLAS would reject the zero leading dimensions
    if (!accumulate) {
      for (int64_t row = 0; row < m; ++row)
        std::fill_n(y + row * ldy, n, T{0});
    }
    return;
  }
  call_gemm(CblasNoTrans, CblasTrans, m, n, k, x, ldx, w, ldw, accumulate ? T{1} : T{0}, y, ldy);
}

template <typename T>
void dgrad_impl(int64_t m, int64_t n, int64_t k, const T* dy, int64_t lddy, const T* w, int64_t ldw,
                T* dx, int64_t lddx) {
  check_sizes(m, n, k);
  check_operand(dy, m, n, lddy, "dy");
  check_operand(w, n, k, ldw, "W");
  check_operand(dx, m, k, lddx, "dx");
  if (m == 0 || n == 0 || k == 0) return;  // nothing to add
  call_gemm(CblasNoTrans, CblasNoTrans, m, k, n, dy, lddy, w, ldw, T{1}, dx, lddx);
}

template <typename T>
void wgrad_impl(int64_t m, int64_t n, int64_t k, const T* dy, int64_t lddy, const T* x, int64_t ldx,
                T* dw, int64_t lddw) {
  check_sizes(m, n, k);
  check_operand(dy, m, n, lddy, "dy");
  check_operand(x, m, k, ldx, "x");
  check_operand(dw, n, k, lddw, "dW");
  if (m == 0 || n == 0 || k == 0) return;  // nothing to add
  call_gemm(CblasTrans, CblasNoTrans, n, k, m, dy, lddy, x, ldx, T{1}, dw, lddw);
}

}  // namespace

void forward_xwt(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w,
                 int64_t ldw, float* y, int64_t ldy, bool accumulate) {
  forward_impl(m, n, k, x, ldx, w, ldw, y, ldy, accumulate);
}
void forward_xwt(int64_t m, int64_t n, int64_t k, const double* x, int64_t ldx, const double* w,
                 int64_t ldw, double* y, int64_t ldy, bool accumulate) {
  forward_impl(m, n, k, x, ldx, w, ldw, y, ldy, accumulate);
}

void dgrad_dyw(int64_t m, int64_t n, int64_t k, const float* dy, int64_t lddy, const float* w,
               int64_t ldw, float* dx, int64_t lddx) {
  dgrad_impl(m, n, k, dy, lddy, w, ldw, dx, lddx);
}
void dgrad_dyw(int64_t m, int64_t n, int64_t k, const double* dy, int64_t lddy, const double* w,
               int64_t ldw, double* dx, int64_t lddx) {
  dgrad_impl(m, n, k, dy, lddy, w, ldw, dx, lddx);
}

void wgrad_dytx(int64_t m, int64_t n, int64_t k, const float* dy, int64_t lddy, const float* x,
                int64_t ldx, float* dw, int64_t lddw) {
  wgrad_impl(m, n, k, dy, lddy, x, ldx, dw, lddw);
}
void wgrad_dytx(int64_t m, int64_t n, int64_t k, const double* dy, int64_t lddy, const double* x,
                int64_t ldx, double* dw, int64_t lddw) {
  wgrad_impl(m, n, k, dy, lddy, x, ldx, dw, lddw);
}

}  // namespace fp8t::gemm
