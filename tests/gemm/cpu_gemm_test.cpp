// The CPU GEMMs of a linear layer against a naive triple loop in double, on awkward shapes,
// with padded leading dimensions (the padding must stay untouched).
#include "gemm/cpu_gemm.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "numerics/test_util.h"

namespace fp8t {
namespace {

struct Shape {
  int64_t m, n, k;
};
constexpr Shape kShapes[] = {{1, 1, 1}, {5, 7, 3}, {17, 130, 33}};
constexpr int64_t kPadding = 3;  // extra elements per row beyond the columns

// A row-major matrix whose rows are `cols + kPadding` apart; padding holds random values too.
template <typename T>
struct Matrix {
  int64_t rows;
  int64_t cols;
  int64_t ld;
  std::vector<T> data;

  T& at(int64_t r, int64_t c) { return data[static_cast<size_t>(r * ld + c)]; }
  T at(int64_t r, int64_t c) const { return data[static_cast<size_t>(r * ld + c)]; }
};

template <typename T>
Matrix<T> random_matrix(test::TestRng& rng, int64_t rows, int64_t cols) {
  Matrix<T> matrix{rows, cols, cols + kPadding, {}};
  matrix.data.resize(static_cast<size_t>(rows * matrix.ld));
  for (T& value : matrix.data)
    value = static_cast<T>(rng.uniform(-1.0, 1.0));
  return matrix;
}

// ‖out − ref‖ / ‖Σ|terms|‖ over the logical elements, for
// ref[r, c] = initial[r, c] + Σ_l a(r, l)·b(c, l) computed in double. Relative to the sum of
// the terms' magnitudes rather than to ‖ref‖, because an accumulated sum (C + A·B) may cancel
// to almost nothing on tiny shapes. `initial` may be null (a plain product).
template <typename T, typename A, typename B>
double error_against_naive(const Matrix<T>& out, const Matrix<T>* initial, int64_t inner, A a,
                           B b) {
  double diff = 0, norm = 0;
  for (int64_t r = 0; r < out.rows; ++r) {
    for (int64_t c = 0; c < out.cols; ++c) {
      double value = initial != nullptr ? double(initial->at(r, c)) : 0.0;
      double magnitude = std::fabs(value);
      for (int64_t l = 0; l < inner; ++l) {
        const double term = double(a(r, l)) * double(b(c, l));
        value += term;
        magnitude += std::fabs(term);
      }
      diff += (out.at(r, c) - value) * (out.at(r, c) - value);
      norm += magnitude * magnitude;
    }
  }
  return std::sqrt(diff / norm);
}

template <typename T>
void expect_padding_unchanged(const Matrix<T>& out, const Matrix<T>& before) {
  for (int64_t r = 0; r < out.rows; ++r) {
    for (int64_t c = out.cols; c < out.ld; ++c)
      ASSERT_EQ(out.at(r, c), before.at(r, c)) << "padding at " << r << "," << c;
  }
}

template <typename T>
double tolerance();
template <>
double tolerance<float>() {
  return 1e-6;
}
template <>
double tolerance<double>() {
  return 1e-14;
}

template <typename T>
class CpuGemm : public ::testing::Test {};
using Types = ::testing::Types<float, double>;
TYPED_TEST_SUITE(CpuGemm, Types);

TYPED_TEST(CpuGemm, ForwardIsXTimesWTransposed) {
  using T = TypeParam;
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "M=" << s.m << " N=" << s.n << " K=" << s.k);
    const Matrix<T> x = random_matrix<T>(rng, s.m, s.k);
    const Matrix<T> w = random_matrix<T>(rng, s.n, s.k);
    for (bool accumulate : {false, true}) {
      Matrix<T> y = random_matrix<T>(rng, s.m, s.n);
      if (!accumulate) {  // must be overwritten, not read
        for (int64_t r = 0; r < s.m; ++r) {
          for (int64_t c = 0; c < s.n; ++c)
            y.at(r, c) = std::numeric_limits<T>::quiet_NaN();
        }
      }
      const Matrix<T> before = y;
      gemm::forward_xwt(s.m, s.n, s.k, x.data.data(), x.ld, w.data.data(), w.ld, y.data.data(),
                        y.ld, accumulate);
      const double error = error_against_naive(
          y, accumulate ? &before : nullptr, s.k, [&](int64_t i, int64_t p) { return x.at(i, p); },
          [&](int64_t j, int64_t p) { return w.at(j, p); });
      EXPECT_LE(error, tolerance<T>()) << "accumulate " << accumulate;
      expect_padding_unchanged(y, before);
    }
  }
}

TYPED_TEST(CpuGemm, DgradAddsDyTimesW) {
  using T = TypeParam;
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "M=" << s.m << " N=" << s.n << " K=" << s.k);
    const Matrix<T> dy = random_matrix<T>(rng, s.m, s.n);
    const Matrix<T> w = random_matrix<T>(rng, s.n, s.k);
    Matrix<T> dx = random_matrix<T>(rng, s.m, s.k);
    const Matrix<T> before = dx;
    gemm::dgrad_dyw(s.m, s.n, s.k, dy.data.data(), dy.ld, w.data.data(), w.ld, dx.data.data(),
                    dx.ld);
    const double error = error_against_naive(
        dx, &before, s.n, [&](int64_t i, int64_t j) { return dy.at(i, j); },
        [&](int64_t p, int64_t j) { return w.at(j, p); });
    EXPECT_LE(error, tolerance<T>());
    expect_padding_unchanged(dx, before);
  }
}

TYPED_TEST(CpuGemm, WgradAddsDyTransposedTimesX) {
  using T = TypeParam;
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(::testing::Message() << "M=" << s.m << " N=" << s.n << " K=" << s.k);
    const Matrix<T> dy = random_matrix<T>(rng, s.m, s.n);
    const Matrix<T> x = random_matrix<T>(rng, s.m, s.k);
    Matrix<T> dw = random_matrix<T>(rng, s.n, s.k);
    const Matrix<T> before = dw;
    gemm::wgrad_dytx(s.m, s.n, s.k, dy.data.data(), dy.ld, x.data.data(), x.ld, dw.data.data(),
                     dw.ld);
    const double error = error_against_naive(
        dw, &before, s.m, [&](int64_t j, int64_t i) { return dy.at(i, j); },
        [&](int64_t p, int64_t i) { return x.at(i, p); });
    EXPECT_LE(error, tolerance<T>());
    expect_padding_unchanged(dw, before);
  }
}

TEST(CpuGemm, EmptyReductionWritesZerosOrLeavesTheSum) {
  std::vector<float> y = {std::nanf(""), 2.0f, 3.0f, 4.0f, 5.0f, 6.0f};
  gemm::forward_xwt(2, 3, 0, nullptr, 0, nullptr, 0, y.data(), 3, /*accumulate=*/false);
  EXPECT_EQ(y, std::vector<float>(6, 0.0f));
  std::vector<float> dx = {1.0f, 2.0f};
  gemm::dgrad_dyw(2, 0, 1, nullptr, 0, nullptr, 1, dx.data(), 1);  // no outputs: nothing to add
  EXPECT_EQ(dx, (std::vector<float>{1.0f, 2.0f}));
  std::vector<float> dw = {1.0f, 2.0f};
  gemm::wgrad_dytx(0, 2, 1, nullptr, 2, nullptr, 1, dw.data(), 1);  // no tokens
  EXPECT_EQ(dw, (std::vector<float>{1.0f, 2.0f}));
}

TEST(CpuGemm, RejectsShortLeadingDimensionsAndNegativeSizes) {
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 0.0f);
  EXPECT_THROW(gemm::forward_xwt(2, 2, 4, a.data(), 3, b.data(), 4, c.data(), 2, false), Error);
  EXPECT_THROW(gemm::dgrad_dyw(2, 2, 4, a.data(), 2, b.data(), 4, c.data(), 3), Error);
  EXPECT_THROW(gemm::wgrad_dytx(2, 2, 4, a.data(), 2, b.data(), 4, c.data(), 2), Error);
  EXPECT_THROW(gemm::forward_xwt(-1, 2, 4, a.data(), 4, b.data(), 4, c.data(), 2, false), Error);
  EXPECT_THROW(gemm::forward_xwt(2, 2, 4, nullptr, 4, b.data(), 4, c.data(), 2, false), Error);
  try {
    gemm::forward_xwt(2, 2, 4, a.data(), 3, b.data(), 4, c.data(), 2, false);
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("found 3"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace fp8t
